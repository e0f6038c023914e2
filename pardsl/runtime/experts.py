"""A mixture-of-experts layer's experts as one op, `pardsl::experts`, and its parallel forms.

transformers writes every MoE family's experts the same way (its experts interface): hidden states
[T, H], each token's top-k expert ids and routing weights [T, k], and the experts' weights stacked,
[E, 2I, H] and [E, H, I] (transposed: [E, H, 2I] and [E, I, H]), with optional biases and a gate between
the two projections. Its own implementations sort the (token, choice) pairs by expert and compute with
shapes that follow the routing (`grouped_mm`), which a plan cannot lay out. As one op, with the routing
inside, every shape is static:

    experts(hidden, index, weights, gate_up, gate_up_bias, down, gate, transposed, act, alpha, limit)
        = Σ_k weights[t, k] · down_e(gate(gate_up_e · hidden[t] + gate_up_bias_e)),  e = index[t, k]

and the plan splits it three ways (pardsl/layouts/oprules.py, family "experts"):
- tokens split (data parallel): each rank its tokens, every expert whole;
- the experts' intermediate dim split (tensor parallel inside the experts): a partial sum;
- experts and tokens split over the same axis (expert parallel, as torchtitan and DeepSpeed-MoE do it):
  each rank sends every (token, choice) pair to the rank holding its expert and gets the result back:
  an all-to-all of each rank's per-expert counts, then `all_to_all_single` of the rows with those
  counts as its splits, each way; backward, the same two exchanges reversed. The bytes follow the
  routing: the plan counts a balanced routing, the run counts what was sent.

The gate is data: `GATES` holds the forms transformers' families use (their activation by name in
`ACTIVATIONS`); the model side (pardsl/model/moe.py) reads which one a module's experts use.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from pardsl.layouts.algebra import collective_bytes

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # Nemotron-H's experts'
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


def _glu(h: torch.Tensor, act, alpha: float, limit: float | None) -> torch.Tensor:
    """transformers' default: gate and up concatenated along the last dim, act(gate) · up."""
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


