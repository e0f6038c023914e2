"""The blocks of a traced attention mask that hide every query from every key, found by running the mask's
ops on bounds (pardsl/layouts/masks.py), against the mask itself built for real: Hugging Face's causal
mask, the same with a padding mask given as an input, and Mistral's sliding window. A mask the bounds
cannot follow gives no answer, and ring attention under it is priced as computing every block."""

import pytest
import torch
import transformers

from pardsl.layouts.masks import blocks_of, busiest_zigzag_share, hidden_blocks
from pardsl.layouts.oprules import Signature
from pardsl.layouts.algebra import S

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa", use_cache=False)


def _traced_mask(model: torch.nn.Module, args: tuple) -> tuple[torch.fx.Node, torch.Tensor]:
    """The mask node of the model's first attention, and the mask it makes for `args`, built for real."""
    program = torch.export.export(model, args)
    attention = next(n for n in program.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    mask = attention.args[3]

    class Kept(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if node.name == mask.name:
                self.kept = value
            return value

    runner = Kept(program.module())
    runner.run(*args)
    return mask, runner.kept


def _hidden_for_real(mask: torch.Tensor, blocks: int) -> tuple[tuple[bool, ...], ...]:
    seen = mask if mask.dtype == torch.bool else torch.isfinite(mask)
    rows, columns = seen.shape[-2:]
    seen = seen.reshape(-1, blocks, rows // blocks, blocks, columns // blocks)
    return tuple(map(tuple, (~seen.any(dim=4).any(dim=2).any(dim=0)).tolist()))


def _models():
    ids = torch.randint(0, 64, (2, 256))
    padded = torch.ones(2, 256, dtype=torch.long)
    padded[1, :40] = 0  # the second sequence padded on the left
    return {
        "causal": (transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), (ids,)),
        "causal and padding": (transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), (ids, padded)),
        "sliding window": (transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=48)),
                           (ids,)),
    }


@pytest.mark.parametrize("kind", ["causal", "causal and padding", "sliding window"])
def test_the_blocks_a_traced_mask_hides_are_found_without_building_it(kind):
    """256 tokens in 64 blocks of 4: the blocks found hidden are exactly those the mask built for real
    hides whole (a padding mask is an input, any value, so only the causal order hides blocks there)."""
    model, args = _models()[kind]
    node, mask = _traced_mask(model, args)
    assert blocks_of(256) == 64
    found = hidden_blocks(node, 256)
    if kind == "causal and padding":  # the padding is not known when the plan is made: the causal blocks
        _, causal = _traced_mask(model, args[:1])
        assert found == _hidden_for_real(causal, 64)
    else:
        assert found == _hidden_for_real(mask, 64)
    above = sum(k > q for q in range(64) for k in range(64))
    hidden = sum(map(sum, found))
    if kind == "sliding window":  # beyond the window too: key blocks more than 12 behind the query block
        assert hidden == above + sum(k < q - 12 for q in range(64) for k in range(64))
    else:
        assert hidden == above


def test_a_mask_made_from_activations_gives_no_answer():
    """A mask the bounds cannot follow (made by a product of the activations): no blocks known hidden, and
    the ring priced as computing every one."""

    class ScoredMask(torch.nn.Module):
        def forward(self, x):
            mask = (x @ x.transpose(-1, -2)) > 0
            q = x.unsqueeze(1)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask.unsqueeze(1))

    node, _ = _traced_mask(ScoredMask(), (torch.randn(1, 16, 8),))
    assert hidden_blocks(node, 16) is None
    ring = Signature((S(2),) * 4, S(2), "S", name="ring_zigzag", hidden_blocks=None)
    assert ring.share_on(4) == 1.0


@pytest.mark.parametrize("ranks", [1, 2, 4, 8, 16, 32])
def test_a_causal_masks_zigzag_share_is_the_pairs_the_busiest_rank_computes(ranks):
    """Under a causal mask split zig-zag over n ranks, every rank computes 2n + 1 of its 4n (query piece,
    key piece) pairs: the pairs ring attention's block plan computes, which skips a pair the mask hides
    whole."""
    from pardsl.runtime.ring_attention import block_plan, pieces

    causal = tuple(tuple(k > q for k in range(64)) for q in range(64))
    share = busiest_zigzag_share(causal, ranks)
    assert share == (2 * ranks + 1) / (4 * ranks)
    # the runtime's plan, its mask hiding the same pieces
    hidden = [[b > a for b in range(2 * ranks)] for a in range(2 * ranks)]
    computed = max(sum(len(block_plan(pieces(r, ranks, True), pieces((r - step) % ranks, ranks, True), False,
                                      [hidden[a] for a in pieces(r, ranks, True)]))
                       for step in range(ranks)) for r in range(ranks))
    assert computed / (2 * 2 * ranks) == share


