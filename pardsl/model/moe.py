"""Mixture-of-experts layers in a static capacity form, which expert parallelism can split.

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

import math

import torch

IMPLEMENTATION = "pardsl_capacity"


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
