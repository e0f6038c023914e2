"""A model's state dict as torch DTensors, for tools that take them (torch.distributed.checkpoint, and
others built on DTensor state dicts): DTensor at the edge of a pardsl model, which holds plain tensors.

Each DTensor wraps the rank's own shard (no copy, no collective) on a DeviceMesh of the plan's mesh, with
placements read from the tensor's layout: S(d) → Shard(d), B → Replicate(), P → Partial(). pardsl's
splits are even and chunk a dim split by several axes outermost axis first, which is DTensor's own
left-to-right order, so Shard describes the same pieces `local_regions` gives. A dim split in blocks
(`S(d, blocks=k)`, fused q/k/v) holds the rank's chunk of every block: DTensor's _StridedShard(d,
split_factor=k) is that arrangement: its full_tensor() is right, but torch.distributed.checkpoint
(torch 2.13) takes its local chunk for a contiguous one: it refuses the save (overlapping chunks) and
loads such a tensor into the wrong rows, without an error; a warning says so. pardsl's own DCP path
(pardsl/runtime/dcp.py) writes and reads the same pieces as chunks of their own, one per block, which
DCP places right. A zig-zag split, and a split in blocks of unequal sizes, have no DTensor placement
and are refused.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from pardsl.layouts.algebra import Layout
from pardsl.runtime.collectives import device_mesh


def dtensor_state_dict(model) -> dict[str, DTensor]:
    """`model`'s parameters and persistent buffers by the serial model's state-dict names, each a DTensor
    over this rank's local tensor: `full_tensor()` gives the serial model's value, and a tool that writes
    into the DTensors (`torch.distributed.checkpoint.load`) writes into the model. Every rank calls it (the
    first call builds the DeviceMesh, which is collective). Raises NotImplementedError for a pipelined
    model (a stage's tensors are not on every rank of the mesh) and ValueError for a tensor split in a
    zig-zag or in blocks of unequal sizes, which DTensor cannot describe."""
    if getattr(model, "pipeline", None) is not None:
        raise NotImplementedError("dtensor_state_dict: a pipelined model's stages hold different tensors, "
                                  "which a DTensor over the whole mesh cannot describe; use pardsl.save")
    plan, rt = model.plan, model.rt
    mesh = device_mesh(rt.mesh, rt.device.type)
    persistent = plan.compiled.bound.persistent_buffers
    state: dict[str, DTensor] = {}
    blocked = []
    for _, module, parameters, buffers in model.parts():
        tables = [*parameters.items(), *((name, entry) for name, entry in buffers.items() if name in persistent)]
        for name, (attr, key, shape) in tables:
            layout = Layout.from_key(key)
            shape = torch.Size(shape)
            placements = dtensor_placements(name, layout)
            if any(isinstance(p, _StridedShard) for p in placements):
                blocked.append(name)
            state[name] = DTensor.from_local(getattr(module, attr).detach(), mesh, placements,
                                             run_check=False, shape=shape, stride=_contiguous_stride(shape))
    if blocked:
        warnings.warn(f"dtensor_state_dict: {', '.join(blocked[:3])}{' and more' if len(blocked) > 3 else ''} "
                      "split in blocks (_StridedShard): torch.distributed.checkpoint refuses to save such "
                      "tensors and loads them into the wrong rows; save and load this model with "
                      "pardsl.save(..., format=\"dcp\") and plan.module(checkpoint=...)", stacklevel=2)
    return state


def dtensor_placements(name: str, layout: Layout) -> list:
    """DTensor's placements, one per mesh axis, for a tensor under `layout`."""
    placements = []
    for placement in layout.placements:
        if placement.kind == "B":
            placements.append(Replicate())
        elif placement.kind == "P":
            placements.append(Partial())
        elif placement.mirrored:
            raise ValueError(f"{name} is split in a zig-zag ({layout.key()}): DTensor has no placement for it; "
                             "gather it with pardsl.save/export_checkpoint instead")
        elif placement.sizes:
            raise ValueError(f"{name} is split in blocks of unequal sizes ({layout.key()}): DTensor has no "
                             "placement for it; gather it with pardsl.save/export_checkpoint instead")
        elif placement.blocks > 1:
            placements.append(_StridedShard(placement.dim, split_factor=placement.blocks))
        else:
            placements.append(Shard(placement.dim))
    return placements


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))
