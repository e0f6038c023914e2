"""Models the tests compile: small, configurable, written as ordinary nn.Modules."""

import torch
from torch import nn
from torch.nn import functional as F

ACTIVATIONS = {
    "relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "none": lambda x: x,
}


class Stack(nn.Module):
    """Linear layers `widths[i] -> widths[i+1]`, each with an activation, optionally a bias, a residual add
    (where the widths match) and a tail: elementwise (`scale`: * 0.5, `square`: x * x, `shift`: + 1),
    running along the features (`logcumsumexp`), reversing the batch (`flip`), or an operator pardsl has
    no rule for, computed whole (`fft`: the real part of the features' FFT)."""

    def __init__(self, widths, acts, biases, residual, tails):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=bias) for a, b, bias in zip(widths[:-1], widths[1:], biases)
        )
        self.acts, self.residual, self.tails = list(acts), list(residual), list(tails)

    def forward(self, x):
        for layer, act, res, tail in zip(self.layers, self.acts, self.residual, self.tails):
            h = ACTIVATIONS[act](layer(x))
            if res and h.shape == x.shape:
                h = h + x
            if tail == "scale":
                h = h * 0.5
            elif tail == "square":
                h = h * h
            elif tail == "shift":
                h = h + 1.0
            elif tail == "logcumsumexp":
                h = torch.logcumsumexp(h, dim=-1)
            elif tail == "flip":
                h = torch.flip(h, dims=[0])
            elif tail == "fft":
                h = torch.fft.fft(h, dim=-1).real
            x = h
        return x


class TwoHeads(nn.Module):
    """One trunk read by two heads: a broadcast value with several sharded consumers; a tuple output."""

    def __init__(self, d=16, h=32, with_sum=True):
        super().__init__()
        self.with_sum = with_sum
        self.trunk = nn.Linear(d, d)
        self.left = nn.Linear(d, h)
        self.right = nn.Linear(d, h)
        self.mix = nn.Linear(h, d)

    def forward(self, x):
        t = torch.tanh(self.trunk(x))
        mixed = self.mix(torch.relu(self.left(t)) * self.right(t))
        return (mixed, t.sum(dim=-1)) if self.with_sum else mixed


class Shapes(nn.Module):
    """Views, transposes, softmax, layer_norm, mean and sum: the shape-changing op families."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q = self.proj(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)   # b h s e
        scores = torch.softmax(q @ q.transpose(-1, -2) / 2.0, dim=-1)              # b h s s
        ctx = (scores @ q).transpose(1, 2).reshape(b, s, d)
        y = self.out(self.norm(ctx + x))
        return y, y.mean(dim=1), torch.log_softmax(y, dim=-1).sum()


class DictOut(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.enc = nn.Linear(d, d)
        self.register_buffer("scale", torch.full((d,), 2.0))

    def forward(self, x, y):
        h = self.enc(x) * self.scale
        return {"logits": h, "aux": (h + y,)}


def broken(**kwargs):
    raise ValueError("this factory always fails")


def not_a_module():
    return 42


class Classifier(nn.Module):
    """Logits and a cross-entropy loss against integer labels."""

    def __init__(self, d=16, classes=8, reduction="sum", label_smoothing=0.0, ignored_class=None, dtype="float32"):
        super().__init__()
        self.reduction, self.label_smoothing, self.ignored_class = reduction, label_smoothing, ignored_class
        self.body = nn.Linear(d, d, dtype=getattr(torch, dtype))
        self.head = nn.Linear(d, classes, dtype=getattr(torch, dtype))

    def forward(self, x, labels):
        logits = self.head(torch.relu(self.body(x)))
        if self.ignored_class is not None:  # as padding is labelled: -100, which the loss skips
            labels = labels.masked_fill(labels == self.ignored_class, -100)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction=self.reduction,
                               label_smoothing=self.label_smoothing)


class MaskedScores(nn.Module):
    """Hand-written masked attention and lookups as models write them: comparisons, masked_fill, where,
    cumsum, gather and advanced indexing, on values that may be split by batch, heads or hidden dim."""

    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x, lengths):
        b, s, d = x.shape
        h = self.proj(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
        scores = h @ h.transpose(-1, -2) / (d // self.heads) ** 0.5
        positions = torch.arange(s, device=x.device)
        scores = scores.masked_fill(positions[None, :] > positions[:, None], float("-inf"))  # causal
        padded = positions[None, :] >= lengths[:, None]  # keys past each sequence's length
        scores = torch.where(padded[:, None, None, :], torch.finfo(x.dtype).min, scores)
        mixed = (scores.softmax(-1) @ h).transpose(1, 2).reshape(b, s, d)
        running = torch.cumsum(mixed, dim=1) / (positions + 1)[None, :, None]
        last = torch.gather(running, 1, (lengths - 1)[:, None, None].expand(b, 1, d)).squeeze(1)
        early = running[:, positions[: s // 2]].mean(1)
        return self.out(last + early)


class NoGradRegion(nn.Module):
    """A parameter read under no_grad (as HF computes rotary tables): it gets no gradient through that read."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        with torch.no_grad():
            scale = self.fc.weight.abs().mean() + 1.0
        return self.fc(x) * scale