def _clamped_swiglu(h: torch.Tensor, act, alpha: float, limit: float | None) -> torch.Tensor:
    """GPT-OSS's: gate and up interleaved, each clamped to `limit`, gate · σ(α · gate) · (up + 1)."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _activation_only(h: torch.Tensor, act, alpha: float, limit: float | None) -> torch.Tensor:
    """Experts without a gate: act(up)."""
    return act(h)


# gate name: (function, whether gate and up are concatenated halves of the intermediate dim, which a
# split of that dim must keep together: S(d, blocks=2))
GATES = {
    "glu": (_glu, True),
    "clamped_swiglu": (_clamped_swiglu, False),
    "activation": (_activation_only, False),
}


def _project(rows: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return rows @ weight if transposed else rows @ weight.t()


def expert_ffn(rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None,
               down: torch.Tensor, gate: str, transposed: bool, act: str, alpha: float,
               limit: float | None) -> torch.Tensor:
    """Rows grouped by expert (`counts[e]` rows for local expert e, in order) through their experts."""
    gated, _ = GATES[gate]
    outputs, start = [], 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        h = _project(rows[start:start + count], gate_up[e], transposed)
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        outputs.append(_project(gated(h, ACTIVATIONS[act], alpha, limit), down[e], transposed))
        start += count
    if not outputs:
        # no row reached these experts: an empty result, joined to the rows and the weights all the same, so
        # backward runs the exchanges that brought the rows here on every rank alike, and gives the weights
        # their (zero) gradients
        width = down.shape[-1] if transposed else down.shape[1]
        joined = rows.sum() + gate_up.sum() + down.sum() + (gate_up_bias.sum() if gate_up_bias is not None else 0)
        return rows.new_zeros(0, width) + 0 * joined
    return torch.cat(outputs)


def experts_local(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_bias: torch.Tensor | None, down: torch.Tensor, gate: str, transposed: bool, act: str,
                  alpha: float, limit: float | None) -> torch.Tensor:
    """The op with every expert held."""
    ffn = (gate_up, gate_up_bias, down, gate, transposed, act, alpha, limit)
    return _pairs_through(hidden, index, weights, lambda rows, ids: _held_through(rows, ids, ffn))


def _pairs_through(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, run) -> torch.Tensor:
    """Each (token, choice) pair, sorted by expert, through `run(rows, expert ids)`, then weighted and
    summed back into its token."""
    tokens, choices = index.shape
    order = torch.argsort(index.reshape(-1), stable=True)
    out = run(hidden[order // choices], index.reshape(-1)[order])
    weighted = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return hidden.new_zeros(tokens, weighted.shape[-1]).index_add(0, order // choices, weighted.to(hidden.dtype))


def _held_through(rows: torch.Tensor, local: torch.Tensor, ffn: tuple) -> torch.Tensor:
    """Rows sorted by expert (`local`: each row's index among the rank's experts) through them: both the
    local path and the exchanges hand them over sorted."""
    return expert_ffn(rows, torch.bincount(local, minlength=ffn[0].shape[0]).tolist(), *ffn)


class _Exchange(torch.autograd.Function):
    """all_to_all_single of rows with per-peer counts; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows, rt, axis, sent, received):
        ctx.rt, ctx.axis, ctx.sent, ctx.received = rt, axis, sent, received
        return _exchanged(rows, rt, axis, sent, received, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _exchanged(grad, ctx.rt, ctx.axis, ctx.received, ctx.sent, "backward"), None, None, None, None


def _exchanged(rows: torch.Tensor, rt, axis: str, sent: list[int], received: list[int], phase: str) -> torch.Tensor:
    """Rows to each peer along `axis` (`sent[j]` of them to peer j, in order), theirs back: counted as the
    bytes that leave the rank."""
    def issue(phase: str) -> torch.Tensor:
        moved = rows.contiguous()
        out = moved.new_empty(sum(received), *moved.shape[1:])
        row_bytes = moved[0].numel() * moved.element_size() if len(moved) else 0
        rt.counter.record(phase, "all_to_all", (sum(sent) - sent[rt.coordinate[axis]]) * row_bytes, axis, routed=True)
        dist.all_to_all_single(out, moved, received, sent, group=rt.groups[axis])
        return out
    return rt._issued(phase, issue)


def _counts_exchanged(rt, axis: str, counts: torch.Tensor) -> torch.Tensor:
    """`counts` [n, m]: row j what this rank sends peer j; returns [n, m], row j what peer j sends it."""
    def issue(phase: str) -> torch.Tensor:
        sent = counts.contiguous()
        # filled by the peers; where nothing is sent (a dry run's fake process group), what this rank
        # sends: shapes stay sane and the rows stay about a balanced routing's
        received = sent.clone()
        rt.counter.record(phase, "all_to_all", collective_bytes("all_to_all", sent.numel() * sent.element_size(),
                                                                rt.size[axis]), axis)
        dist.all_to_all_single(received, sent, group=rt.groups[axis])
        return received
    return rt._issued("forward", issue)


def experts_exchanged(rt, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                      gate_up_bias: torch.Tensor | None, down: torch.Tensor, gate: str, transposed: bool, act: str,
                      alpha: float, limit: float | None, axes: tuple[str, ...]) -> torch.Tensor:
    """Expert parallel over `axes`, tokens and experts split alike (the experts' chunks over the axes in
    mesh order, outermost first): each (token, choice) pair is sent to the rank that holds its expert,
    one axis after the other, and its result comes back the same way."""
    held = gate_up.shape[0]
    levels = [axis for axis in rt.mesh.axis_names if axis in axes]
    total = held * math.prod(rt.size[axis] for axis in levels)
    ffn = (gate_up, gate_up_bias, down, gate, transposed, act, alpha, limit)
    return _pairs_through(hidden, index, weights, lambda rows, ids: _routed(
        rt, levels, rows, ids, 0, total, lambda arrived, local: _held_through(arrived, local, ffn)))


def _routed(rt, levels: list[str], rows: torch.Tensor, experts: torch.Tensor, lo: int, span: int,
            leaf) -> torch.Tensor:
    """Rows (sorted by `experts`, global ids in [lo, lo + span)) through their experts, in their order:
    exchanged over the first level's axis with the peer holding each one's chunk of the range, then on."""
    if not levels:
        return leaf(rows, experts - lo)
    axis, n = levels[0], rt.size[levels[0]]
    part = span // n
    per_expert = torch.bincount(experts - lo, minlength=span).reshape(n, part)  # rows for each peer's experts
    from_peers = _counts_exchanged(rt, axis, per_expert)  # [n, part]: each peer's rows for my experts
    sent, received = per_expert.sum(1).tolist(), from_peers.sum(1).tolist()
    arrived = _Exchange.apply(rows, rt, axis, sent, received)
    # each peer's rows come sorted by expert: their ids follow from the counts; sorted again across peers
    mine = lo + rt.coordinate[axis] * part
    ids = mine + torch.arange(part, device=rows.device).repeat(n).repeat_interleave(from_peers.reshape(-1))
    regroup = torch.argsort(ids, stable=True)
    done = _routed(rt, levels[1:], arrived[regroup], ids[regroup], mine, part, leaf)
    return _Exchange.apply(done[torch.argsort(regroup)], rt, axis, received, sent)


# --- the op the model is traced with ---------------------------------------------------------------

@torch.library.custom_op("pardsl::experts", mutates_args=())
def experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            gate_up_bias: torch.Tensor | None, down: torch.Tensor, gate: str, transposed: bool, act: str,
            alpha: float, limit: float | None) -> torch.Tensor:
    return experts_local(hidden, index, weights, gate_up, gate_up_bias, down, gate, transposed, act, alpha, limit)