def test_an_additive_mask_hides_the_blocks_where_it_is_minus_infinity():
    """A mask added to the scores (0 where a key is seen, -inf where not), made from positions by
    `torch.where`: the blocks where it is -inf throughout are hidden, the causal ones."""

    class AdditiveCausal(torch.nn.Module):
        def forward(self, x):
            positions = torch.arange(x.shape[1])
            mask = torch.where(positions[None, :] <= positions[:, None], 0.0, float("-inf"))
            q = x.unsqueeze(1)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    node, mask = _traced_mask(AdditiveCausal(), (torch.randn(1, 128, 8),))
    found = hidden_blocks(node, 128)
    assert found == _hidden_for_real(mask, 64)
    assert sum(map(sum, found)) == sum(k > q for q in range(64) for k in range(64))


def test_a_mask_over_more_elements_than_allowed_gives_no_answer_before_its_bounds_are_made(monkeypatch):
    """Bounds as large as the mask's batch times its blocks squared are refused before they are made (a
    traced step of 15,360 sequences took 4 s and 3.6 GB here before), and the ring is priced as before."""
    from pardsl.layouts import masks

    made = []
    original = masks._Bounds.__init__

    def recorded(self, lo, hi):
        made.append(max(lo.numel(), hi.numel()))
        original(self, lo, hi)

    monkeypatch.setattr(masks._Bounds, "__init__", recorded)
    node, _ = _traced_mask(*_models()["causal"])  # [2, 1, 256, 256]: 2 x 64 x 64 elements of bounds
    monkeypatch.setattr(masks, "_MOST_ELEMENTS", 4096)
    assert masks._hidden_blocks(node, 256) is None
    assert made and max(made) <= 4096


def _attended(x, mask):
    q = x.unsqueeze(1)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


class _BoolDiff(torch.nn.Module):  # a diff of booleans is their xor: true at the one position it flips
    def forward(self, x):
        flag = torch.arange(x.shape[1]) < 8
        return _attended(x, torch.diff(flag, prepend=flag[:1])[None, :].expand(x.shape[1], x.shape[1]))


class _BoolSum(torch.nn.Module):  # booleans added are or'ed: True + True == 1 holds
    def forward(self, x):
        seen = torch.arange(x.shape[1]) >= 0
        return _attended(x, (seen[None, :] + seen[:, None]) == 1)


class _FilledBool(torch.nn.Module):  # -1 filled into a boolean is True
    def forward(self, x):
        keep = torch.full((x.shape[1], x.shape[1]), -1, dtype=torch.bool)
        return _attended(x, torch.where(keep, 0.0, float("-inf")))


class _Bf16Positions(torch.nn.Module):  # positions rounded in bfloat16: neighbours compare equal
    def forward(self, x):
        positions = torch.arange(x.shape[1] * 4)[: x.shape[1]].to(torch.bfloat16) * 4
        return _attended(x, positions[None, :] <= positions[:, None])


class _BitsAsInteger(torch.nn.Module):  # view(dtype) reads -inf's bits as an integer
    def forward(self, x):
        positions = torch.arange(x.shape[1])
        additive = torch.where(positions[None, :] <= positions[:, None], 0.0, float("-inf"))
        return _attended(x, additive.view(torch.int32) > -10**9)


class _NanInput(torch.nn.Module):  # NaN compares false: x <= inf is not always true
    def forward(self, x):
        positions = torch.arange(x.shape[1])
        return _attended(x, (positions[None, :] <= positions[:, None]) | ~(x[0, :, :1] <= float("inf")))


@pytest.mark.parametrize("model", [_BoolDiff, _BoolSum, _FilledBool, _Bf16Positions, _BitsAsInteger, _NanInput],
                         ids=lambda model: model.__name__.strip("_"))
def test_no_block_the_mask_shows_is_found_hidden(model):
    """Masks whose values a dtype holds otherwise than exactly (booleans added or diffed, a fill cast,
    bfloat16 rounding, bits reinterpreted, NaN): no block found hidden that the mask built for real shows."""
    x = torch.randn(1, 256, 8)
    x[0, 5, 0] = float("nan")
    node, mask = _traced_mask(model(), (x,))
    found = hidden_blocks(node, 256)
    real = _hidden_for_real(mask, 64)
    assert found is None or all(real[q][k] for q in range(64) for k in range(64) if found[q][k])


def test_attentions_under_different_masks_are_priced_each_for_its_own():
    """A sliding-window layer and a full one (Qwen2's `layer_types`): their ops' rules differ in the blocks
    each mask hides, so the search, which shares what it prices among equal rules, prices each for its
    own (4 ranks: 0.375 and 0.5625 of the pairs)."""
    from pardsl.layouts.oprules import dim_spec, rule_for

    config = transformers.Qwen2Config(**SMALL | dict(num_hidden_layers=2), use_sliding_window=True, sliding_window=48,
                                      max_window_layers=0, layer_types=["sliding_attention", "full_attention"])
    program = torch.export.export(transformers.Qwen2ForCausalLM(config), (torch.randint(0, 64, (1, 256)),))
    attentions = [n for n in program.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    specs = [dim_spec(n, rule_for(n)) for n in attentions]
    assert specs[0] != specs[1]
    shares = [next(form for form in spec.extra if form.name == "ring_zigzag").share_on(4) for spec in specs]
    assert shares == [0.375, 0.5625]