class Cuts(nn.Module):
    """narrow, chunk, split and cat along the feature dim, which a layout may split."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.up(x)
        first, second = h.chunk(2, dim=-1)
        gate, value = h.split(h.shape[-1] // 2, dim=-1)
        joined = torch.cat([torch.relu(first) * second, gate - value], dim=-1)
        return self.down(joined) + h.narrow(-1, 4, 8).sum(-1, keepdim=True)


class NoneOut(nn.Module):
    """A forward that computes and returns nothing."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.lin(x)
        return None


class Chatty(nn.Module):
    """A model that prints while it is traced and run."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        print("hello from the model")
        return self.lin(x)


def exits():
    import sys

    sys.exit(3)


def named(name: str):
    """A factory that checks the string it was given arrives as written."""
    if name != "café ü\n\\":
        raise ValueError(f"got {name!r}")
    return nn.Linear(4, 4)


class Faulty(nn.Module):
    """A model that misbehaves on one rank: sleeps forever, exits with code 7, or raises."""

    def __init__(self, kind: str = "sleep", rank: int = 1):
        super().__init__()
        self.kind, self.rank = kind, rank
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        import os
        import time

        import torch.distributed as dist

        if not torch.compiler.is_compiling() and x.device.type != "meta" and dist.is_initialized() \
                and dist.get_rank() == self.rank:
            if self.kind == "sleep":
                time.sleep(10 ** 6)
            elif self.kind == "exit":
                os._exit(7)
            else:
                raise RuntimeError("this rank's model failed")
        return self.lin(x)


class ConvNet(nn.Module):
    """Convolutions of random widths, kernels and strides, each followed by batch norm (training) or
    group norm, a ReLU written in place, and a pool; an in-place residual add where shapes allow; a
    classifier. What hypothesis varies in tests/test_model_families.py."""

    def __init__(self, widths=(3, 8, 8), kernels=(3, 3), strides=(1, 1), norms=("batch", "group"),
                 pools=("max", "avg"), classes=4):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(a, b, k, stride=s, padding=k // 2)
                                   for a, b, k, s in zip(widths[:-1], widths[1:], kernels, strides))
        self.norms = nn.ModuleList(nn.BatchNorm2d(b) if kind == "batch" else nn.GroupNorm(2, b)
                                   for b, kind in zip(widths[1:], norms))
        self.pools = list(pools)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x):
        for conv, norm, pool in zip(self.convs, self.norms, self.pools):
            h = norm(conv(x))
            if h.shape == x.shape:
                h += x
            h.relu_()
            if h.shape[-1] < 4:  # too small to pool
                pool = "none"
            x = torch.nn.functional.max_pool2d(h, 2) if pool == "max" else \
                torch.nn.functional.avg_pool2d(h, 2) if pool == "avg" else h
        return self.head(torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


class Overflowing(nn.Module):
    """A model whose serial output is itself infinite: nothing a compiled plan could be compared with."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * 1e38 * 1e38


