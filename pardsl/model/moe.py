"""Mixture-of-experts layers as pardsl traces them: transformers' experts as one op, or, where the user
chooses it, in a static capacity form.

**As one op** (the default, nothing to change in the model): while the model is traced, each experts
module that uses transformers' experts interface computes through `pardsl::experts`
(pardsl/runtime/experts.py), which holds the routing inside and has static shapes, so the plan may split
its tokens, its experts (expert parallelism: a variable all-to-all each way) and their intermediate dim
(tensor parallelism). Which gate the module applies between its projections is read by running the
module's own gate on a probe and comparing it with the forms the op knows (`GATES`). A module whose gate
is none of them, or that normalises each expert's result (`has_post_expert_norm`), is traced another way,
with static shapes too: the (token, choice) pairs sorted by expert go through each projection as one
grouped matmul (`pardsl::grouped_mm`), and the module's own gate and norm are traced as written between
and after them; the plan may split their intermediate dim, not their tokens or experts. A down
projection's bias is added outside the op, Σ_k weight_k · bias[expert_k], by ordinary ops.

**Static capacity** (a choice, for a fixed communication volume):

Hugging Face's experts route each token to its top-k experts with shapes that depend on the routing
(`nonzero`, `index_add_`: E061 in pardsl), or gather every token's expert weights (`batched_mm`: the
weights follow the tokens, so the experts cannot live on different ranks). GShard's form has static
shapes and keeps the experts where they are: tokens are cut into G groups of S; in each group every
expert has C slots; each (token, choice) pair takes the next free slot of its expert, in token order.
Dispatch and combine are gathers (not GShard's dense one-hot matmuls, which cost E·C times more):

    dispatched = x gathered by slot      [G, E·C, H]   (an empty slot is zero)
    expert_in  = dispatched as [E, G·C, H]             (expert-major)
    expert_out = FFN_e(expert_in)        [E, G·C, H]   one batched matmul per projection
    y          = Σ_k weight_k · expert_out as [G, E·C, H], gathered by each pair's slot

With the groups split over an axis (the batch split) and the stacked expert weights `S(0)` on the same
axis, the change from group-major to expert-major is one all-to-all each way: GShard's and DeepSpeed-MoE's
expert parallelism, which pardsl plans from the layouts alone. With C = S (the default) no token is ever
dropped and the layer equals the library's own; a `capacity_factor` makes C = ⌈factor·S·k/E⌉ and drops
(token, choice) pairs past an expert's capacity, as GShard and Switch do.

`use_static_capacity(config, groups)` switches a transformers MoE config (Mixtral, Qwen-MoE, …: any
whose experts use transformers' experts interface) to this form.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from pardsl.runtime.experts import ACTIVATIONS, GATES

IMPLEMENTATION = "pardsl_capacity"
ONE_OP = "pardsl_experts"
GROUPED = "pardsl_grouped_mm"


def one_op_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface, computed by `pardsl::experts` (the module's doc)."""
    gate, act, alpha, limit = self.pardsl_gate
    first = self.gate_up_proj if self.has_gate else self.up_proj
    first_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    out = torch.ops.pardsl.experts(hidden_states, top_k_index, top_k_weights, first, first_bias, self.down_proj,
                                   gate, self.is_transposed, act, alpha, limit)
    if self.has_bias:
        chosen = F.embedding(top_k_index, self.down_proj_bias)  # [T, k, H]: each choice's expert's bias
        out = out + (top_k_weights.unsqueeze(-1).to(chosen.dtype) * chosen).sum(1).to(out.dtype)
    return out


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface with the module's own gate, and its norm after the experts where it
    has one, traced as written: the (token, choice) pairs sorted by expert, each projection one
    `pardsl::grouped_mm`."""
    tokens, choices = top_k_index.shape
    first = self.gate_up_proj if self.has_gate else self.up_proj
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)
    ids = experts[order]
    # where each expert's rows end, counted with static shapes (bincount's size follows the data)
    counts = (experts.unsqueeze(1) == torch.arange(first.shape[0], device=experts.device)).sum(0)
    ends = torch.cumsum(counts, 0)

    def projected(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.pardsl.grouped_mm(rows, weight if self.is_transposed else weight.transpose(1, 2), ends)
        return out if bias is None else out + bias[ids]

    biases = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias, self.down_proj_bias) \
        if self.has_bias else (None, None)
    h = projected(hidden_states[order // choices], first, biases[0])
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = projected(h, self.down_proj, biases[1])
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return out[torch.argsort(order)].reshape(tokens, choices, -1).sum(1).to(hidden_states.dtype)


def _gate_of(module) -> tuple[str, str, float, float | None] | None:
    """The op's gate (name, activation, alpha, limit) that computes what the module's own gate does, tried
    on a probe; None where no form matches or the module does more than the op does."""
    if getattr(module, "has_post_expert_norm", False) or getattr(module, "_is_expert_parallel", False):
        return None
    probe = torch.linspace(-6.0, 6.0, 48, dtype=torch.float32).reshape(2, 24)
    alpha, limit = float(getattr(module, "alpha", 1.0)), getattr(module, "limit", None)
    limit = float(limit) if limit is not None else None
    try:
        if not module.has_gate:
            wanted = module.act_fn(probe)
            forms = [("activation", act) for act in ACTIVATIONS]
        else:
            wanted = module._apply_gate(probe)
            forms = [(gate, act) for gate in GATES if gate != "activation" for act in ACTIVATIONS]
    except Exception:  # a gate that cannot run on a probe: traced as the library writes it
        return None
    for gate, act in forms:
        if gate == "clamped_swiglu" and limit is None:
            continue
        got = GATES[gate][0](probe, ACTIVATIONS[act], alpha, limit)
        if got.shape == wanted.shape and torch.allclose(got, wanted.to(got.dtype), atol=1e-6, rtol=1e-5):
            return gate, act, alpha, limit
    return None


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that compute through transformers' experts interface."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")
            and hasattr(getattr(m, "config", None), "_experts_implementation")]


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module):
    """While tracing: every experts module whose gate the op knows computes through it (the module's doc),
    unless its config already chose static capacity; where one module that shares a config has a gate the
    op does not know, every module of that config computes as grouped matmuls with its own gate."""
    modules = _experts_modules(model)
    if not modules:
        yield
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(ONE_OP, one_op_experts_forward)
    ALL_EXPERTS_FUNCTIONS.register(GROUPED, grouped_experts_forward)
    gates = {id(m): _gate_of(m) for m in modules}
    configs = {}
    for module in modules:
        configs.setdefault(id(module.config), (module.config, []))[1].append(module)
    switched = []
    for config, members in configs.values():
        # transformers' own expert parallelism has already cut the experts: traced as it computes them
        if config._experts_implementation == IMPLEMENTATION or \
                any(getattr(m, "_is_expert_parallel", False) for m in members):
            continue
        known = all(gates[id(m)] is not None for m in members)
        for module in members:
            module.pardsl_gate = gates[id(module)]
        switched.append((config, config._experts_implementation))
        config._experts_implementation = ONE_OP if known else GROUPED
    try:
        yield
    finally:
        for config, previous in switched:
            config._experts_implementation = previous


def capacity_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: hidden_states [T, H], top_k_index and top_k_weights [T, k] →
    [T, H]. The module holds gate_up_proj [E, 2I, H] (gate then up) and down_proj [E, H, I]."""
    groups = self.config.pardsl_moe_groups
    factor = getattr(self.config, "pardsl_moe_capacity_factor", None)
    tokens, hidden = hidden_states.shape
    experts, choices = self.gate_up_proj.shape[0], top_k_index.shape[-1]
    if tokens % groups:
        raise ValueError(f"{tokens} tokens cannot be cut into {groups} groups (pardsl_moe_groups)")
    per_group = tokens // groups
    capacity = per_group if factor is None else min(per_group, math.ceil(factor * per_group * choices / experts))
    slots, pairs = experts * capacity, per_group * choices

    with torch.no_grad():  # each (token, choice) pair's slot: its expert's next free one, in token order
        expert_of_pair = top_k_index.reshape(groups, pairs)
        queue = torch.cumsum(torch.nn.functional.one_hot(expert_of_pair, experts), dim=1) - 1
        place = queue.gather(2, expert_of_pair.unsqueeze(-1)).squeeze(-1)  # [G, S·k]
        kept = place < capacity
        # a pair past its expert's capacity goes to one spare slot, dropped below
        slot_of_pair = torch.where(kept, expert_of_pair * capacity + place.clamp(max=capacity - 1), slots)
        token_of_pair = torch.arange(per_group, device=hidden_states.device).unsqueeze(1).expand(per_group, choices)
        token_of_slot = torch.zeros(groups, slots + 1, dtype=torch.int64, device=hidden_states.device).scatter(
            1, slot_of_pair, token_of_pair.reshape(1, pairs).expand(groups, pairs))[:, :slots]
        filled = torch.zeros(groups, slots + 1, dtype=hidden_states.dtype, device=hidden_states.device).scatter(
            1, slot_of_pair, 1.0)[:, :slots]

    x = hidden_states.reshape(groups, per_group, hidden)
    dispatched = x.gather(1, token_of_slot.unsqueeze(-1).expand(groups, slots, hidden)) * filled.unsqueeze(-1)
    expert_in = dispatched.reshape(groups, experts, capacity, hidden).permute(1, 0, 2, 3)
    expert_in = expert_in.reshape(experts, groups * capacity, hidden)  # expert-major
    gate, up = torch.bmm(expert_in, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    expert_out = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))  # [E, G·C, H]
    expert_out = expert_out.reshape(experts, groups, capacity, hidden).permute(1, 0, 2, 3)
    expert_out = expert_out.reshape(groups, slots, hidden)  # group-major again
    picked = expert_out.gather(1, slot_of_pair.clamp(max=slots - 1).unsqueeze(-1).expand(groups, pairs, hidden))
    weights = (top_k_weights.reshape(groups, pairs) * kept).to(hidden_states.dtype).unsqueeze(-1)
    y = (picked * weights).reshape(groups, per_group, choices, hidden).sum(2)
    return y.reshape(tokens, hidden)


def use_static_capacity(config, groups: int, capacity_factor: float | None = None):
    """Make a transformers MoE config's experts compute in the static capacity form: tokens in `groups`
    groups (a multiple of the ranks that split the batch), no token dropped unless `capacity_factor` is
    given. Returns the config."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, capacity_experts_forward)
    config._experts_implementation = IMPLEMENTATION
    config.pardsl_moe_groups = groups
    config.pardsl_moe_capacity_factor = capacity_factor
    return config
