"""The runtime's collectives as functional ones, which torch.compile traces into its graphs.

Inside a compiled piece (regional compilation with collectives in the graphs) a collective is a node of the
graph, `_c10d_functional.all_reduce` and its `wait_tensor`, which the compiler schedules with the computation
around it (on NCCL it can start the collective early and wait late), not a call out of the graph that splits
it in two. The conversions and their adjoints (`runtime/conversions.py`) are the same either way: the
runtime's primitives (`Runtime._all_reduce`, ...) come here while a graph is traced.

A compiled graph cannot count what it issues, so these log their collectives only when run eagerly on fake
tensors: `runtime/pieces.py` runs a piece once that way per input shape, then counts the logged collectives
for each call of the compiled graph.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from pardsl.layouts.algebra import block_major, rank_major

_c10d = torch.ops._c10d_functional


def all_reduce(x: torch.Tensor, rt, axis: str, phase: str) -> torch.Tensor:
    if rt.size[axis] == 1:
        return x
    rt.log_traced(phase, "all_reduce", x, axis)
    return funcol.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", rt.group_names[axis]))


def all_gather(x: torch.Tensor, rt, axis: str, dim: int, phase: str, blocks: int, mirrored: bool) -> torch.Tensor:
    n = rt.size[axis]
    if n == 1:
        return x
    rt.log_traced(phase, "all_gather", x, axis)
    moved = x.movedim(dim, 0).contiguous()
    gathered = funcol.wait_tensor(_c10d.all_gather_into_tensor(moved, n, rt.group_names[axis]))
    # contiguous as the serial value was: the exported graph may `view` it
    return block_major(gathered, n, blocks, mirrored).movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, rt, axis: str, dim: int, phase: str, blocks: int, mirrored: bool) -> torch.Tensor:
    n = rt.size[axis]
    if n == 1:
        return x
    rt.log_traced(phase, "reduce_scatter", x, axis)
    moved = rank_major(x.movedim(dim, 0), n, blocks, mirrored).contiguous()
    scattered = funcol.wait_tensor(_c10d.reduce_scatter_tensor(moved, "sum", n, rt.group_names[axis]))
    return scattered.movedim(0, dim).contiguous()


def all_to_all(x: torch.Tensor, rt, axis: str, split_dim: int, concat_dim: int, phase: str) -> torch.Tensor:
    n = rt.size[axis]
    if n == 1:
        return x
    rt.log_traced(phase, "all_to_all", x, axis)
    send = torch.stack(x.chunk(n, dim=split_dim)).contiguous()
    received = funcol.wait_tensor(_c10d.all_to_all_single(send, [1] * n, [1] * n, rt.group_names[axis]))
    return torch.cat(received.unbind(0), dim=concat_dim)