class ProjectedNorm(nn.Module):
    """A linear, then a layer norm of its output, in any dtype: the norm's input needs a gradient."""

    def __init__(self, width: int = 64, dtype: str = "float32", affine: bool = True):
        super().__init__()
        self.proj = nn.Linear(width, width, dtype=getattr(torch, dtype))
        self.norm = nn.LayerNorm(width, elementwise_affine=affine, dtype=getattr(torch, dtype))

    def forward(self, x):
        return self.norm(self.proj(x))


class RMSNormed(nn.Module):
    """A linear, then an RMSNorm written as Hugging Face writes LLaMA's (float32 inside, cast back to the
    input's dtype before the weight), then a linear."""

    def __init__(self, width: int = 32, dtype: str = "float32", eps: float = 1e-6):
        super().__init__()
        self.proj = nn.Linear(width, width, dtype=getattr(torch, dtype))
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width).to(getattr(torch, dtype)))
        self.out = nn.Linear(width, width, dtype=getattr(torch, dtype))
        self.eps = eps

    def forward(self, x):
        hidden = self.proj(x)
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.out(self.weight * hidden.to(dtype))


class Rotated(nn.Module):
    """A linear to heads, a rotary position embedding written as Hugging Face writes LLaMA's
    (x·cos + rotate_half(x)·sin, the tables broadcast over batch and heads), then a linear back. With
    `learned`, the tables are parameters, so the rotation has gradients for them too."""

    def __init__(self, heads: int = 2, head_dim: int = 8, seq: int = 6, learned: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.proj = nn.Linear(heads * head_dim, heads * head_dim)
        self.out = nn.Linear(heads * head_dim, heads * head_dim)
        angles = torch.arange(seq)[:, None] * (0.5 ** torch.arange(head_dim // 2))[None, :]
        angles = torch.cat([angles, angles], -1)
        if learned:
            self.cos, self.sin = nn.Parameter(angles.cos()), nn.Parameter(angles.sin())
        else:
            self.register_buffer("cos", angles.cos())
            self.register_buffer("sin", angles.sin())

    @staticmethod
    def rotate_half(x):
        first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-second, first), dim=-1)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[None, None], self.sin[None, None]
        rotated = q * cos + self.rotate_half(q) * sin
        return self.out(rotated.transpose(1, 2).reshape(b, s, -1))


class MergedAfterGather(nn.Module):
    """A column-parallel linear (its output split on the last dim), then a view merging that dim with the
    one before: with the other dims too small to split, the view needs its input whole, so the all-gather
    along the last dim must hand it a tensor it can view."""

    def __init__(self, d=8):
        super().__init__()
        self.inner = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        return torch.tanh(self.inner(x)).view(b, s * d)


class RawProjections(nn.Module):
    """Projections written as products with parameters stored [in, out], as GPT-2's Conv1D and hand-written
    models keep them: two of one input (`x @ W`, a matmul of a 3-D input), one with a bias (`torch.addmm`)
    and one of a flattened input (`torch.mm`), each followed by a product that sums them back."""

    def __init__(self, d: int = 8, h: int = 16):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(d) + 0.5)
        self.up = nn.Parameter(torch.randn(d, h) / d ** 0.5)
        self.gate = nn.Parameter(torch.randn(d, h) / d ** 0.5)
        self.down = nn.Parameter(torch.randn(h, d) / h ** 0.5)
        self.head = nn.Parameter(torch.randn(d, h) / d ** 0.5)
        self.head_bias = nn.Parameter(torch.randn(h) / 4)
        self.out = nn.Parameter(torch.randn(h, d) / h ** 0.5)
        self.last = nn.Parameter(torch.randn(d, h) / d ** 0.5)

    def forward(self, x):
        x = x * self.scale
        y = torch.tanh(x + (torch.tanh(x @ self.up) * (x @ self.gate)) @ self.down)
        rows = y.reshape(-1, y.shape[-1])
        z = torch.tanh(torch.mm(torch.relu(torch.addmm(self.head_bias, rows, self.head)), self.out))
        return torch.mm(z, self.last)


