"""What both checkpoint formats share (pardsl's own, pardsl/runtime/checkpoint.py, and DCP's,
pardsl/runtime/dcp.py): the refusal of folders other users could change, files written under fresh names
and hashed, the regions a rank's layouts give it, save counters and name matching."""

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
from dataclasses import dataclass

import torch

from pardsl.layouts.algebra import Layout, Mesh, block_lengths, chunk_of_block, is_blocked


INDEX_FILE = "pardsl.index.json"

_MAX_GRID_CELLS = 1 << 24  # the coverage check's grid; a real layout's pieces make far fewer cells

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
    outermost first); a segment per block where it is split in blocks (the rank's chunk of every block,
    equal or not).
    """
    per_dim = []
    for dim, size in enumerate(shape):
        axes = layout.axes_splitting(dim)
        blocks = layout.block_spec_of(dim)
        if not axes:
            per_dim.append([(0, size, 0)])
        elif is_blocked(blocks):
            (axis,) = axes
            lengths, n = block_lengths(size, blocks), mesh.axis_sizes[axis]
            mirrored = dim in layout.mirrored_dims()
            per_dim.append([(sum(lengths[:j]) + chunk_of_block(j, coordinate[axis], n, mirrored) * (block // n),
                             block // n, sum(lengths[:j]) // n)
                            for j, block in enumerate(lengths)])
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

def _is_json(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False

def _refuse(folder: str, message: str, remedy: str = ""):
    raise CheckpointError(f"{folder}: {message}; the checkpoint is refused, nothing was loaded"
                          + (f". {remedy}" if remedy else ""))

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

def _is_pardsl(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX_FILE))

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
