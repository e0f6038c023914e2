"""Sharded checkpoints: safetensors files plus an index of where each piece of each tensor lies.

A checkpoint folder holds one safetensors file per rank with the pieces of parameters, persistent
buffers and optimizer state that the rank owns, and `pardsl.index.json`: per tensor its global shape,
dtype and pieces (file, key, global offsets and sizes), the .par file it was saved under, and the
optimizer's hyperparameters. A replicated tensor is written once (by the ranks at coordinate 0 of the
axes it is broadcast on), so the folder holds each element once, whatever the mesh. In a pipeline each
stage's ranks write their stage's tensors, and a weight two stages hold (a tied embedding) is written by
the first; each rank says what it wrote, and rank 0 gathers that into the index.

A save is all or nothing. Every file of one save carries that save's id, in its name and in its metadata;
each rank writes and fsyncs its file under a new name, and only once every rank has, rank 0 publishes the
index with one atomic rename (then removes the files of earlier saves). A save that dies part-way leaves
the previous index and its files as they were. A loader checks the whole index before it reads a byte of
data: files inside the folder with the save's id and the sizes the index gives, pieces inside their
tensor that cover each element exactly once, keys present at the shapes and dtypes given; and that the
checkpoint is of the model that loads it. A checkpoint that fails a check is refused (CheckpointError),
never loaded in part. The index also gives each file's sha256, which a reader checks before its first
read from the file, and a save counter, one more than any other save's beside it, which orders saves for
`latest_checkpoint` whatever the clocks said.

Checkpoints are saved and read only in folders no other user can change (UntrustedFolderError otherwise,
unless `allow_shared_folder=True`): whoever can write a folder can put their files in place of the
user's. A save's temporary files take random names, created where nothing is (O_EXCL, O_NOFOLLOW), so a
link planted at a name a save would use is never written through.

Loading reads, per rank, only the slices of the pieces that overlap what the rank holds under the plan
it loads into (safetensors' `get_slice` reads those bytes alone), so a checkpoint saved under one mesh
and layout loads under any other. A single `model.safetensors` file, or a Hugging Face folder with
`model.safetensors.index.json`, is read the same way: each of its tensors is one whole piece (the files
that index names held inside its folder, as pardsl's own index's are).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import time

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from pardsl.layouts.algebra import Layout, Mesh
from pardsl.runtime.collectives import all_gather_json
from pardsl.runtime import dcp
from pardsl.runtime.checkpoint_files import (  # the formats' shared parts, also pardsl.runtime.checkpoint's to import
    _check_trusted,
    _checkpoints_in,
    _coverage_error,
    _entries,
    _find_name,
    _fsync,
    _group_of_mine_alone,
    _is_count,
    _is_pardsl,
    _new_temporary,
    _next_save_counter,
    _outside,
    _refuse,
    _save_counter,
    _sha256,
    CheckpointError,
    INDEX_FILE,
    local_regions,
    owns,
    Piece,
    Region,
    UntrustedFolderError,
)

HF_INDEX_FILE = "model.safetensors.index.json"
HF_SINGLE_FILE = "model.safetensors"
FORMAT = "pardsl-checkpoint/2"
SAVE_ID_KEY = "pardsl.save_id"  # in each file's safetensors metadata
# torch's dtype names (the index's) and safetensors' (a file's header)
_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
           "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "complex64": "C64",
           "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def _file_name(rank: int, world: int, save_id: str) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.{save_id}.safetensors"


# a save's files, and the temporary files of saves that died part-way (an earlier pardsl's fixed `.tmp`)
_STALE_FILE = re.compile(r"rank-\d{5}-of-\d{5}(\.[0-9a-f]+)?\.safetensors(\.([0-9a-f]+\.)?tmp)?"
                         r"|pardsl\.index\.json(\.[0-9a-f]+)?\.tmp")
_FUTURE_SLACK_S = 24 * 3600  # a `saved_at` later than now by more than clocks disagree is not a time a save had


def _key(name: str, offsets: tuple[int, ...]) -> str:
    return f"{name}@{','.join(map(str, offsets))}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------
# Saving


def _merged_optimizer(parts: list[dict | None]) -> dict | None:
    """The optimizer's JSON part of the index from every rank's: in a pipeline each rank's optimizer steps
    only its stages' parameters, so each group lists the names of every rank's."""
    present = [part for part in parts if part is not None]
    if not present:
        return None
    groups = [{**group, "params": []} for group in present[0]["param_groups"]]
    values: dict = {}
    for part in present:
        for group, theirs in zip(groups, part["param_groups"]):
            group["params"].extend(name for name in theirs["params"] if name not in group["params"])
        for name, entry in part["values"].items():
            values.setdefault(name, entry)
    return {"class": present[0]["class"], "param_groups": groups, "values": values}


FORMATS = ("pardsl", "dcp")
DEFAULT_FORMAT = "pardsl"


def save(model, path: str, optimizer: torch.optim.Optimizer | None = None, metadata: dict | None = None,
         allow_shared_folder: bool = False, format: str = DEFAULT_FORMAT) -> None:  # noqa: A002 - the word users know
    """Write this rank's shards of `model` (a ParallelModule, or a PipelineModule: its stages) and of
    `optimizer`'s state to folder `path`; `metadata` (JSON: the step, the data loader's position) is stored
    in the index with them, published by the same rename (`checkpoint_metadata` reads it back).

    Collective: every rank calls it. Returns once the checkpoint is published. Over an existing checkpoint,
    the old one stays loadable until the new one is complete. A folder that another user could write (or
    one inside such a folder) is refused, unless `allow_shared_folder`.

    `format="dcp"` writes a torch.distributed.checkpoint folder in the layout torchtitan and FSDP2 runs
    read (pardsl/runtime/dcp.py), published by renaming it into place.
    """
    if format not in FORMATS:
        raise ValueError(f"pardsl.save: format {format!r} is not one of {', '.join(map(repr, FORMATS))}")
    if format == "dcp":
        return dcp.save(model, path, optimizer, metadata, allow_shared_folder)
    if metadata is not None:
        json.dumps(metadata)  # fails here, on every rank alike, rather than after the files are written
    _check_trusted(path, allow_shared_folder, f"refusing to save to {path}")
    rt = model.rt
    mesh = rt.mesh
    world = mesh.size
    rank = dist.get_rank() if dist.is_initialized() else 0
    coordinate = tuple(rt.coordinate[name] for name in mesh.axis_names)
    save_id = secrets.token_hex(8)
    if dist.is_initialized():  # rank 0's; exchanged as JSON, as below: what a peer sends is never unpickled
        save_id = all_gather_json(save_id)[0]
    entries, optimizer_json = _entries(model, optimizer)
    os.makedirs(path, exist_ok=True)
    _check_trusted(path, allow_shared_folder, f"refusing to save to {path}")  # as made, under this umask

    described = {}  # this rank's part of the index: every tensor it holds, and the pieces it writes
    mine = {}
    file_name = _file_name(rank, world, save_id)
    for name, entry in entries.items():
        pieces = []
        for region in local_regions(entry.layout, entry.shape, mesh, coordinate) if entry.written else ():
            key = _key(name, region.offsets)
            pieces.append({"file": file_name, "key": key, "offsets": list(region.offsets),
                           "sizes": list(region.sizes)})
            mine[key] = entry.local[region.local_index()].contiguous().clone()
        described[name] = {"shape": list(entry.shape), "dtype": _dtype_name(entry.local.dtype), "pieces": pieces}

    written = None
    if mine:  # a rank whose copies another rank writes has no file
        file = os.path.join(path, file_name)
        fd, temporary = _new_temporary(path, file_name)
        os.close(fd)
        # safetensors writes to a path: the file made here, which no other user can replace in a folder they
        # cannot write (checked above); from 0.8 on, a random file of its own that it renames over it
        save_file({k: v.cpu() for k, v in mine.items()}, temporary,
                  metadata={"format": "pt", SAVE_ID_KEY: save_id})
        with open(temporary, "rb") as handle:
            digest = _sha256(handle)  # of the bytes on disk, as a loader will read them
            os.fsync(handle.fileno())
        os.replace(temporary, file)
        _fsync(path)
        written = (file_name, os.path.getsize(file), digest)
    parts = [(written, described, optimizer_json)]
    if dist.is_initialized():  # also the barrier: every rank's file is on disk before the index names it
        parts = all_gather_json((written, described, optimizer_json))
    if rank == 0:
        par = model.plan.compiled.par
        written_files = [file for file, _, _ in parts if file is not None]
        index: dict[str, dict] = {}
        for _, theirs, _ in parts:
            for name, entry in theirs.items():
                index.setdefault(name, {**entry, "pieces": []})["pieces"].extend(entry["pieces"])
        document = {
            "format": FORMAT,
            "save_id": save_id,
            "save_counter": _next_save_counter(path),
            "saved_at": time.time(),
            "files": {name: size for (name, size, _) in written_files},
            "sha256": {name: digest for (name, _, digest) in written_files},
            "plan": {"path": par.source.path, "text": par.source.text, "model": par.model.text,
                     "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes))},
            "tied": {name: list(names) for name, names in model.plan.compiled.bound.tied.items()
                     if len(names) > 1 and name in index},
            "tensors": index,
            "optimizer": _merged_optimizer([optimizer_json for _, _, optimizer_json in parts]),
            "metadata": metadata,
        }
        fd, temporary = _new_temporary(path, INDEX_FILE)
        with open(fd, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, os.path.join(path, INDEX_FILE))  # the one step that publishes the save
        _fsync(path)
        for stale in os.listdir(path):  # earlier saves' files, and those of saves that died part-way
            if _STALE_FILE.fullmatch(stale) and stale not in document["files"]:
                try:
                    os.remove(os.path.join(path, stale))
                except OSError:  # another user's, in a sticky folder: the save is published, and unharmed by it
                    pass
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------------------------------
# Reading


def _checked_index(folder: str, verify: bool = True, allow_shared_folder: bool = False) \
        -> tuple[dict, dict[str, tuple[tuple[int, ...], list[Piece]]]]:
    """A pardsl checkpoint's index, and per tensor its shape and pieces, once every check holds; else
    CheckpointError saying which does not. Reads the index and each file's header, no tensor data; with
    `verify`, the index must give each file's sha256 (which the reader checks before it reads the file)."""
    where = os.path.join(folder, INDEX_FILE)

    def refuse(message: str, remedy: str = ""):
        _refuse(folder, message, remedy)

    _check_trusted(where, allow_shared_folder, folder)
    try:
        with open(where, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        refuse(f"its index {INDEX_FILE} cannot be read ({error})")
    if not isinstance(document, dict):
        refuse(f"its index {INDEX_FILE} is not an object")
    if document.get("format") != FORMAT:
        refuse(f"its index has format {document.get('format')!r}; this pardsl reads {FORMAT!r} (a checkpoint "
               "saved by an earlier pardsl, whose files carry no save id, must be saved again)")
    save_id, files, tensors = document.get("save_id"), document.get("files"), document.get("tensors")
    if not isinstance(save_id, str) or not re.fullmatch(r"[0-9a-f]{1,64}", save_id):
        refuse("its index has no valid save id")
    if not isinstance(files, dict) or not all(isinstance(n, str) and _is_count(size) for n, size in files.items()):
        refuse("its index lists no files with their sizes")
    if not isinstance(tensors, dict):
        refuse("its index lists no tensors")
    hashes = document.get("sha256")
    headers = {}
    for name, size in files.items():
        file = os.path.join(folder, name)
        if _outside(folder, name):
            refuse(f"its index names a file outside the folder: {name!r}")
        if not os.path.isfile(file):
            refuse(f"file {name} is missing (a save that did not finish, or a file removed)")
        _check_trusted(file, allow_shared_folder, folder)
        if verify and not (isinstance(hashes, dict) and isinstance(hashes.get(name), str)
                           and re.fullmatch(r"[0-9a-f]{64}", hashes[name])):
            refuse(f"its index gives no sha256 for file {name} (a checkpoint saved by a pardsl before content "
                   "hashes), so its bytes cannot be checked", "To load it unverified, pass verify=False (and "
                   "save it again to give it hashes)")
        if os.path.getsize(file) != size:
            refuse(f"file {name} has {os.path.getsize(file)} bytes; the index says {size} (a file cut short "
                   "or written over)")
        try:
            with safe_open(file, framework="pt") as handle:
                metadata = handle.metadata() or {}
                headers[name] = {key: (tuple(handle.get_slice(key).get_shape()), handle.get_slice(key).get_dtype())
                                 for key in handle.keys()}
        except Exception as error:  # noqa: BLE001 - safetensors' errors for a damaged header vary
            refuse(f"file {name} is not a readable safetensors file ({type(error).__name__}: {error})")
        if metadata.get(SAVE_ID_KEY) != save_id:
            refuse(f"file {name} belongs to save {metadata.get(SAVE_ID_KEY)!r}, not to this index's save "
                   f"{save_id!r} (files of two saves mixed)")
    checked = {}
    for name, entry in tensors.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("pieces"), list) \
                or not isinstance(entry.get("shape"), list) or not all(map(_is_count, entry["shape"])):
            refuse(f"tensor `{name}`: its entry has no shape or pieces")
        shape = tuple(entry["shape"])
        dtype = entry.get("dtype")
        if dtype not in _DTYPES:
            refuse(f"tensor `{name}`: unknown dtype {dtype!r}")
        pieces = []
        for p in entry["pieces"]:
            if not isinstance(p, dict) or p.get("file") not in files or not isinstance(p.get("key"), str) \
                    or not isinstance(p.get("offsets"), list) or not isinstance(p.get("sizes"), list) \
                    or not all(map(_is_count, p["offsets"] + p["sizes"])) \
                    or not len(p["offsets"]) == len(p["sizes"]) == len(shape):
                refuse(f"tensor `{name}`: a piece is malformed or names a file the index does not list")
            piece = Piece(p["file"], p["key"], tuple(p["offsets"]), tuple(p["sizes"]))
            if any(o + n > s for o, n, s in zip(piece.offsets, piece.sizes, shape)):
                refuse(f"tensor `{name}`: piece {piece.key} at {list(piece.offsets)} of sizes {list(piece.sizes)} "
                       f"lies outside the tensor's shape {list(shape)}")
            stored = headers[piece.file].get(piece.key)
            if stored is None:
                refuse(f"tensor `{name}`: piece {piece.key} is not in file {piece.file}")
            if stored != (piece.sizes, _DTYPES[dtype]):
                refuse(f"tensor `{name}`: piece {piece.key} is stored as {stored[1]} {list(stored[0])}; the index "
                       f"says {_DTYPES[dtype]} {list(piece.sizes)}")
            pieces.append(piece)
        coverage = _coverage_error(shape, pieces)
        if coverage:
            refuse(f"tensor `{name}`: {coverage}")
        checked[name] = (shape, pieces)
    return document, checked


