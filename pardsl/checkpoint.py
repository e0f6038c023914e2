"""Sharded checkpoints: safetensors files plus an index of where each piece of each tensor lies.

A checkpoint folder holds one safetensors file per rank with the pieces of parameters, persistent
buffers and optimizer state that the rank owns, and `pardsl.index.json`: per tensor its global shape,
dtype and pieces (file, key, global offsets and sizes), the .par file it was saved under, and the
optimizer's hyperparameters. A replicated tensor is written once (by the ranks at coordinate 0 of the
axes it is broadcast on), so the folder holds each element once, whatever the mesh.

Loading reads, per rank, only the slices of the pieces that overlap what the rank holds under the plan
it loads into (safetensors' `get_slice` reads those bytes alone), so a checkpoint saved under one mesh
and layout loads under any other. A single `model.safetensors` file, or a Hugging Face folder with
`model.safetensors.index.json`, is read the same way: each of its tensors is one whole piece.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from .layouts import Layout, Mesh

INDEX_FILE = "pardsl.index.json"
HF_INDEX_FILE = "model.safetensors.index.json"
HF_SINGLE_FILE = "model.safetensors"
FORMAT = "pardsl-checkpoint/1"


@dataclass(frozen=True)
class Piece:
    file: str  # path relative to the checkpoint folder (or absolute, for a single file)
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Region:
    """A box of the global tensor that a rank holds, and where it sits in the rank's local tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]

    def local_index(self, offsets=None, sizes=None) -> tuple[slice, ...]:
        offsets = self.offsets if offsets is None else offsets
        sizes = self.sizes if sizes is None else sizes
        return tuple(slice(lo + o - go, lo + o - go + s)
                     for lo, o, go, s in zip(self.local_offsets, offsets, self.offsets, sizes))


def local_regions(layout: Layout, shape: tuple[int, ...], mesh: Mesh, coordinate: tuple[int, ...]) -> list[Region]:
    """The boxes of a tensor of global `shape` that the rank at `coordinate` holds under `layout`.

    Per dim, one segment where the dim is whole or split (torch.chunk order over the splitting axes,
    outermost first); `blocks` segments where it is split in blocks (the rank's chunk of every block).
    """
    per_dim = []
    for dim, size in enumerate(shape):
        axes = layout.axes_splitting(dim)
        blocks = layout.blocks_of(dim)
        if not axes:
            per_dim.append([(0, size, 0)])
        elif blocks > 1:
            (axis,) = axes
            block = size // blocks
            chunk = block // mesh.axis_sizes[axis]
            per_dim.append([(j * block + coordinate[axis] * chunk, chunk, j * chunk) for j in range(blocks)])
        else:
            index, ways = 0, 1
            for axis in axes:
                index, ways = index * mesh.axis_sizes[axis] + coordinate[axis], ways * mesh.axis_sizes[axis]
            local = size // ways
            per_dim.append([(index * local, local, 0)])
    return [Region(tuple(s[0] for s in combo), tuple(s[1] for s in combo), tuple(s[2] for s in combo))
            for combo in itertools.product(*per_dim)]


def owns(layout: Layout, coordinate: tuple[int, ...]) -> bool:
    """Whether this rank writes its copy: it is the first of the ranks that hold the same values."""
    return all(p.is_split or coordinate[axis] == 0 for axis, p in enumerate(layout.placements))


def _file_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def _key(name: str, offsets: tuple[int, ...]) -> str:
    return f"{name}@{','.join(map(str, offsets))}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------
# Saving


def _entries(model, optimizer) -> tuple[dict[str, tuple[torch.Tensor, Layout, tuple[int, ...]]], dict]:
    """Every tensor to save: name → (local tensor, layout, global shape); and the optimizer's JSON part."""
    plan = model.plan
    entries = {}
    for name, (attr, layout, shape) in plan.parameter_layouts.items():
        entries[name] = (getattr(model.spmd, attr).detach(), Layout.from_key(layout), tuple(shape))
    persistent = plan.compiled.bound.persistent_buffers
    for name, (attr, layout, shape) in plan.buffer_layouts.items():
        if name in persistent:
            entries[name] = (getattr(model.spmd, attr).detach(), Layout.from_key(layout), tuple(shape))
    optimizer_json = None
    if optimizer is not None:
        name_of = {id(parameter): name for name, parameter, _ in model.named_shards()}
        groups, values = [], {}
        for group in optimizer.param_groups:
            names = [name_of[id(p)] for p in group["params"]]
            hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
            groups.append({"params": names, **{k: v for k, v in hyper.items() if _is_json(v)}})
            for parameter, name in zip(group["params"], names):
                _, layout, shape = entries[name]
                for key, value in optimizer.state.get(parameter, {}).items():
                    if isinstance(value, torch.Tensor) and value.shape == parameter.shape and value.dim() > 0:
                        entries[f"optimizer.{name}.{key}"] = (value.detach(), layout, shape)
                    elif isinstance(value, torch.Tensor):  # a count such as Adam's step: the same everywhere
                        entries[f"optimizer.{name}.{key}"] = (value.detach(), Layout.broadcast(model.rt.mesh),
                                                              tuple(value.shape))
                    elif _is_json(value):
                        values.setdefault(name, {})[key] = value
        optimizer_json = {"class": type(optimizer).__name__, "param_groups": groups, "values": values}
    return entries, optimizer_json


