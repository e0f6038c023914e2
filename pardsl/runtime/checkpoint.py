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

import bisect
import grp
import hashlib
import itertools
import json
import math
import os
import pwd
import re
import secrets
import stat
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from pardsl.layouts.algebra import Layout, Mesh, chunk_of_block
from pardsl.runtime.collectives import all_gather_json

INDEX_FILE = "pardsl.index.json"
HF_INDEX_FILE = "model.safetensors.index.json"
HF_SINGLE_FILE = "model.safetensors"
FORMAT = "pardsl-checkpoint/2"
SAVE_ID_KEY = "pardsl.save_id"  # in each file's safetensors metadata
_MAX_GRID_CELLS = 1 << 24  # the coverage check's grid; a real layout's pieces make far fewer cells
# torch's dtype names (the index's) and safetensors' (a file's header)
_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
           "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "complex64": "C64",
           "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, damaged, or not of the model that loads it: refused as a whole."""


class UntrustedFolderError(CheckpointError):
    """A checkpoint folder, or a file in it, that another user could change (`allow_shared_folder=True` to
    use it anyway)."""


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
            block, n = size // blocks, mesh.axis_sizes[axis]
            chunk, mirrored = block // n, dim in layout.mirrored_dims()
            per_dim.append([(j * block + chunk_of_block(j, coordinate[axis], n, mirrored) * chunk, chunk, j * chunk)
                            for j in range(blocks)])
        else:
            index, ways = 0, 1
            for axis in axes:
                index, ways = index * mesh.axis_sizes[axis] + coordinate[axis], ways * mesh.axis_sizes[axis]
            local = size // ways
            per_dim.append([(index * local, local, 0)])
    return [Region(tuple(s[0] for s in combo), tuple(s[1] for s in combo), tuple(s[2] for s in combo))
            for combo in itertools.product(*per_dim)]


def owns(layout: Layout, coordinate: tuple[int, ...], pipeline_axis: int | None = None) -> bool:
    """Whether this rank writes its copy: it is the first of the ranks that hold the same values. Along a
    pipeline axis the ranks hold different stages, so no copy there is another's."""
    return all(p.is_split or coordinate[axis] == 0 or axis == pipeline_axis
               for axis, p in enumerate(layout.placements))


def _file_name(rank: int, world: int, save_id: str) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.{save_id}.safetensors"


# a save's files, and the temporary files of saves that died part-way (an earlier pardsl's fixed `.tmp`)
_STALE_FILE = re.compile(r"rank-\d{5}-of-\d{5}(\.[0-9a-f]+)?\.safetensors(\.([0-9a-f]+\.)?tmp)?"
                         r"|pardsl\.index\.json(\.[0-9a-f]+)?\.tmp")
_FUTURE_SLACK_S = 24 * 3600  # a `saved_at` later than now by more than clocks disagree is not a time a save had


def _fsync(path: str) -> None:
    """Data (or a folder's entries) on disk before anything that depends on it is published."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_temporary(folder: str, name: str) -> tuple[int, str]:
    """A new file beside `name` in `folder`, open for writing, and its path. Its name is random
    and it is created only if nothing is there (O_EXCL), never through a symbolic link (O_NOFOLLOW): a
    file another user placed at a name a save would use is never written through. Mode 0o666 less the
    umask, as any file the user writes."""
    temporary = os.path.join(folder, f"{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    return fd, temporary


def _sha256(handle) -> str:
    """The sha256 of what `handle` (a binary file) holds, read from its start."""
    handle.seek(0)
    digest, buffer = hashlib.sha256(), bytearray(1 << 22)
    view = memoryview(buffer)
    while read := handle.readinto(buffer):
        digest.update(view[:read])
    return digest.hexdigest()


def _untrusted_path(path: str) -> str | None:
    """Why another user could change or replace what `path` (a file or folder) holds, else None: it or a
    folder above it is owned by someone other than this user or root (an owner may rename what a folder
    holds), or is writable by group or others; a folder with the sticky bit (as /tmp) excepted, where
    others cannot rename what they do not own, and a group of this user's alone (a user private group,
    under umask 002). The rule OpenSSH applies to ~/.ssh."""
    me = os.geteuid()
    path = os.path.realpath(path)
    while True:
        try:
            info = os.stat(path)
        except FileNotFoundError:  # a folder a save has yet to make
            info = None
        if info is not None:
            shielded = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
            if info.st_uid not in (0, me):
                return f"{path} is owned by uid {info.st_uid}, not by you (uid {me}) or root"
            if info.st_mode & stat.S_IWOTH and not shielded:
                return f"{path} is writable by others without the sticky bit"
            if info.st_mode & stat.S_IWGRP and not shielded and not _group_of_mine_alone(info.st_gid):
                return f"{path} is writable by its group (gid {info.st_gid}) without the sticky bit"
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _group_of_mine_alone(gid: int) -> bool:
    """Whether group `gid` is this user's private group: named as the user, with no other member (listed
    in the group, or another user whose primary group it is, whom the group's list does not name)."""
    try:
        user, group = pwd.getpwuid(os.geteuid()).pw_name, grp.getgrgid(gid)
    except KeyError:
        return False
    others_primary = any(entry.pw_gid == gid and entry.pw_name != user for entry in pwd.getpwall())
    return group.gr_name == user and set(group.gr_mem) <= {user} and not others_primary