class WithoutRules(nn.Module):
    """Operators pardsl has no rule for, between Megatron's column- and row-parallel linears: a spectral
    mix (fft, then the real part), a Kronecker product with a fixed matrix, and a QR factorisation (two
    results). Each reads a split value, is computed whole on every rank and gives whole values."""

    def __init__(self, d: int = 16, d_ff: int = 32):
        super().__init__()
        self.up = nn.Linear(d, d_ff)
        self.down = nn.Linear(d_ff, d)
        self.register_buffer("pair", torch.tensor([[1.0], [-0.5]]))

    def forward(self, x):
        h = torch.relu(self.up(x))                          # split over d_ff (column parallel)
        spectral = torch.fft.fft(h, dim=-1).real            # whole: an fft over the split dim
        doubled = torch.kron(h[0], self.pair)               # [2 * seq, d_ff]: whole
        q, r = torch.linalg.qr(doubled)                     # [2 * seq, d_ff] and [d_ff, d_ff]: whole
        return self.down(spectral + (q @ r)[: h.shape[1]])


class MadeFromData(nn.Module):
    """Tensors the forward makes from Python data, which export lifts as constants: Falcon's split of its
    fused projection (`x[..., [-2], :]`, an index list) and a table written in the forward. Traced on the
    meta device they have no values. And a bool buffer, as GPTBigCode's causal mask is."""

    def __init__(self, d: int = 8, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.fused = nn.Linear(d, d * (heads + 2) // heads)
        self.out = nn.Linear(d // heads, d)
        self.register_buffer("kept", torch.tensor([True, False, True, True])[:heads, None])

    def forward(self, x):
        b, s, _ = x.shape
        fused = self.fused(x).view(b, s, self.heads + 2, -1)
        query, key = fused[..., :-2, :], fused[..., [-2], :]
        scores = (query * key).sum(-1, keepdim=True)
        weights = torch.tensor([0.5, -1.0, 2.0, 0.25], device=x.device)[: self.heads, None]
        return self.out(torch.where(self.kept, query * scores * weights, query)).sum(2)


class PartlyFrozen(nn.Module):
    """A fine-tune's model: the embedding frozen (`requires_grad_(False)`, as Whisper freezes its
    sinusoidal positions), the layers above it trained."""

    def __init__(self, vocab: int = 64, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.embed.requires_grad_(False)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.embed(ids))))


class StochasticDepth(nn.Module):
    """Residual blocks each skipped for some samples at random in training (stochastic depth, drawn as
    Hugging Face's and timm's drop_path draw it: `rand` of [batch, 1]), and noise added to the output:
    random operators without a rule."""

    def __init__(self, d: int = 16, blocks: int = 2, rate: float = 0.5):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.rate = rate

    def forward(self, x):
        for block in self.blocks:
            update = torch.tanh(block(x))
            if self.training:
                keep = torch.rand(x.shape[0], 1, dtype=x.dtype, device=x.device) >= self.rate
                update = update * keep / (1 - self.rate)
            x = x + update
        return x + 0.1 * torch.randn(x.shape, dtype=x.dtype, device=x.device) if self.training else x


class ReturnsPart(nn.Module):
    """An encoder that computes a pooled summary its wrapper does not return, as BERT's and RoBERTa's
    pooler under a model that returns the hidden states: no gradient reaches the pooler."""

    class Encoder(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.body = nn.Linear(d, d)
            self.pooler = nn.Linear(d, d)

        def forward(self, x):
            h = torch.relu(self.body(x))
            return h, torch.tanh(self.pooler(h[:, 0]))

    def __init__(self, d: int = 16):
        super().__init__()
        self.encoder = ReturnsPart.Encoder(d)

    def forward(self, x):
        return self.encoder(x)[0]


def _zoo_experts(gate=None, post_norm: bool = False):
    """An experts module written as transformers writes them (its experts interface), with an eager
    forward; `gate`, where given, replaces the default act(gate) · up; `post_norm`: each expert's result
    normalised before it is weighted."""
    from transformers.integrations.moe import use_experts_implementation

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts, hidden, inner = config.num_experts, config.hidden_size, config.intermediate_size
            self.gate_up_proj = nn.Parameter(torch.randn(self.num_experts, 2 * inner, hidden) / hidden ** 0.5)
            self.down_proj = nn.Parameter(torch.randn(self.num_experts, hidden, inner) / inner ** 0.5)
            self.act_fn = nn.SiLU()
            if post_norm:
                self.post_expert_norm = nn.RMSNorm(hidden, eps=1e-6)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for token, experts in enumerate(top_k_index.tolist()):
                for choice, e in enumerate(experts):
                    h = self.down_proj[e] @ self._apply_gate(self.gate_up_proj[e] @ hidden_states[token])
                    out[token] += top_k_weights[token, choice] * (self.post_expert_norm(h) if post_norm else h)
            return out

    if gate is not None:
        Experts._apply_gate = gate
    return use_experts_implementation(Experts, has_post_expert_norm=post_norm)


class SkewedExperts(nn.Module):
    """A mixture of 4 experts whose router's choice is fixed, whatever its input, for `tokens` tokens:
    `last`, every token the last two experts (under expert parallelism on 2 ranks every pair goes to the
    second rank and the first rank's experts get none); `own`, the first half of the tokens the first two
    experts and the second half the last two (with the tokens split alike, no pair leaves its rank)."""

    def __init__(self, hidden: int = 16, inner: int = 8, experts: int = 4, gate=None, tokens: int = 24,
                 prefer: str = "last", post_norm: bool = False):
        super().__init__()
        import transformers

        config = transformers.PretrainedConfig()
        config.num_experts, config.hidden_size, config.intermediate_size = experts, hidden, inner
        config._experts_implementation = "eager"
        self.proj = nn.Linear(hidden, hidden)
        self.router = nn.Linear(hidden, experts)
        ranked = torch.arange(experts, dtype=torch.float32) * 5.0
        preference = ranked.expand(tokens, experts).clone()
        if prefer == "own":
            preference[: tokens // 2] = ranked.flip(0)
        self.register_buffer("preference", preference)
        self.experts = _zoo_experts(gate, post_norm)(config)

    def forward(self, x):
        h = self.proj(x).reshape(-1, x.shape[-1])
        scores, index = torch.topk(self.router(h) + self.preference, 2, dim=-1)
        out = self.experts(h, index, torch.softmax(scores, dim=-1))
        return out.reshape(x.shape)


class UnknownGateExperts(SkewedExperts):
    """Experts whose gate is none the op knows (up · gate, no activation), `post_norm`: each expert's
    result normalised (RMSNorm) before it is weighted, which the op does not do either."""

    def __init__(self, post_norm: bool = False):
        def plain_product(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return gate * up
        super().__init__(gate=plain_product, post_norm=post_norm)


class SequenceAttention(nn.Module):
    """Self-attention over x [batch, seq, heads · 8] with `kv_heads` key/value heads (grouped-query where
    fewer), causal by `is_causal`, or under a mask tensor (`masked`: a causal sliding window of 5 keys, as
    Mistral's), or neither."""

    def __init__(self, heads: int = 1, kv_heads: int = 1, causal: bool = True, masked: bool = False,
                 seq: int = 16):
        super().__init__()
        self.heads, self.kv_heads, self.causal = heads, kv_heads, causal
        width = heads * 8
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * kv_heads * 8)
        self.out = nn.Linear(width, width)
        distance = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]  # query's position - key's
        self.register_buffer("mask", ((distance >= 0) & (distance < 5))[None, None] if masked else None)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).reshape(b, s, self.heads, 8).transpose(1, 2)
        k, v = self.kv(x).reshape(b, s, 2, self.kv_heads, 8).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.causal and self.mask is None,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.out(a.transpose(1, 2).reshape(b, s, -1))


class ReadsTransposed(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, h):
        return self.linear(torch.relu(h.transpose(0, 1)))


class SendsAPermutedView(nn.Module):
    """A pipeline cut where the value crossing it is a transposed view, and the gradient sent back for it
    is one too (the second stage reads it transposed back)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.first = nn.Linear(d, d)
        self.second = ReadsTransposed(d)

    def forward(self, x):
        return self.second(self.first(x).transpose(0, 1))