@experts.register_fake
def _(hidden, index, weights, gate_up, gate_up_bias, down, gate, transposed, act, alpha, limit):
    return hidden.new_empty(hidden.shape[0], down.shape[-1] if transposed else down.shape[1])


def _setup(ctx, inputs, output):
    ctx.inputs = inputs


def _backward(ctx, grad):
    """The op's gradient by running it again under autograd (only tracing and a serial call reach it; a
    generated module computes the experts through the runtime's functions, which autograd records)."""
    hidden, index, weights, gate_up, gate_up_bias, down, *rest = ctx.inputs
    differentiable = [hidden, weights, gate_up, gate_up_bias, down]
    leaves = [t.detach().requires_grad_(t.is_floating_point()) if t is not None else None for t in differentiable]
    with torch.enable_grad():
        out = experts_local(leaves[0], index, leaves[1], leaves[2], leaves[3], leaves[4], *rest)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    g = [next(grads) if t is not None and t.requires_grad else None for t in leaves]
    return g[0], None, g[1], g[2], g[3], g[4], None, None, None, None, None


experts.register_autograd(_backward, setup_context=_setup)


def _flops(hidden_shape, index_shape, weights_shape, gate_up_shape, gate_up_bias_shape, down_shape, *args,
           out_shape=None, **kwargs) -> int:
    """Two products per (token, choice) pair, each of an expert's matrices."""
    pairs = index_shape[0] * index_shape[1]
    return 2 * pairs * (gate_up_shape[1] * gate_up_shape[2] + down_shape[1] * down_shape[2])


register_flop_formula(torch.ops.pardsl.experts)(_flops)


# --- experts whose gate the op does not know --------------------------------------------------------
# Their (token, choice) pairs, sorted by expert, go through each projection as one grouped matmul, and the
# module's own gate (and whatever it does after its experts) between and after them as the ops it is
# written in. The rows stay whole (where each expert's rows end follows the routing); the experts'
# intermediate dim may split, as a dense MLP's does.

@torch.library.custom_op("pardsl::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [S, K], sorted by expert (expert e's up to row ends[e]), each times its expert's weight[e]
    [K, N]: [S, N]."""
    out = rows.new_zeros(rows.shape[0], weight.shape[2])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = rows[start:end] @ weight[e]
        start = end
    return out


@grouped_mm.register_fake
def _(rows, weight, ends):
    return rows.new_empty(rows.shape[0], weight.shape[2])


def _grouped_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_backward(ctx, grad):
    rows, weight, ends = ctx.saved_tensors
    grad_rows = grouped_mm(grad, weight.transpose(1, 2), ends) if ctx.needs_input_grad[0] else None
    grad_weight = None
    if ctx.needs_input_grad[1]:
        grad_weight = torch.zeros_like(weight)
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                grad_weight[e] = rows[start:end].t() @ grad[start:end]
            start = end
    return grad_rows, grad_weight, None


grouped_mm.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def _grouped_flops(rows_shape, weight_shape, ends_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * rows_shape[0] * weight_shape[1] * weight_shape[2]


register_flop_formula(torch.ops.pardsl.grouped_mm)(_grouped_flops)