def _check_trusted(path: str, allow_shared_folder: bool, refused: str) -> None:
    """CheckpointError (message opening with `refused`) where another user could change `path`."""
    why = None if allow_shared_folder else _untrusted_path(path)
    if why:
        raise UntrustedFolderError(f"{refused}: {why}, so another user could replace or redirect the "
                                   "checkpoint's files. Keep checkpoints in folders only you can write (chown "
                                   "them to yourself, chmod go-w), or pass allow_shared_folder=True if you trust "
                                   "everyone who can write there")


def _outside(folder: str, name, blobs: str | None = None) -> bool:
    """Whether file `name` that an index names lies outside `folder`: not a plain name (a path, `..`, a
    hidden name), or a symbolic link or anything else resolving elsewhere. `blobs`: a folder links may
    lead into (a Hugging Face cache's, whose snapshot folders are links into it)."""
    if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
        return True
    file = os.path.join(folder, name)
    where = os.path.dirname(os.path.realpath(file))
    if os.path.islink(file):
        return blobs is None or where != blobs
    return where != os.path.realpath(folder)


def _key(name: str, offsets: tuple[int, ...]) -> str:
    return f"{name}@{','.join(map(str, offsets))}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------
# Saving


@dataclass(frozen=True)
class _Entry:
    """A tensor this rank holds, to save: its local value, layout and global shape, and whether this rank's
    copy is the one written."""

    local: torch.Tensor
    layout: Layout
    shape: tuple[int, ...]
    written: bool


def _entries(model, optimizer) -> tuple[dict[str, _Entry], dict | None]:
    """Every tensor this rank holds (parameters, persistent buffers, optimizer state), by name; and the
    optimizer's JSON part. A copy is written by the first of the ranks that hold the same values (`owns`);
    in a pipeline, where the ranks along the pipeline axis hold different stages, by the ranks of the first
    stage that holds it (a tied weight two stages hold is written once)."""
    plan, rt = model.plan, model.rt
    mesh = rt.mesh
    coordinate = tuple(rt.coordinate[name] for name in mesh.axis_names)
    pipeline = getattr(model, "pipeline", None)
    along = mesh.axis_names.index(pipeline.axis) if pipeline is not None else None
    first_stage = {name: min(held) for name, held in pipeline.shared} if pipeline is not None else {}
    persistent = plan.compiled.bound.persistent_buffers
    entries: dict[str, _Entry] = {}
    of_parameter: dict[int, tuple[str, _Entry]] = {}
    for stage, module, parameters, buffers in model.parts():
        tables = [*parameters.items(), *((name, entry) for name, entry in buffers.items() if name in persistent)]
        for name, (attr, layout, shape) in tables:
            local = getattr(module, attr)
            layout = Layout.from_key(layout)
            written = first_stage.get(name, stage) == stage and owns(layout, coordinate, along)
            entry = _Entry(local.detach(), layout, tuple(shape), written)
            of_parameter[id(local)] = (name, entry)
            entries.setdefault(name, entry)  # a tied weight two of this rank's stages hold: the first's
    if optimizer is None:
        return entries, None
    groups, values = [], {}
    count_written = owns(Layout.broadcast(mesh), coordinate, along)
    for group in optimizer.param_groups:
        names = [of_parameter[id(p)][0] for p in group["params"]]
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append({"params": names, **{k: v for k, v in hyper.items() if _is_json(v)}})
        for parameter in group["params"]:
            name, held = of_parameter[id(parameter)]
            for key, value in optimizer.state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == parameter.shape and value.dim() > 0:
                    state = _Entry(value.detach(), held.layout, held.shape, held.written)
                elif isinstance(value, torch.Tensor):  # a count such as Adam's step: the same on every rank
                    state = _Entry(value.detach(), Layout.broadcast(mesh), tuple(value.shape),
                                   held.written and count_written)
                else:
                    if _is_json(value):
                        values.setdefault(name, {})[key] = value
                    continue
                if state.written or f"optimizer.{name}.{key}" not in entries:
                    entries[f"optimizer.{name}.{key}"] = state
    return entries, {"class": type(optimizer).__name__, "param_groups": groups, "values": values}


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