def _is_json(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def save(model, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write this rank's shards of `model` (a ParallelModule) and of `optimizer`'s state to folder `path`.

    Collective: every rank calls it. Returns once every rank's file and the index are written.
    """
    from .api import PipelineModule

    if isinstance(model, PipelineModule):  # its ranks along the pipeline axis hold different parameters
        raise NotImplementedError("saving a pipelined model is not supported yet: the checkpoint index reads "
                                  "every layout as replicated along the pipeline axis")
    rt = model.rt
    mesh = rt.mesh
    world = mesh.size
    rank = dist.get_rank() if dist.is_initialized() else 0
    entries, optimizer_json = _entries(model, optimizer)
    os.makedirs(path, exist_ok=True)

    index = {}
    mine = {}
    for name, (local, layout, shape) in entries.items():
        pieces = []
        for other in range(world):
            coordinate = mesh.coordinates(other)
            if not owns(layout, coordinate):
                continue
            for region in local_regions(layout, shape, mesh, coordinate):
                key = _key(name, region.offsets)
                pieces.append({"file": _file_name(other, world), "key": key, "offsets": list(region.offsets),
                               "sizes": list(region.sizes)})
                if other == rank:
                    mine[key] = local[region.local_index()].contiguous().clone()
        index[name] = {"shape": list(shape), "dtype": _dtype_name(local.dtype), "pieces": pieces}

    if mine:  # a rank whose copies another rank writes has no file
        file = os.path.join(path, _file_name(rank, world))
        save_file(mine, file + ".tmp", metadata={"format": "pt"})
        os.replace(file + ".tmp", file)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        par = model.plan.compiled.par
        document = {
            "format": FORMAT,
            "plan": {"path": par.source.path, "text": par.source.text, "model": par.model.text,
                     "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes))},
            "tied": {name: list(names) for name, names in model.plan.compiled.bound.tied.items()
                     if len(names) > 1 and name in entries},
            "tensors": index,
            "optimizer": optimizer_json,
        }
        with open(os.path.join(path, INDEX_FILE) + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1)
        os.replace(os.path.join(path, INDEX_FILE) + ".tmp", os.path.join(path, INDEX_FILE))
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------------------------
# Reading


class CheckpointSource:
    """Where each tensor's pieces lie: a pardsl checkpoint, a safetensors file, or a Hugging Face folder."""

    def __init__(self, path: str):
        self.path = path
        self.document = None
        self._handles = {}
        if os.path.isdir(path) and os.path.exists(os.path.join(path, INDEX_FILE)):
            with open(os.path.join(path, INDEX_FILE), encoding="utf-8") as handle:
                self.document = json.load(handle)
            self.tensors = {name: (tuple(entry["shape"]), [Piece(p["file"], p["key"], tuple(p["offsets"]),
                                                                 tuple(p["sizes"])) for p in entry["pieces"]])
                            for name, entry in self.document["tensors"].items()}
            return
        if os.path.isdir(path) and os.path.exists(os.path.join(path, HF_INDEX_FILE)):
            with open(os.path.join(path, HF_INDEX_FILE), encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, HF_SINGLE_FILE)):
            files = [HF_SINGLE_FILE]
        elif os.path.isfile(path):
            self.path, files = os.path.dirname(os.path.abspath(path)), [os.path.basename(path)]
        else:
            raise FileNotFoundError(f"{path}: neither a pardsl checkpoint ({INDEX_FILE}), a Hugging Face folder "
                                    f"({HF_INDEX_FILE} or {HF_SINGLE_FILE}) nor a safetensors file")
        self.tensors = {}
        for file in files:
            handle = self._open(file)
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                self.tensors[key] = (shape, [Piece(file, key, (0,) * len(shape), shape)])

    def _open(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.path, file), framework="pt")
        return self._handles[file]

    def find(self, names) -> str | None:
        """The checkpoint's name for a tensor known by `names` (tied names included): exact first, then
        with leading module names dropped (a wrapper's `model.` prefix over a Hugging Face checkpoint)."""
        for name in names:
            if name in self.tensors:
                return name
        for name in names:
            parts = name.split(".")
            for start in range(1, len(parts)):
                if ".".join(parts[start:]) in self.tensors:
                    return ".".join(parts[start:])
        return None

    def read_into(self, name: str, target: torch.Tensor, layout: Layout, mesh: Mesh, coordinate) -> None:
        """Fill `target`, this rank's local tensor of `name` under `layout`, from the overlapping slices."""
        shape, pieces = self.tensors[name]
        if tuple(shape) != tuple(self._global_shape(target, layout, mesh)):
            raise ValueError(f"checkpoint tensor `{name}` has shape {list(shape)}; the model's is "
                             f"{list(self._global_shape(target, layout, mesh))}")
        for region in local_regions(layout, shape, mesh, coordinate):
            for piece in pieces:
                low = [max(r, p) for r, p in zip(region.offsets, piece.offsets)]
                high = [min(r + rs, p + ps) for r, rs, p, ps in zip(region.offsets, region.sizes, piece.offsets,
                                                                    piece.sizes)]
                if any(h <= lo for lo, h in zip(low, high)):
                    continue
                handle = self._open(piece.file)
                if not shape:
                    values = handle.get_tensor(piece.key)
                else:
                    values = handle.get_slice(piece.key)[tuple(slice(lo - p, h - p) for lo, h, p in
                                                               zip(low, high, piece.offsets))]
                sizes = tuple(h - lo for lo, h in zip(low, high))
                target[region.local_index(tuple(low), sizes)].copy_(values)

    @staticmethod
    def _global_shape(local: torch.Tensor, layout: Layout, mesh: Mesh) -> tuple[int, ...]:
        return tuple(size * layout.split_factor(dim, mesh) for dim, size in enumerate(local.shape))

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor, assembled from its pieces."""
        shape, pieces = self.tensors[name]
        parts = [(piece, self._open(piece.file).get_tensor(piece.key)) for piece in pieces]
        out = torch.empty(shape, dtype=parts[0][1].dtype)
        for piece, values in parts:
            out[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))].copy_(values)
        return out


@torch.no_grad()
def load_model_state(spmd, plan, checkpoint: str) -> None:
    """Fill the generated module's parameters (and the persistent buffers the checkpoint has) with this
    rank's slices of the checkpoint's tensors."""
    source = CheckpointSource(checkpoint)
    rt = spmd.rt
    coordinate = tuple(rt.coordinate[name] for name in rt.mesh.axis_names)
    tied = plan.compiled.bound.tied
    missing = []
    for name, (attr, layout, _) in plan.parameter_layouts.items():
        found = source.find(tied.get(name, (name,)))
        if found is None:
            missing.append(name)
            continue
        source.read_into(found, getattr(spmd, attr), Layout.from_key(layout), rt.mesh, coordinate)
    for name, (attr, layout, _) in plan.buffer_layouts.items():
        found = source.find((name,))
        if found is not None:  # the others keep the values the model's factory gives them
            source.read_into(found, getattr(spmd, attr), Layout.from_key(layout), rt.mesh, coordinate)
    if missing:
        raise KeyError(f"{checkpoint} has no tensor for parameter(s) {', '.join(missing[:5])}"
                       + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


@torch.no_grad()
def load_optimizer_state(optimizer: torch.optim.Optimizer, model, checkpoint: str) -> None:
    """Give `optimizer` (over `model.parameters()`, any plan) the state saved with `pardsl.save(...,
    optimizer=)`, resharded to this model's layouts, and the saved hyperparameters."""
    source = CheckpointSource(checkpoint)
    saved = source.document and source.document.get("optimizer")
    if not saved:
        raise ValueError(f"{checkpoint} holds no optimizer state (save it with pardsl.save(..., optimizer=opt))")
    rt = model.rt
    coordinate = tuple(rt.coordinate[name] for name in rt.mesh.axis_names)
    shards = {id(parameter): (name, parameter, Layout.from_key(layout)) for name, parameter, layout in model.named_shards()}
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter group(s); "
                         f"this one has {len(optimizer.param_groups)}")
    state, groups, position = {}, [], 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        indices = []
        for parameter in group["params"]:
            name, _, layout = shards[id(parameter)]
            entry = {}
            prefix = f"optimizer.{name}."
            for key in (k for k in source.tensors if k.startswith(prefix)):
                shape, _ = source.tensors[key]
                global_shape = CheckpointSource._global_shape(parameter, layout, rt.mesh)
                if tuple(shape) == tuple(global_shape) and shape:
                    value = torch.empty_like(parameter)
                    source.read_into(key, value, layout, rt.mesh, coordinate)
                else:
                    value = source.full(key).to(rt.device)
                entry[key[len(prefix):]] = value
            entry.update(saved["values"].get(name, {}))
            if entry:
                state[position] = entry
            indices.append(position)
            position += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def export_checkpoint(checkpoint: str, output: str) -> list[str]:
    """Write a pardsl checkpoint's model tensors, whole, to one safetensors file (Hugging Face's format);
    returns the names written. Optimizer state is left out."""
    source = CheckpointSource(checkpoint)
    if source.document is None:
        raise ValueError(f"{checkpoint} is not a pardsl checkpoint (no {INDEX_FILE})")
    tensors = {name: source.full(name) for name in source.tensors if not name.startswith("optimizer.")}
    save_file(tensors, output, metadata={"format": "pt"})
    return sorted(tensors)


__all__ = ["save", "load_model_state", "load_optimizer_state", "export_checkpoint", "local_regions"]
