"""torch.distributed.checkpoint (DCP) folders, written and read under any plan.

A DCP folder holds `.metadata` (a pickle: every tensor's global shape and the chunks it was saved in, and
where each chunk lies in which file) and the ranks' data files (`__<rank>_<n>.distcp`, each chunk a
`torch.save`). pardsl writes its checkpoints in the layout torchtitan and FSDP2 runs use, so that each
reads the other's:

- the model's tensors at the top level under the plain model's `state_dict()` names;
- the optimizer's under `optimizer`, as `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`
  gives it with `flatten_optimizer_state_dict=True`: `optimizer.state.<name>.<key>` (AdamW's `exp_avg`,
  `exp_avg_sq` as tensors of the parameter's shape, `step` a 0-d tensor) and
  `optimizer.param_groups.<name>.<hyperparameter>`.

Each rank writes and reads its chunks as pardsl's own format does, from the tensor's layout
(`local_regions`): a dim split in blocks (fused q/k/v) is one chunk per block, which DCP places
correctly, where a DTensor's `_StridedShard` is refused by DCP's planner (torch 2.13); a pipeline's stages
write their own tensors. The chunks are the pieces `pardsl.dtensor_state_dict` describes, so that
`dcp.load(pardsl.dtensor_state_dict(model), ...)` reads a folder pardsl wrote, and pardsl reads one that
`dcp.save(pardsl.dtensor_state_dict(model), ...)` (or FSDP2, or torchtitan) wrote, resharded to its plan.

Safety, as for the own format: nothing in a folder another user can write is read (the trust check comes
first, before `.metadata` is unpickled); `.metadata` is unpickled by an unpickler that makes only the
classes DCP's metadata holds; before any data is read, every chunk must lie inside its tensor, the chunks
must cover each tensor exactly once, and every file named must be a plain name in the folder, there, and
exactly as long as the chunks it holds; each chunk is read with `torch.load(weights_only=True)`. pardsl
adds `pardsl.dcp.json` beside `.metadata`: the sha256 of every data file (checked before the first read
from it) and of `.metadata` (checked before it is unpickled), the plan, the optimizer's class and the
user's metadata. A save goes to a new folder beside `path`, renamed into place once complete; where rank
0 fails to finish it, every rank raises.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import secrets
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import _create_write_items, create_read_items_for_chunk_list

from pardsl.layouts.algebra import Layout
from pardsl.runtime.checkpoint_files import (DCP_SIDECAR_FILE, CheckpointError, Region, _check_trusted, _coverage_error,
                                       _entries, _find_name, _fsync, _is_count, _new_temporary, _next_save_counter,
                                       _outside, _refuse, _sha256, local_regions)
from pardsl.runtime.collectives import all_gather_json

METADATA_FILE = ".metadata"
SIDECAR_FILE = DCP_SIDECAR_FILE
SIDECAR_FORMAT = "pardsl-dcp/1"
_MODEL_PREFIXES = ("", "model.")  # the model's names at the top level (torchtitan) or under `model`
_OPTIMIZER_PREFIXES = ("optimizer.", "optim.")


# ---------------------------------------------------------------------------------------------------
# Reading .metadata without running what a pickle may ask for

# What DCP's metadata pickles hold: its dataclasses, torch's sizes, dtypes, layouts and memory formats,
# and the path it was saved to. Anything else (a pickle that would call os.system) is refused unmade.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which DCP's metadata never holds")


def _read_metadata(folder: str) -> Metadata:
    where = os.path.join(folder, METADATA_FILE)
    try:
        with open(where, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except Exception as error:  # noqa: BLE001 - a damaged pickle fails in many ways, each to be refused alike
        _refuse(folder, f"its {METADATA_FILE} cannot be read ({type(error).__name__}: {error})")
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        _refuse(folder, f"its {METADATA_FILE} is not DCP's metadata")
    return metadata


def _is_shape(value, rank: int) -> bool:
    """A chunk's offsets or sizes as DCP writes them: a torch.Size (or tuple) of `rank` counts."""
    return isinstance(value, (torch.Size, tuple)) and len(value) == rank and all(map(_is_count, value))