def _is_json(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


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
        from pardsl.runtime import dcp

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


def _refuse(folder: str, message: str, remedy: str = ""):
    raise CheckpointError(f"{folder}: {message}; the checkpoint is refused, nothing was loaded"
                          + (f". {remedy}" if remedy else ""))


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


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _coverage_error(shape: tuple[int, ...], pieces: list[Piece]) -> str | None:
    """None where the pieces cover every element of `shape` exactly once, else what is wrong: on the grid
    their boundaries cut the tensor into, each cell must be inside exactly one piece."""
    if math.prod(shape) == 0:
        return None
    pieces = [p for p in pieces if math.prod(p.sizes) > 0]
    if sum(math.prod(p.sizes) for p in pieces) != math.prod(shape):
        return (f"its pieces hold {sum(math.prod(p.sizes) for p in pieces)} elements; the tensor has "
                f"{math.prod(shape)} (a piece dropped, cut short or written twice)")
    cuts = [sorted({0, size, *(p.offsets[d] for p in pieces), *(p.offsets[d] + p.sizes[d] for p in pieces)})
            for d, size in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > _MAX_GRID_CELLS:
        return "its pieces are cut too finely to check"
    count = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for piece in pieces:
        box = tuple(slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + n))
                    for c, o, n in zip(cuts, piece.offsets, piece.sizes))
        count[box] += 1
    if bool((count != 1).any()):
        return "its pieces overlap and leave elements uncovered"
    return None


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


def _find_name(names, saved, by_suffix: bool = True) -> str | None:
    """The name in `saved` (a checkpoint's tensor names) of a tensor the model knows by `names` (tied names
    included): exact first, then (`by_suffix`) with leading module names dropped (a wrapper's `model.`
    prefix over a Hugging Face checkpoint). Both formats' loaders match names by this one rule."""
    for name in names:
        if name in saved:
            return name
    if not by_suffix:
        return None
    for name in names:
        parts = name.split(".")
        for start in range(1, len(parts)):
            if ".".join(parts[start:]) in saved:
                return ".".join(parts[start:])
    return None


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
        from pardsl.runtime import dcp

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
        from pardsl.runtime import dcp

        return dcp.metadata_of(checkpoint, verify, allow_shared_folder)
    if not _is_pardsl(checkpoint):
        return None
    return CheckpointSource(checkpoint, verify, allow_shared_folder).document.get("metadata")


def _is_pardsl(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX_FILE))


def _is_dcp(path: str) -> bool:
    """A torch.distributed.checkpoint folder, known by its `.metadata` (and no pardsl index)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata")) and not _is_pardsl(path)


DCP_SIDECAR_FILE = "pardsl.dcp.json"  # beside a DCP folder's .metadata, where pardsl.save wrote it
# a DCP save's folder before it is renamed into place, and the one it replaces, while it is removed
_DCP_STAGING = re.compile(r"\.[0-9a-f]{16}\.(tmp|old)$")


def _checkpoints_in(folder: str) -> list[str]:
    """`folder` and those of its subfolders that hold a pardsl index, or a DCP folder pardsl saved (complete
    or not)."""
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return []
    return [c for c in [folder] + [os.path.join(folder, entry) for entry in entries]
            if _is_pardsl(c) or (os.path.isfile(os.path.join(c, DCP_SIDECAR_FILE)) and not _DCP_STAGING.search(c))]


def _document(candidate: str) -> str:
    """The JSON file that says when a checkpoint `_checkpoints_in` found was saved."""
    return os.path.join(candidate, INDEX_FILE if _is_pardsl(candidate) else DCP_SIDECAR_FILE)


def _save_counter(document: dict) -> int:
    counter = document.get("save_counter")
    return counter if _is_count(counter) else 0  # 0: saved by a pardsl before save counters


def _next_save_counter(path: str) -> int:
    """The counter of a save into `path`: one more than that of any save `latest_checkpoint` could weigh it
    against (in `path` and its subfolders, and beside it in its parent's), complete or not."""
    highest = 0
    for candidate in _checkpoints_in(os.path.dirname(os.path.abspath(path))) + _checkpoints_in(path):
        try:
            with open(_document(candidate), encoding="utf-8") as handle:
                document = json.load(handle)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(document, dict):
            highest = max(highest, _save_counter(document))
    return highest + 1


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
                from pardsl.runtime import dcp

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
        from pardsl.runtime import dcp

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
        from pardsl.runtime import dcp

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