def _hugging_face_files(folder: str) -> list[str]:
    """The files a Hugging Face folder's index names; CheckpointError where it cannot be read."""
    try:
        with open(os.path.join(folder, HF_INDEX_FILE), encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        _refuse(folder, f"its index {HF_INDEX_FILE} cannot be read ({type(error).__name__}: {error})")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        _refuse(folder, f"its index {HF_INDEX_FILE} has no weight_map of tensor names to file names")
    return sorted(set(weight_map.values()))


def _cache_blobs(folder: str) -> str | None:
    """Where the files of `folder` may link to: the blobs of huggingface_hub's cache, where `folder` is one
    of its snapshots (snapshots/<revision>/ holds links to ../../blobs/); else None."""
    real = os.path.realpath(folder)
    if os.path.basename(os.path.dirname(real)) != "snapshots":
        return None
    return os.path.join(os.path.dirname(os.path.dirname(real)), "blobs")


class CheckpointSource:
    """Where each tensor's pieces lie: a pardsl checkpoint, a safetensors file, or a Hugging Face folder."""

    def __init__(self, path: str, verify: bool = True, allow_shared_folder: bool = False):
        """`verify`: check each file of a pardsl checkpoint against the sha256 its index gives, before the
        first read from it. `allow_shared_folder`: read a checkpoint that other users could have changed."""
        self.path = path
        self.document = None
        self._handles = {}
        self._hashes = {}  # file: the sha256 it must have, checked when it is first opened
        _check_trusted(path, allow_shared_folder, path)
        if os.path.isdir(path) and os.path.exists(os.path.join(path, INDEX_FILE)):
            self.document, self.tensors = _checked_index(path, verify, allow_shared_folder)
            if verify:
                self._hashes = dict(self.document["sha256"])
            return
        if os.path.isdir(path) and os.path.exists(os.path.join(path, HF_INDEX_FILE)):
            files = _hugging_face_files(path)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, HF_SINGLE_FILE)):
            files = [HF_SINGLE_FILE]
        elif os.path.isfile(path):  # the file named: no index to keep inside a folder
            self.path, files = os.path.dirname(os.path.abspath(path)), [os.path.basename(path)]
        else:
            raise FileNotFoundError(f"{path}: neither a pardsl checkpoint ({INDEX_FILE}), a Hugging Face folder "
                                    f"({HF_INDEX_FILE} or {HF_SINGLE_FILE}) nor a safetensors file")
        if os.path.isdir(path):  # held to the rules of pardsl's own index
            for file in files:
                if _outside(path, file, _cache_blobs(path)):
                    _refuse(path, f"its index names a file outside the folder: {file!r}")
        self.tensors = {}
        for file in files:
            _check_trusted(os.path.join(self.path, file), allow_shared_folder, path)
            handle = self._open(file)
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                self.tensors[key] = (shape, [Piece(file, key, (0,) * len(shape), shape)])

    def _open(self, file: str):
        if file not in self._handles:
            path = os.path.join(self.path, file)
            if file in self._hashes:  # each rank hashes the files it reads from, not all of them
                with open(path, "rb") as handle:
                    digest = _sha256(handle)
                if digest != self._hashes[file]:
                    _refuse(self.path, f"file {file} does not hold the bytes saved: its sha256 is {digest}; the "
                            f"index says {self._hashes[file]} (written over or damaged since the save)",
                            "To load it unverified, pass verify=False")
            self._handles[file] = safe_open(path, framework="pt")
        return self._handles[file]

    def find(self, names, by_suffix: bool = True) -> str | None:
        """The checkpoint's name for a tensor known by `names` (tied names included): `_find_name`."""
        return _find_name(names, self.tensors, by_suffix)

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
def load_model_state(parts, plan, checkpoint: str, strict: bool = True, verify: bool = True,
                     allow_shared_folder: bool = False) -> None:
    """Fill the parameters (and the persistent buffers the checkpoint has) of what this rank holds, `parts`:
    (generated module, its parameters' table, its buffers' table), one module or a pipeline's stages, with
    this rank's slices of the checkpoint's tensors.

    A pardsl checkpoint must be of this plan's model (the same `model` line, and no tensor the model does
    not have), and its names match exactly; `strict=False` loads one saved from another model, matching
    names also with leading module names dropped, as for a Hugging Face checkpoint. `verify`,
    `allow_shared_folder`: as for CheckpointSource. A DCP folder (its `.metadata`) is read by
    pardsl.runtime.dcp."""
    if _is_dcp(checkpoint):
        return dcp.load_model_state(parts, plan, checkpoint, strict, verify, allow_shared_folder)
    source = CheckpointSource(checkpoint, verify, allow_shared_folder)
    tied = plan.compiled.bound.tied
    if source.document is not None and strict:
        _check_same_model(source, plan, checkpoint)
    by_suffix = source.document is None or not strict
    missing = []
    for module, parameters, buffers in parts:
        rt = module.rt
        coordinate = tuple(rt.coordinate[name] for name in rt.mesh.axis_names)
        for name, (attr, layout, _) in parameters.items():
            found = source.find(tied.get(name, (name,)), by_suffix)
            if found is None:
                missing.append(name)
                continue
            source.read_into(found, getattr(module, attr), Layout.from_key(layout), rt.mesh, coordinate)
        for name, (attr, layout, _) in buffers.items():
            found = source.find((name,), by_suffix)
            if found is not None:  # the others keep the values the model's factory gives them
                source.read_into(found, getattr(module, attr), Layout.from_key(layout), rt.mesh, coordinate)
    if missing:
        raise KeyError(f"{checkpoint} has no tensor for parameter(s) {', '.join(missing[:5])}"
                       + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _check_same_model(source: CheckpointSource, plan, checkpoint: str) -> None:
    """That a pardsl checkpoint was saved from the model `plan` builds: its `model` line, and every model
    tensor it holds is one of the model's (under any of its tied names)."""
    saved_model = (source.document.get("plan") or {}).get("model")
    model = plan.compiled.par.model.text
    if saved_model != model:
        raise CheckpointError(f"{checkpoint} was saved from model `{saved_model}`; this plan builds `{model}`. "
                              "To load it anyway (a deliberate transfer), pass strict=False")
    known = set(plan.parameter_layouts) | set(plan.buffer_layouts)
    for names in plan.compiled.bound.tied.values():
        known.update(names)
    foreign = sorted(name for name in source.tensors if not name.startswith("optimizer.") and name not in known)
    if foreign:
        raise CheckpointError(f"{checkpoint} holds tensor(s) this model does not have: {', '.join(foreign[:5])}"
                              + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
                              + ". To load it anyway, pass strict=False")


def checkpoint_metadata(checkpoint: str, verify: bool = True, allow_shared_folder: bool = False) -> dict | None:
    """The `metadata` a pardsl checkpoint was saved with (after checking its index and files' headers)."""
    if _is_dcp(checkpoint):
        return dcp.metadata_of(checkpoint, verify, allow_shared_folder)
    if not _is_pardsl(checkpoint):
        return None
    return CheckpointSource(checkpoint, verify, allow_shared_folder).document.get("metadata")


def _is_dcp(path: str) -> bool:
    """A torch.distributed.checkpoint folder, known by its `.metadata` (and no pardsl index)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")) and not _is_pardsl(path)


def _time_saved(document: dict) -> float:
    """The index's `saved_at` where it is a time a save could have had; else -inf (NaN, infinite,
    negative, in the future, not a number)."""
    saved_at = document.get("saved_at")
    if isinstance(saved_at, (int, float)) and not isinstance(saved_at, bool) \
            and 0 <= saved_at <= time.time() + _FUTURE_SLACK_S:  # NaN fails both comparisons
        return float(saved_at)
    return -math.inf


def latest_checkpoint(folder: str, allow_shared_folder: bool = False) -> str | None:
    """The newest complete pardsl checkpoint among `folder`'s subfolders (and `folder` itself), in either
    format pardsl.save writes: the one of the highest save counter (each save's is one more than any beside
    it), of those saved alike the latest `saved_at`; None where there is none. A save that did not finish,
    or a damaged checkpoint, is passed over; one in a folder other users could change is refused
    (UntrustedFolderError), unless `allow_shared_folder`. Files' contents are not hashed here: loading
    does that."""
    if not os.path.isdir(folder):
        return None
    _check_trusted(folder, allow_shared_folder, folder)
    newest, newest_key = None, None
    for candidate in _checkpoints_in(folder):
        try:
            if _is_pardsl(candidate):
                document, _ = _checked_index(candidate, verify=False, allow_shared_folder=allow_shared_folder)
            else:
                document = dcp.DcpSource(candidate, verify=False, allow_shared_folder=allow_shared_folder).sidecar
                if document is None:
                    continue
        except UntrustedFolderError:
            raise
        except CheckpointError:
            continue
        key = (_save_counter(document), _time_saved(document))
        if newest_key is None or key > newest_key:
            newest, newest_key = candidate, key
    return newest


@torch.no_grad()
def load_optimizer_state(optimizer: torch.optim.Optimizer, model, checkpoint: str, strict: bool = True,
                         verify: bool = True, allow_shared_folder: bool = False) -> None:
    """Give `optimizer` (over `model.parameters()`, any plan) the state saved with `pardsl.save(...,
    optimizer=)`, resharded to this model's layouts, and the saved hyperparameters. The optimizer's class
    must be the one saved (`strict=False`: any class, given the state it finds). `verify`,
    `allow_shared_folder`: as for CheckpointSource. From a DCP folder, the state in torch's layout
    (pardsl.runtime.dcp)."""
    if _is_dcp(checkpoint):
        return dcp.load_optimizer_state(optimizer, model, checkpoint, strict, verify, allow_shared_folder)
    source = CheckpointSource(checkpoint, verify, allow_shared_folder)
    saved = source.document and source.document.get("optimizer")
    if not saved:
        raise ValueError(f"{checkpoint} holds no optimizer state (save it with pardsl.save(..., optimizer=opt))")
    if strict:
        _check_same_model(source, model.plan, checkpoint)
        if saved.get("class") != type(optimizer).__name__:
            raise CheckpointError(f"{checkpoint} holds the state of a {saved.get('class')} optimizer; this one is "
                                  f"a {type(optimizer).__name__}. To load it anyway, pass strict=False")
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("values"), dict) \
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved["param_groups"]):
        raise CheckpointError(f"{checkpoint}: its optimizer entry is malformed; the checkpoint is refused")
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


def export_checkpoint(checkpoint: str, output: str, verify: bool = True, allow_shared_folder: bool = False) \
        -> list[str]:
    """Write a pardsl checkpoint's model tensors, whole, to one safetensors file (Hugging Face's format);
    returns the names written. Optimizer state is left out. `verify`, `allow_shared_folder`: as for
    CheckpointSource. A DCP folder's model tensors are read whole by pardsl.runtime.dcp."""
    if _is_dcp(checkpoint):
        tensors = dcp.whole_model_tensors(checkpoint, verify, allow_shared_folder)
        save_file(tensors, output, metadata={"format": "pt"})
        return sorted(tensors)
    source = CheckpointSource(checkpoint, verify, allow_shared_folder)
    if source.document is None:
        raise ValueError(f"{checkpoint} is not a pardsl checkpoint (no {INDEX_FILE})")
    tensors = {name: source.full(name) for name in source.tensors if not name.startswith("optimizer.")}
    save_file(tensors, output, metadata={"format": "pt"})
    return sorted(tensors)


__all__ = ["CheckpointError", "UntrustedFolderError", "save", "load_model_state", "load_optimizer_state",
           "export_checkpoint", "checkpoint_metadata", "latest_checkpoint", "local_regions"]