def _checked_metadata(folder: str) -> tuple[Metadata, dict[str, int]]:
    """`folder`'s metadata once every check holds, and the size of each data file; else CheckpointError
    saying what is wrong. Reads `.metadata` and the files' sizes, no tensor data."""
    metadata = _read_metadata(folder)
    ends: dict[str, int] = {}  # per file, where its last item ends: the file's exact size
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) \
                or not _is_count(info.offset) or not _is_count(info.length):
            _refuse(folder, f"its {METADATA_FILE} has a malformed storage entry")
        if _outside(folder, info.relative_path):
            _refuse(folder, f"its {METADATA_FILE} names a file outside the folder: {info.relative_path!r}")
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for file, end in ends.items():
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            _refuse(folder, f"file {file} is missing (a save that did not finish, or a file removed)")
        if os.path.getsize(path) != end:
            _refuse(folder, f"file {file} has {os.path.getsize(path)} bytes; its chunks end at byte {end} (a file "
                    "cut short or written over)")
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(name) not in metadata.storage_data:
                _refuse(folder, f"entry `{name}` has no stored bytes")
            continue
        if not isinstance(entry, TensorStorageMetadata) or not isinstance(entry.size, torch.Size) \
                or not isinstance(entry.properties, TensorProperties) \
                or not isinstance(entry.properties.dtype, torch.dtype) or not isinstance(entry.chunks, list):
            _refuse(folder, f"tensor `{name}`: its entry is malformed")
        shape = tuple(entry.size)
        if not all(map(_is_count, shape)):
            _refuse(folder, f"tensor `{name}`: its shape {list(shape)} has a negative size")
        for chunk in entry.chunks:
            if not isinstance(chunk, ChunkStorageMetadata):
                _refuse(folder, f"tensor `{name}`: a chunk is a {type(chunk).__name__}, not DCP's chunk entry")
            # typed before they are used: an int or None here would fail inside len() or zip()
            for field in ("offsets", "sizes"):
                value = getattr(chunk, field)
                if not _is_shape(value, len(shape)):
                    _refuse(folder, f"tensor `{name}`: a chunk's {field} are {value!r}, not {len(shape)} "
                            "non-negative ints (the tensor's rank)")
            if any(o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, shape)):
                _refuse(folder, f"tensor `{name}`: a chunk is malformed or lies outside the tensor's shape "
                        f"{list(shape)}")
            info = metadata.storage_data.get(MetadataIndex(name, chunk.offsets))
            if info is None:
                _refuse(folder, f"tensor `{name}`: the chunk at {list(chunk.offsets)} is stored nowhere")
            least = entry.properties.dtype.itemsize * int(torch.Size(chunk.sizes).numel())
            if info.length < least:
                _refuse(folder, f"tensor `{name}`: the chunk at {list(chunk.offsets)} is stored in {info.length} "
                        f"bytes, fewer than its {least} bytes of data")
        coverage = _coverage_error(shape, entry.chunks)
        if coverage:
            _refuse(folder, f"tensor `{name}`: {coverage}")
    return metadata, ends


class _SafeReader(FileSystemReader):
    """DCP's file reader, given metadata read by `_read_metadata` rather than by pickle.load."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata


class _RegionLoadPlanner(LoadPlanner):
    """Reads the chunks overlapping given regions straight into the tensors that hold them (views of
    this rank's parameters and optimizer state), and small values with torch.load(weights_only=True)."""

    def __init__(self, metadata: Metadata, targets: dict[str, list[tuple[Region, torch.Tensor]]],
                 values: list[str]):
        self.metadata, self.targets, self.value_keys = metadata, targets, values
        self.values: dict[str, object] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, pieces in self.targets.items():
            chunks = [ChunkStorageMetadata(torch.Size(region.offsets), torch.Size(region.sizes))
                      for region, _ in pieces]
            items.extend(create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks))
        for key in self.value_keys:
            index = MetadataIndex(key)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                  storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DCP's own planner unpickles these with weights_only=False: a file could run code
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        region, target = self.targets[read_item.dest_index.fqn][read_item.dest_index.index]
        return narrow_tensor_by_index(target[region.local_index()], read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read into the view that resolve_tensor gave


class DcpSource:
    """A DCP folder, checked, ready to read this rank's regions of its tensors from."""

    def __init__(self, path: str, verify: bool = True, allow_shared_folder: bool = False):
        self.path = path
        # before anything in it is opened: .metadata is a pickle
        _check_trusted(path, allow_shared_folder, path)
        _check_trusted(os.path.join(path, METADATA_FILE), allow_shared_folder, path)
        if os.path.exists(os.path.join(path, SIDECAR_FILE)):
            _check_trusted(os.path.join(path, SIDECAR_FILE), allow_shared_folder, path)
        self.sidecar = _read_sidecar(path)
        if verify and self.sidecar is not None and "metadata_sha256" in self.sidecar:
            # before it is unpickled; a save before metadata hashes has none to check
            with open(os.path.join(path, METADATA_FILE), "rb") as handle:
                digest = _sha256(handle)
            if digest != self.sidecar["metadata_sha256"]:
                _refuse(path, f"its {METADATA_FILE} does not hold the bytes saved: its sha256 is {digest}; "
                        f"{SIDECAR_FILE} says {self.sidecar['metadata_sha256']} (written over or damaged since "
                        "the save)", "To load it unverified, pass verify=False")
        self.metadata, self.files = _checked_metadata(path)
        for file in self.files:
            _check_trusted(os.path.join(path, file), allow_shared_folder, path)
        self.hashes = {}
        if self.sidecar is not None:
            # a rank with nothing to write leaves an empty file that .metadata does not name
            if any(self.sidecar["files"].get(file) != size for file, size in self.files.items()):
                _refuse(path, f"its data files are not those {SIDECAR_FILE} lists (files of two saves mixed, or "
                        "a file added or written over)")
            if verify:
                self.hashes = self.sidecar["sha256"]
        entries = self.metadata.state_dict_metadata
        self.tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
        self.keys = set(entries)

    def model_prefix(self, names) -> str:
        """Where the model's tensors are: at the top level or under `model.`."""
        for prefix in _MODEL_PREFIXES:
            if any(prefix + name in self.tensors for name in names):
                return prefix
        return ""

    def optimizer_prefix(self) -> str | None:
        for prefix in _OPTIMIZER_PREFIXES:
            if any(key.startswith(prefix + "state.") or key.startswith(prefix + "param_groups") for key in self.keys):
                return prefix
        return None

    def read(self, targets: dict[str, list[tuple[Region, torch.Tensor]]], values: list[str] = ()) -> dict:
        """Fill each target's regions from the checkpoint, and read `values` (small non-tensor entries).
        A tensor stored in another dtype is converted, as the own format's loader does (float32 masters
        from a bf16 run)."""
        planner = _RegionLoadPlanner(self.metadata, targets, list(values))
        plan = planner.create_local_plan()
        needed = sorted({self.metadata.storage_data[item.storage_index].relative_path for item in plan.items})
        for file in needed:  # each rank hashes the files it reads from
            expected = self.hashes.get(file)
            if expected is not None:
                with open(os.path.join(self.path, file), "rb") as handle:
                    digest = _sha256(handle)
                if digest != expected:
                    _refuse(self.path, f"file {file} does not hold the bytes saved: its sha256 is {digest}; "
                            f"{SIDECAR_FILE} says {expected} (written over or damaged since the save)",
                            "To load it unverified, pass verify=False")
        reader = _SafeReader(self.path, self.metadata)
        reader.set_up_storage_reader(self.metadata, is_coordinator=False)
        try:
            reader.read_data(plan, planner).wait()
        except Exception as error:  # noqa: BLE001 - torch.load's errors for damaged bytes vary
            _refuse(self.path, f"a chunk cannot be read ({type(error).__name__}: {str(error)[:300]})")
        return planner.values


def _read_sidecar(folder: str) -> dict | None:
    where = os.path.join(folder, SIDECAR_FILE)
    if not os.path.exists(where):
        return None  # a folder torch wrote: DCP keeps no hashes
    try:
        with open(where, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        _refuse(folder, f"its {SIDECAR_FILE} cannot be read ({error})")
    problem = _sidecar_problem(document)
    if problem:
        _refuse(folder, f"its {SIDECAR_FILE} is malformed: {problem}",
                f"Remove {SIDECAR_FILE} to load the folder as one torch wrote (no hashes, no record of the model)")
    return document


def _is_text_map(value, of) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and of(v) for k, v in value.items())


def _sidecar_problem(document) -> str | None:
    """What is wrong with a sidecar's fields, each of which a loader uses as the type save writes; None where
    nothing is. `save_counter` and `saved_at` may be absent (saves before counters), not of another type."""
    if not isinstance(document, dict):
        return f"it holds a {type(document).__name__}, not an object"
    if document.get("format") != SIDECAR_FORMAT:
        return f"its format is {document.get('format')!r}, not {SIDECAR_FORMAT!r}"
    if not _is_text_map(document.get("files"), _is_count):
        return "`files` is not an object of file names and sizes"
    if not _is_text_map(document.get("sha256"), lambda v: isinstance(v, str)) \
            or set(document["sha256"]) != set(document["files"]):
        return "`sha256` does not give one hash (a string) for each file of `files`"
    plan = document.get("plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("model"), str) \
            or not isinstance(plan.get("text"), str) or not isinstance(plan.get("path"), (str, type(None))) \
            or not _is_text_map(plan.get("mesh"), _is_count):
        return "`plan` is not an object with the model (a string), the plan's text and path, and the mesh"
    for field, kinds in (("save_id", (str,)), ("optimizer_class", (str, type(None))),
                         ("metadata_sha256", (str,))):
        if field in document and not isinstance(document[field], kinds):
            return f"`{field}` is {repr(document[field])[:60]}, not a string"
    if "save_counter" in document and not _is_count(document["save_counter"]):
        return f"`save_counter` is {document['save_counter']!r}, not a count"
    saved_at = document.get("saved_at")
    if saved_at is not None and (not isinstance(saved_at, (int, float)) or isinstance(saved_at, bool)):
        return f"`saved_at` is {repr(saved_at)[:60]}, not a time (seconds since the epoch)"
    return None


# ---------------------------------------------------------------------------------------------------
# Loading into a plan


def _regions(layout: Layout, shape, rt) -> list[Region]:
    coordinate = tuple(rt.coordinate[name] for name in rt.mesh.axis_names)
    return local_regions(layout, tuple(shape), rt.mesh, coordinate)


def _target(source: DcpSource, key: str, local: torch.Tensor, layout: Layout, rt) -> list[tuple[Region, torch.Tensor]]:
    shape = tuple(size * layout.split_factor(dim, rt.mesh) for dim, size in enumerate(local.shape))
    saved = tuple(source.tensors[key].size)
    if saved != shape:
        _refuse(source.path, f"tensor `{key}` has shape {list(saved)}; the model's is {list(shape)}")
    return [(region, local) for region in _regions(layout, shape, rt)]


@torch.no_grad()
def load_model_state(parts, plan, checkpoint: str, strict: bool = True, verify: bool = True,
                     allow_shared_folder: bool = False) -> None:
    """As checkpoint.load_model_state, from a DCP folder: each rank reads the chunks that overlap what it
    holds. `strict`: a folder pardsl wrote must be of this plan's model, and no folder may hold a model
    tensor this model does not have. `strict=False` also matches names with leading module names dropped,
    as the own format does (a folder of a plain Hugging Face model, loaded into a model that wraps it)."""
    source = DcpSource(checkpoint, verify, allow_shared_folder)
    tied = plan.compiled.bound.tied
    known = _model_names(plan)
    prefix = source.model_prefix(known)
    if strict:
        _check_same_model(source, plan, known, prefix)
    optimizer = source.optimizer_prefix() or _OPTIMIZER_PREFIXES[0]
    saved = {key for key in source.tensors if not key.startswith(optimizer)}  # no moment taken for a weight
    targets, missing = {}, []
    for module, parameters, buffers in parts:
        for name, (attr, layout, _) in [*parameters.items(), *buffers.items()]:
            key = _find_name([prefix + n for n in tied.get(name, (name,))], saved, by_suffix=not strict)
            if key is None:
                if name in parameters:
                    missing.append(name)
                continue  # a buffer the folder lacks keeps the value the model's factory gives it
            targets.setdefault(key, []).extend(_target(source, key, getattr(module, attr), Layout.from_key(layout),
                                                       module.rt))
    if missing:
        raise CheckpointError(f"{checkpoint} has no tensor for parameter(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                              + "; the checkpoint is refused, nothing was loaded")
    source.read(targets)


def _model_names(plan) -> set[str]:
    """The names of the model's parameters and buffers, each tied name included."""
    known = set(plan.parameter_layouts) | set(plan.buffer_layouts)
    for names in plan.compiled.bound.tied.values():
        known.update(names)
    return known


def _check_same_model(source: DcpSource, plan, known: set[str], prefix: str) -> None:
    if source.sidecar is not None:
        saved_model = (source.sidecar.get("plan") or {}).get("model")
        model = plan.compiled.par.model.text
        if saved_model != model:
            raise CheckpointError(f"{source.path} was saved from model `{saved_model}`; this plan builds "
                                  f"`{model}`. To load it anyway (a deliberate transfer), pass strict=False")
    optimizer = source.optimizer_prefix() or _OPTIMIZER_PREFIXES[0]
    foreign = sorted(key for key in source.tensors if not key.startswith(optimizer)
                     and key.removeprefix(prefix) not in known)
    if foreign:
        raise CheckpointError(f"{source.path} holds tensor(s) this model does not have: {', '.join(foreign[:5])}"
                              + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
                              + ". To load it anyway, pass strict=False")


@torch.no_grad()
def load_optimizer_state(optimizer: torch.optim.Optimizer, model, checkpoint: str, strict: bool = True,
                         verify: bool = True, allow_shared_folder: bool = False) -> None:
    """As checkpoint.load_optimizer_state, from a DCP folder in torch's layout (flattened, as torchtitan
    saves it, or not: `param_groups` one list)."""
    source = DcpSource(checkpoint, verify, allow_shared_folder)
    prefix = source.optimizer_prefix()
    if prefix is None:
        raise CheckpointError(f"{checkpoint} holds no optimizer state (under `optimizer` or `optim`)")
    if strict and source.sidecar is not None and source.sidecar.get("optimizer_class") != type(optimizer).__name__:
        raise CheckpointError(f"{checkpoint} holds the state of a {source.sidecar.get('optimizer_class')} optimizer; "
                              f"this one is a {type(optimizer).__name__}. To load it anyway, pass strict=False")
    if strict:  # the state of another model's parameters is no state for these, as for the own format
        known = _model_names(model.plan)
        _check_same_model(source, model.plan, known, source.model_prefix(known))
    rt = model.rt
    shards = {id(p): (name, p, Layout.from_key(layout)) for name, p, layout in model.named_shards()}
    groups_key = prefix + "param_groups"
    value_keys = [key for key in source.keys
                  if key not in source.tensors and (key.startswith(prefix + "state.") or key.startswith(groups_key))]
    targets, slots = {}, []  # slots: (position, name, state key, tensor)
    names = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            name, _, layout = shards[id(parameter)]
            names.append(name)
            state_prefix = f"{prefix}state.{name}."
            for key in [k for k in source.tensors if k.startswith(state_prefix)]:
                saved, shape = source.tensors[key], _global_shape(parameter, layout, rt)
                if not len(saved.size):  # a count such as Adam's step: whole on every rank
                    value = torch.empty(saved.size, dtype=saved.properties.dtype)
                    targets[key] = [(Region((), (), ()), value)]
                elif tuple(saved.size) == shape:
                    value = torch.empty_like(parameter)
                    targets[key] = _target(source, key, value, layout, rt)
                else:  # not this parameter's: read whole it would be a tensor no step can use, on every rank
                    _refuse(checkpoint, f"optimizer state `{key[len(state_prefix):]}` of parameter {name} has "
                            f"shape {list(saved.size)}; the parameter's is {list(shape)} (the state of another "
                            "model's parameter, or of an optimizer that keeps other state)",
                            "Load the state saved with this model, or start the optimizer without it")
                slots.append((len(names) - 1, name, key[len(state_prefix):], value))
    values = source.read(targets, value_keys)
    state: dict[int, dict] = {}
    for position, _, key, value in slots:
        state.setdefault(position, {})[key] = value.to(rt.device) if value.dim() == 0 else value
    for position, name in enumerate(names):
        state_prefix = f"{prefix}state.{name}."
        for key, value in values.items():
            if key.startswith(state_prefix):
                state.setdefault(position, {})[key[len(state_prefix):]] = value
    groups, position = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        hyper = _saved_hyperparameters(values, groups_key, names[position:position + count], checkpoint)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **hyper,
                       "params": list(range(position, position + count))})
        position += count
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _global_shape(local: torch.Tensor, layout: Layout, rt) -> tuple[int, ...]:
    return tuple(size * layout.split_factor(dim, rt.mesh) for dim, size in enumerate(local.shape))


def _saved_hyperparameters(values: dict, groups_key: str, names: list[str], checkpoint: str) -> dict:
    """The hyperparameters saved for the group of parameters `names`: per parameter (flattened), or in the
    list of groups that names them."""
    if groups_key in values:  # not flattened: [{"lr": ..., "params": [names]}, ...]
        groups = values[groups_key]
        for group in groups if isinstance(groups, list) else ():
            if isinstance(group, dict) and set(names) & set(group.get("params", ())):
                return {k: v for k, v in group.items() if k != "params"}
        raise CheckpointError(f"{checkpoint}: no saved parameter group holds {names[0]}")
    first = f"{groups_key}.{names[0]}." if names else None
    return {key[len(first):]: value for key, value in values.items() if first and key.startswith(first)}


# ---------------------------------------------------------------------------------------------------
# Saving


class _ChunkSavePlanner(DefaultSavePlanner):
    """DCP's planner, with the tensors pardsl holds written as the chunks their layouts give (one per
    block of a blocked split), by the ranks that own them."""

    def __init__(self, chunks: dict[str, tuple[torch.Tensor, tuple[int, ...], list[Region]]]):
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, value in self.state_dict.items():
            if key not in self.chunks:
                items.extend(_create_write_items(key, value))  # counts, hyperparameters: DCP's own items
                continue
            local, shape, regions = self.chunks[key]
            for region in regions:
                items.append(WriteItem(
                    index=MetadataIndex(key, torch.Size(region.offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(region.offsets),
                                                                           torch.Size(region.sizes)),
                                                properties=TensorProperties.create_from_tensor(local),
                                                size=torch.Size(shape))))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.index.fqn not in self.chunks:
            return super().resolve_data(write_item)
        local, _, regions = self.chunks[write_item.index.fqn]
        region = next(r for r in regions if r.offsets == tuple(write_item.index.offset))
        return local[region.local_index()].detach().cpu().contiguous()


def _state(model, optimizer) -> tuple[dict, dict]:
    """What this rank saves, in torch's layout: the state dict (model tensors by name, the optimizer's
    under `optimizer`, flattened), and the tensors written as chunks, by their flattened key."""
    entries, optimizer_json = _entries(model, optimizer)
    state, chunks, flat = {}, {}, {}
    rt = model.rt
    for name, entry in entries.items():
        if name.startswith("optimizer."):
            parameter, _, key = name[len("optimizer."):].rpartition(".")
            state_key = f"state.{parameter}.{key}"
            flat[state_key] = entry.local
            full_key = "optimizer." + state_key
        else:
            state[name] = entry.local
            full_key = name
        regions = _regions(entry.layout, entry.shape, rt) if entry.written else []
        chunks[full_key] = (entry.local, entry.shape, regions)
    if optimizer_json is not None:
        for name, values in optimizer_json["values"].items():
            for key, value in values.items():
                flat[f"state.{name}.{key}"] = value
        for group in optimizer_json["param_groups"]:
            for name in group["params"]:
                for key, value in group.items():
                    if key != "params":
                        # JSON made torch's tuples (betas) lists
                        flat[f"param_groups.{name}.{key}"] = tuple(value) if isinstance(value, list) else value
        state["optimizer"] = flat
    return state, chunks


_OWN_FILE = "__{rank}_"  # DCP's writer names rank r's files __r_<n>.distcp


def save(model, path: str, optimizer=None, metadata: dict | None = None, allow_shared_folder: bool = False) -> None:
    """Write `model` (and `optimizer`'s state) as a DCP folder at `path`: collective. The folder is written
    beside `path` under a new name and renamed into place once every rank's files and the hashes are on
    disk; an existing DCP folder at `path` is replaced (a folder holding anything else is refused)."""
    if metadata is not None:
        json.dumps(metadata)
    _check_trusted(path, allow_shared_folder, f"refusing to save to {path}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.abspath(path)
    save_id = secrets.token_hex(8)
    if dist.is_initialized():
        save_id = all_gather_json(save_id)[0]
    staging = f"{path}.{save_id}.tmp"
    failure = None
    if rank == 0:
        try:
            _check_replaceable(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkdir(staging)
            _check_trusted(staging, allow_shared_folder, f"refusing to save to {path}")
        except (OSError, CheckpointError) as error:
            failure = str(error)
    if dist.is_initialized():
        failure = all_gather_json(failure)[0]
    if failure:
        raise CheckpointError(failure)
    state, chunks = _state(model, optimizer)
    dcp.save(state, storage_writer=FileSystemWriter(staging), planner=_ChunkSavePlanner(chunks))
    prefix = _OWN_FILE.format(rank=rank)
    mine = {}
    for file in sorted(os.listdir(staging)):
        if file.startswith(prefix) and file.endswith(".distcp"):
            with open(os.path.join(staging, file), "rb") as handle:
                mine[file] = (os.path.getsize(handle.name), _sha256(handle))
    parts = all_gather_json(mine) if dist.is_initialized() else [mine]
    failure = cause = None
    if rank == 0:
        try:
            _publish(model, optimizer, metadata, path, staging, save_id, parts)
        except Exception as error:  # noqa: BLE001 - whatever it is, the other ranks must hear of it
            failure, cause = f"{type(error).__name__}: {error}", error
    # rank 0's outcome, to every rank: the others would otherwise return as if saved, or wait for ever
    # at a barrier rank 0 never reaches
    if dist.is_initialized():
        failure = all_gather_json(failure)[0]
    if failure:
        raise CheckpointError(f"saving to {path} failed on rank 0 after the data files were written ({failure}); "
                              f"{path} is as it was before the save, and the files written are left in {staging}. "
                              "Fix the cause and save again") from cause


def _publish(model, optimizer, metadata, path: str, staging: str, save_id: str, parts: list[dict]) -> None:
    """Rank 0, once every rank's files are in `staging`: write the sidecar there (the data files' and
    .metadata's hashes, the plan) and rename `staging` to `path`."""
    files = {file: entry for part in parts for file, entry in part.items()}
    par = model.plan.compiled.par
    mesh = model.rt.mesh
    with open(os.path.join(staging, METADATA_FILE), "rb") as handle:
        metadata_sha256 = _sha256(handle)
    document = {"format": SIDECAR_FORMAT, "save_id": save_id, "save_counter": _next_save_counter(path),
                "saved_at": time.time(),
                "files": {file: size for file, (size, _) in files.items()},
                "sha256": {file: digest for file, (_, digest) in files.items()},
                "metadata_sha256": metadata_sha256,
                "plan": {"path": par.source.path, "text": par.source.text, "model": par.model.text,
                         "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes))},
                "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
                "metadata": metadata}
    fd, temporary = _new_temporary(staging, SIDECAR_FILE)
    with open(fd, "w", encoding="utf-8") as handle:
        json.dump(document, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(staging, SIDECAR_FILE))
    _fsync(staging)
    old = f"{path}.{save_id}.old"
    if os.path.exists(path):
        os.rename(path, old)
    try:
        os.rename(staging, path)  # publishes the save
    except OSError:
        if os.path.exists(old):  # the previous checkpoint back in place, as the caller is told
            os.rename(old, path)
        raise
    _fsync(os.path.dirname(path))
    # published: a replaced folder left behind is passed over by latest_checkpoint, no reason to fail the save
    shutil.rmtree(old, ignore_errors=True)


def _check_replaceable(path: str) -> None:
    """A save replaces what is at `path` only where that is a DCP checkpoint (and nothing else)."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointError(f"refusing to save to {path}: it is not a folder")
    others = [entry for entry in os.listdir(path) if entry not in (METADATA_FILE, SIDECAR_FILE)
              and not (entry.startswith("__") and entry.endswith(".distcp"))]
    if others:
        raise CheckpointError(f"refusing to save to {path}: it holds {others[0]!r}, which is no part of a DCP "
                              "checkpoint; a DCP save replaces the folder as a whole. Save to a new folder")


def whole_model_tensors(checkpoint: str, verify: bool = True, allow_shared_folder: bool = False) \
        -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder but the optimizer's, whole, by its name there (for export_checkpoint)."""
    source = DcpSource(checkpoint, verify, allow_shared_folder)
    optimizer = source.optimizer_prefix() or _OPTIMIZER_PREFIXES[0]
    tensors, targets = {}, {}
    for key, saved in source.tensors.items():
        if not key.startswith(optimizer):
            tensors[key] = torch.empty(saved.size, dtype=saved.properties.dtype)
            zeros = (0,) * len(saved.size)
            targets[key] = [(Region(zeros, tuple(saved.size), zeros), tensors[key])]
    source.read(targets)
    return tensors


def metadata_of(checkpoint: str, verify: bool = True, allow_shared_folder: bool = False) -> dict | None:
    """The `metadata` a pardsl DCP save stored (None for a folder torch wrote), once the folder's checks
    hold."""
    sidecar = DcpSource(checkpoint, verify, allow_shared_folder).sidecar
    return None if sidecar is None else sidecar.get("metadata")


__all__ = ["DcpSource", "load_model_state", "load_optimizer_state", "save", "metadata_of",
           "whole_model_tensors"]
