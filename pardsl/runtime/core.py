"""What a generated module calls at run time: collectives as autograd functions, per mesh axis.

Each conversion of the catalogue (`layouts.CONVERSIONS`) is one `torch.autograd.Function` whose backward is its adjoint, over the
process group of one mesh axis (from `torch.distributed.device_mesh`). There is no per-op dispatch: the
generated forward calls ATen ops directly and these functions only where the layouts change.

The runtime counts every collective it issues, per phase (forward, backward), with the bytes each rank
sends, so tests and users can assert communication exactly.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pardsl.layouts.algebra import COLLECTIVE_KINDS, Layout, Mesh, block_major, collective_bytes, rank_major
from pardsl.runtime import kernels
from pardsl.runtime.parameter_sync import ParameterSync
from pardsl.runtime.shared_memory import shared_memory_group

PHASES = ("forward", "backward")


@dataclass
class CommCounter:
    counts: dict[str, Counter] = field(default_factory=lambda: {p: Counter() for p in PHASES})
    by_axis: dict[str, Counter] = field(default_factory=lambda: {p: Counter() for p in PHASES})
    bytes: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})

    progress: object = None  # where `pardsl run` records each collective for its watchdog (advance(what))

    def record(self, phase: str, kind: str, nbytes: int, axis: str) -> None:
        if self.progress is not None:
            self.progress.advance(f"{phase} {kind} over {axis}")
        self.counts[phase][kind] += 1
        self.by_axis[phase][(axis, kind)] += 1
        self.bytes[phase] += nbytes

    def reset(self) -> None:
        for phase in PHASES:
            self.counts[phase].clear()
            self.by_axis[phase].clear()
            self.bytes[phase] = 0

    def summary(self) -> dict:
        sends = {p: self.counts[p]["send"] for p in PHASES}
        return {
            "collectives": {p: {k: self.counts[p][k] for k in COLLECTIVE_KINDS} for p in PHASES},
            **({"sends": sends} if any(sends.values()) else {}),  # a pipeline's point-to-point sends
            "collectives_by_axis": {p: {f"{axis}:{kind}": n for (axis, kind), n in sorted(self.by_axis[p].items())}
                                    for p in PHASES},
            "bytes": dict(self.bytes),
        }


_MESH_CACHE: dict[tuple, object] = {}


def _device_mesh(mesh: Mesh, device_type: str):
    """One DeviceMesh per mesh shape and process (creating groups is collective; reuse them)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (mesh.axis_names, mesh.axis_sizes, device_type, id(dist.distributed_c10d._get_default_group()))
    if key not in _MESH_CACHE:
        _MESH_CACHE[key] = init_device_mesh(device_type, mesh.axis_sizes, mesh_dim_names=mesh.axis_names)
    return _MESH_CACHE[key]


def collectives_by_all_to_all(backend: str) -> bool:
    """Whether this backend's reduce-scatters, all-gathers (over more than two ranks, small ones) and
    all-reduces over two ranks are built on its all-to-all (reduce_scatter_started, all_gather_started,
    all_reduce_started): gloo's own are slower (`python benchmarks/collectives.py`)."""
    return backend == "gloo"


# The largest tensor (bytes per rank) all-gathered over more than two ranks by an all-to-all: above it the n
# copies it sends cost more than the exchange saves, and gloo's own is as fast (benchmarks/collectives.py)
EXCHANGE_MAX_BYTES = 1 << 20


def _exchange_started(received: torch.Tensor, sent: torch.Tensor, group):
    """Over a group of two ranks: send `sent` (contiguous, flat) to the other rank and nothing to this one,
    receiving the other's into `received`, as one all-to-all (gloo's exchange without a send buffer): the
    work to wait on."""
    to_each = [0, sent.numel()] if dist.get_rank(group) == 0 else [sent.numel(), 0]
    return dist.all_to_all_single(received, sent, to_each, to_each, group=group, async_op=True)


def all_reduce_started(x: torch.Tensor, n: int, group, by_all_to_all: bool, overwrite: bool = True,
                       shared=None):
    """Start summing x (contiguous) over the n ranks of `group`: (the work to wait on, a function giving the
    sum once it has finished). `overwrite`: the backend's all-reduce may sum into x itself (else into a
    copy; the exchange below never writes x).

    `by_all_to_all`: gloo's all-reduce is a ring, two dependent steps on two ranks, each a wake-up of gloo's
    threads on both. As one all-to-all, each of two ranks sends the other its whole tensor and nothing to
    itself (the ring's bytes on two ranks, from x itself: no send buffer) and adds its own into the buffer
    the other's arrived in: no tensor allocated for the sum, and x0 + x1, the ring's sum, bit for bit (a
    floating-point sum of two is the same either way round). Faster than the ring up to 4 MiB and as fast
    at 16 MiB (benchmarks/collectives.py); over more ranks it would move more bytes.

    `shared`: the group's shared-memory transport (pardsl/runtime/shared_memory.py), where its ranks share this
    host: faster than either, for CPU tensors."""
    if shared is not None and x.device.type == "cpu":
        return shared.all_reduce_started(x, overwrite)
    if by_all_to_all and n == 2:
        flat = x.view(-1)
        received = torch.empty_like(flat)
        work = _exchange_started(received, flat, group)
        return work, lambda: received.add_(flat).view(x.shape)
    if not overwrite:
        x = x.clone()
    work = dist.all_reduce(x, group=group, async_op=True)
    return work, lambda: x


def all_gather_started(out: torch.Tensor, x: torch.Tensor, n: int, group, by_all_to_all: bool, shared=None):
    """Start gathering x (contiguous) from the n ranks of `group` into `out` (n times x's size, rank r's at
    chunk r of dim 0): the work to wait on.

    `by_all_to_all`: over two ranks, each sends x itself to the other and receives the other's straight into
    its place in `out` (one exchange of the ring's bytes, no send buffer; faster than gloo's at every size
    measured, 32 KiB to 4 MiB). Over more, up to EXCHANGE_MAX_BYTES, every rank sends its x to each other
    rank in one all-to-all of n copies of it: a ring all-gather's bytes in one step instead of n − 1 (a
    sequence-parallel step on two gloo ranks here took 66 ms with gloo's own, 60 with this); the copies are
    a local write of n times x. `shared`: as all_reduce_started's."""
    if shared is not None and x.device.type == "cpu":
        return shared.all_gather_started(out, x)
    if by_all_to_all and n == 2:
        rows, flat = out.view(2, -1), x.view(-1)
        mine = dist.get_rank(group)
        work = _exchange_started(rows[1 - mine], flat, group)
        rows[mine].copy_(flat)
        return work
    if by_all_to_all and _nbytes(x) <= EXCHANGE_MAX_BYTES:
        copies = x.expand(n, *x.shape).contiguous().view(out.shape)
        return dist.all_to_all_single(out, copies, group=group, async_op=True)
    return dist.all_gather_single(out, x, group=group, async_op=True)


def reduce_scatter_started(moved: torch.Tensor, n: int, group, by_all_to_all: bool, shared=None):
    """Start summing `moved` over the n ranks of `group`, each rank keeping its chunk of dim 0 (moved is
    contiguous, chunk r of dim 0 is rank r's): (the work to wait on, a function giving this rank's sum
    once it has finished).

    `by_all_to_all`: gloo's reduce-scatter all-reduces the whole input and copies this rank's chunk out,
    twice a ring reduce-scatter's bytes and as slow as an all-reduce (2 to 8 times slower than an
    all-to-all of the same input on 2 and 4 CPU ranks). An all-to-all hands every rank the n
    contributions to its chunk, the ring's per-rank volume, and the rank sums them in rank order. Over two
    ranks each sends the other only the other's chunk, and adds its own into what it received. `shared`:
    as all_reduce_started's."""
    if shared is not None and moved.device.type == "cpu":
        return shared.reduce_scatter_started(moved)
    if by_all_to_all and n == 2:
        rows = moved.view(2, -1)
        mine = dist.get_rank(group)
        received = torch.empty_like(rows[mine])
        work = _exchange_started(received, rows[1 - mine], group)
        shape = (moved.shape[0] // 2, *moved.shape[1:])
        return work, lambda: received.add_(rows[mine]).view(shape)
    if by_all_to_all:
        received = torch.empty_like(moved)
        work = dist.all_to_all_single(received, moved, group=group, async_op=True)
        return work, lambda: received.view(n, moved.shape[0] // n, *moved.shape[1:]).sum(0)
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    work = dist.reduce_scatter_single(out, moved, group=group, async_op=True)
    return work, lambda: out


class Runtime:
    """The mesh of one rank: its coordinates, the process group of each axis, and the collectives."""

    def __init__(self, mesh: Mesh, device: torch.device | str | None = None):
        self.mesh = mesh
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.counter = CommCounter()
        self.groups: dict[str, object] = {}
        self.coordinate: dict[str, int] = {name: 0 for name in mesh.axis_names}
        self.size = dict(zip(mesh.axis_names, mesh.axis_sizes))
        self.by_all_to_all = False  # collectives_by_all_to_all
        self.shared: dict[str, object] = {}  # per axis, its shared-memory transport where it has one
        if mesh.size > 1 or (dist.is_available() and dist.is_initialized()):
            if not dist.is_initialized():
                raise RuntimeError(f"a mesh of {mesh.size} ranks needs torch.distributed to be initialized")
            if dist.get_world_size() != mesh.size:
                raise RuntimeError(f"the mesh ({mesh}) has {mesh.size} ranks but the world has "
                                   f"{dist.get_world_size()}")
            device_mesh = _device_mesh(mesh, self.device.type)
            for name in mesh.axis_names:
                self.groups[name] = device_mesh.get_group(name)
                self.coordinate[name] = device_mesh.get_local_rank(name)
            self.by_all_to_all = collectives_by_all_to_all(dist.get_backend())
            self.shared = {name: shared_memory_group(self.groups[name]) for name in mesh.axis_names if self.size[name] > 1}

    @staticmethod
    def require_divisible(size: int, ways: int, dim: str) -> None:
        """A named dim's size at run time must split as the plan splits it."""
        if size % ways:
            raise ValueError(f"dim `{dim}` has size {size} at run time; the plan splits it {ways} ways, "
                             f"which needs a multiple of {ways}")

    def parameter_sync(self, module, gathers: list[tuple], buckets: list[tuple]):
        """What one forward of a generated module gathers its stored-split parameters and buckets its
        parameters' gradients with (pardsl/runtime/parameter_sync.py)."""
        return ParameterSync(self, module, gathers, buckets)

    # -- collectives the generated code calls ---------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        return _AllReduce.apply(x, self, axis)

    def all_gather(self, x: torch.Tensor, axis: str, dim: int, backward: str = "slice", blocks: int = 1) -> torch.Tensor:
        return _AllGather.apply(x, self, axis, dim, backward, blocks)

    def reduce_scatter(self, x: torch.Tensor, axis: str, dim: int, blocks: int = 1) -> torch.Tensor:
        return _ReduceScatter.apply(x, self, axis, dim, blocks)

    def all_to_all(self, x: torch.Tensor, axis: str, split_dim: int, concat_dim: int) -> torch.Tensor:
        return _AllToAll.apply(x, self, axis, split_dim, concat_dim)

    def split(self, x: torch.Tensor, axis: str, dim: int, blocks: int = 1) -> torch.Tensor:
        return _Split.apply(x, self, axis, dim, blocks)

    def dropout(self, x: torch.Tensor, p: float, train: bool, splits: tuple[tuple[str, int, int], ...]) -> torch.Tensor:
        """Dropout with serial's mask, whatever x's layout: the whole tensor's mask is drawn by the op serial
        calls, on ones of the whole shape, dtype and device (so the generator advances as serial's does,
        and each rank draws the same), and this rank keeps its part: its chunk along each (axis, dim,
        blocks) of `splits`, x's S placements in mesh order (B and P hold all of it, a partial sum's every
        part scaled alike)."""
        if not train or p == 0:
            return torch.ops.aten.dropout.default(x, p, train)
        shape = list(x.shape)
        for axis, dim, _ in splits:
            shape[dim] *= self.size[axis]
        scaled_mask = torch.ops.aten.dropout.default(torch.ones(shape, dtype=x.dtype, device=x.device), p, True)
        for axis, dim, blocks in splits:
            scaled_mask = self._slice(scaled_mask, axis, dim, blocks)
        return x * scaled_mask

    def to_partial(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        return _ToPartial.apply(x, self, axis)

    def grad_all_reduce(self, x: torch.Tensor, *axes: str) -> torch.Tensor:
        return _GradAllReduce.apply(x, self, axes)

    def column_parallel_linears(self, x: torch.Tensor, axes: tuple[str, ...], *linears, gather_dim: int | None = None,
                                blocks: int = 1, op: str = "linear") -> tuple[torch.Tensor, ...]:
        """Megatron's f and the linears that read its value, as one step: `linears` are (weight, bias or
        None) pairs, the results are each linear of x. Backward computes x's gradient first, issues its
        all-reduce over `axes` and computes the weights' gradients while it moves (Megatron's overlap).

        With `gather_dim` (Megatron-SP's g), x is split on that dim over the one axis and all-gathered
        first; backward reduce-scatters its gradient instead, overlapped the same way.

        `op`: the ATen op each linear is, as the serial model computes it (`PROJECTIONS`): `linear` (weight
        [out, in]), or `addmm`, `mm`, `matmul` (weight [in, out]: GPT-2's Conv1D, `x @ W`)."""
        return _ColumnParallelLinears.apply(x, self, axes, (gather_dim, blocks, PROJECTIONS[op]),
                                            *(t for pair in linears for t in pair))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        """weight · (x · rsqrt(mean(x², -1) + eps)).to(dtype): a model's RMSNorm, its seven ATen ops as one,
        with a backward in closed form (pardsl/passes/fused_norms.py). Local: x's last dim is whole on this rank.
        `dtype`: what the normalised x is cast to before the weight (a half-precision model's, its norm
        computed in float32); None: x's."""
        return _RMSNorm.apply(x, weight, eps, dtype or x.dtype)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x·cos + rotate_half(x)·sin, rotate_half(x) = cat(−x₂, x₁) of x's halves along the last dim: a
        model's rotary position embedding, its seven ATen ops as one, with the chain's bits forward and
        backward (pardsl/passes/fused_rotary.py). Local: x's last dim is whole on this rank."""
        return _Rotary.apply(x, cos, sin)

    def masked_embedding(self, weight: torch.Tensor, ids: torch.Tensor, *axes: str) -> torch.Tensor:
        """Embedding with the vocabulary split over `axes` (outermost first): rows for the ids this rank
        holds, zeros for the others, so the sum over ranks is the full lookup (a P result)."""
        rows = weight.shape[0] * math.prod(self.size[a] for a in axes)
        # serial's lookup fails on an id outside the table; the masked one would return a zero row for it
        # (no rank holds it). The check is on the ids (small), and asynchronous on CUDA.
        torch._assert_async(((ids >= 0) & (ids < rows)).all(), f"an id is outside the embedding table of {rows} rows")
        start = self._chunk(axes) * weight.shape[0]
        local = ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        rows = torch.ops.aten.embedding.default(weight, local.masked_fill(outside, 0))
        return rows.masked_fill(outside.unsqueeze(-1), 0.0)

    # -- parallel forms of ops: the op's own arguments, and per form the axes it is taken on ------------

    def count_targets_started(self, target: torch.Tensor, ignore_index: int, axis: str):
        """Start the all-reduce over `axis` of the count of targets that are not `ignore_index`, for a
        partial mean loss (`cross_entropy(..., counts=(axis,), count_started=...)`) to wait on: the count needs
        only the targets, so it is started as soon as they are known and is long done when the loss needs it
        (pardsl/passes/early_count.py)."""
        return self._all_reduce_started(_targets_counted(target, ignore_index), axis, "forward")

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor, weight=None, reduction: int = 1,
                      ignore_index: int = -100, label_smoothing: float = 0.0, *, classes: tuple[str, ...] = (),
                      counts: tuple[str, ...] = (), mean: tuple[str, ...] = (), count_started=None) -> torch.Tensor:
        """aten.cross_entropy_loss (no class weight) of logits whose class dim (1) is split over `classes`,
        and whose rows (reduction mean) are split over `counts`.

        Classes: per axis, one all-gather of a few values per row from each rank: its max, its sum of exps
        below that max, the target's logit (held by one rank) and, with label smoothing, its logit sum
        (_ClassSplitCrossEntropy). Backward is local: each rank's classes' softmax minus one-hot.
        Counts: the mean is the local sum over the global count of counted targets, a partial sum (P).
        Mean: the mean itself (B), the local sum and count all-reduced together, one all-reduce per axis;
        its backward is the identity's, so each rank's rows get the gradient over the global count.
        Count started: the all-reduce of the count over counts[0], started earlier (count_targets_started).
        """
        assert weight is None, "a class weight has no parallel form"
        assert not (mean and counts), "a mean is whole over every axis its rows are split on, or partial over all"
        count, work = None, None
        if reduction == 1 and count_started is not None:
            work, summed = count_started
        elif reduction == 1 and not mean:  # the count needs only the targets: its all-reduce runs under the losses
            if counts:
                work, summed = self.count_targets_started(target, ignore_index, counts[0])
            else:
                count = _targets_counted(target, ignore_index)
        if classes:
            losses = _ClassSplitCrossEntropy.apply(logits, target, ignore_index, label_smoothing, self, classes)
        else:
            losses = torch.ops.aten.cross_entropy_loss.default(logits, target, None, 0, ignore_index, label_smoothing)
        if reduction == 0:
            return losses
        if reduction == 2:
            return losses.sum()
        if mean:
            wide = torch.promote_types(losses.dtype, torch.float32)
            pair = torch.cat([losses.sum().to(wide).reshape(1), _targets_counted(target, ignore_index, wide)])
            for axis in mean:
                pair = self.all_reduce(pair, axis)
            return (pair[0] / pair[1]).to(losses.dtype)
        if work is not None:
            work.wait()
            count = summed()
        for axis in counts[1:]:
            count = self._all_reduce(count, axis, "forward")
        return losses.sum() / count.reshape(()).to(losses.dtype)

    def batch_norm(self, x: torch.Tensor, weight, bias, running_mean, running_var, training: bool, momentum: float,
                   eps: float, cudnn_enabled: bool = True, *, batch: tuple[str, ...] = ()) -> torch.Tensor:
        """aten.batch_norm of x whose batch (dim 0) is split over `batch`, in training: the statistics are
        those of the whole batch, as SyncBatchNorm computes them. Forward: one all-reduce per axis of each
        channel's sum and centered sum of squares and the count (float64: the variance is their
        difference); backward: one of the sums of the gradient and of the gradient times x̂. The running
        statistics are updated with the global ones, as serial updates its own."""
        if not (batch and training):
            return torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var, training,
                                                     momentum, eps, cudnn_enabled)
        return _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, self, batch)

    def layer_norm(self, x: torch.Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5,
                   cudnn_enable: bool = True, *, features: tuple[str, ...] = ()) -> torch.Tensor:
        """aten.layer_norm of x whose normalised (last) dim is split over `features`, weight and bias
        alike (Optimus's and Tesseract's distributed LayerNorm): each row's statistics are summed over the
        ranks holding its parts. Forward: one all-reduce per axis of each row's sum and sum of squares
        (float64: the variance is their difference); backward: one of the two sums the input's gradient
        needs. The weight's and bias's gradients are this rank's own columns."""
        if not features:
            return torch.ops.aten.layer_norm.default(x, normalized_shape, weight, bias, eps, cudnn_enable)
        return _SplitLayerNorm.apply(x, weight, bias, eps, self, features)

    def _chunk(self, axes: tuple[str, ...]) -> int:
        """This rank's chunk index of a dim split over `axes`, outermost first."""
        chunk = 0
        for axis in axes:
            chunk = chunk * self.size[axis] + self.coordinate[axis]
        return chunk

    # -- the primitives, counted ----------------------------------------------------------------------

    def _all_reduce(self, x: torch.Tensor, axis: str, phase: str) -> torch.Tensor:
        if self.size[axis] == 1:
            return x
        work, summed = self._all_reduce_started(x.contiguous(), axis, phase, overwrite=False)
        work.wait()
        return summed()

    def _all_reduce_started(self, x: torch.Tensor, axis: str, phase: str, overwrite: bool = True):
        """Sum x (contiguous) over `axis`, asynchronously: (work or None, a function giving the sum once
        waited on). `overwrite`: the backend may sum into x itself."""
        n = self.size[axis]
        if n == 1:
            return None, lambda: x
        self.counter.record(phase, "all_reduce", collective_bytes("all_reduce", _nbytes(x), n), axis)
        return self.all_reduce_started(x, axis, overwrite)

    def all_reduce_started(self, x: torch.Tensor, axis: str, overwrite: bool = True):
        """Start an all-reduce of x (contiguous) over `axis`, the way this backend does it fastest: (work,
        a function giving the sum once waited on). `overwrite`: the backend may sum into x itself."""
        return all_reduce_started(x, self.size[axis], self.groups[axis], self.by_all_to_all, overwrite,
                                  self.shared.get(axis))

    def collective_input(self, axis: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An empty tensor of `like`'s dtype and device, for the input of a collective over `axis` to be
        written into (a bucket of gradients): where the axis has a shared-memory transport, memory the peers
        read it from, so that the collective started on it whole need not copy it there first."""
        if (shared := self._shared_for(axis, like)) is not None:
            return shared.lend(shape, like.dtype)
        return like.new_empty(shape)

    def _shared_for(self, axis: str, x: torch.Tensor):
        """The axis's shared-memory transport where it has one and x is a CPU tensor, else None."""
        return self.shared.get(axis) if x.device.type == "cpu" else None

    def _reduce_scatter_started(self, x: torch.Tensor, axis: str, dim: int, phase: str, blocks: int = 1):
        """Reduce-scatter x asynchronously: (work or None, a function giving the result once waited on)."""
        n = self.size[axis]
        if n == 1:
            return None, lambda: x
        self.counter.record(phase, "reduce_scatter", collective_bytes("reduce_scatter", _nbytes(x), n), axis)
        if (shared := self._shared_for(axis, x)) is not None:
            return shared.reduce_scatter_along(x, dim, blocks)
        moved = rank_major(x.movedim(dim, 0), n, blocks).contiguous()
        work, summed = self.reduce_scatter_started(moved, axis)
        return work, lambda: summed().movedim(0, dim).contiguous()

    def reduce_scatter_started(self, moved: torch.Tensor, axis: str):
        """Start a reduce-scatter of `moved` (contiguous, rank r's chunk first along dim 0 at r) over
        `axis`, the way this backend does it fastest: (work, a function giving the result once waited)."""
        return reduce_scatter_started(moved, self.size[axis], self.groups[axis], self.by_all_to_all,
                                      self.shared.get(axis))

    def all_gather_started(self, out: torch.Tensor, x: torch.Tensor, axis: str):
        """Start an all-gather of x (contiguous) over `axis` into `out`, the way this backend does it
        fastest: the work to wait on."""
        return all_gather_started(out, x, self.size[axis], self.groups[axis], self.by_all_to_all,
                                  self.shared.get(axis))

    def _all_gather(self, x: torch.Tensor, axis: str, dim: int, phase: str, blocks: int = 1) -> torch.Tensor:
        n = self.size[axis]
        if n == 1:
            return x
        self.counter.record(phase, "all_gather", collective_bytes("all_gather", _nbytes(x), n), axis)
        if (shared := self._shared_for(axis, x)) is not None:
            return shared.all_gather_along(x, dim, blocks)
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        self.all_gather_started(out, moved, axis).wait()
        # contiguous as the serial value was: the exported graph may `view` it (a copy only where dim > 0)
        return block_major(out, n, blocks).movedim(0, dim).contiguous()

    def _reduce_scatter(self, x: torch.Tensor, axis: str, dim: int, phase: str, blocks: int = 1) -> torch.Tensor:
        work, result = self._reduce_scatter_started(x, axis, dim, phase, blocks)
        if work is not None:
            work.wait()
        return result()

    def _all_to_all(self, x: torch.Tensor, axis: str, split_dim: int, concat_dim: int, phase: str) -> torch.Tensor:
        n = self.size[axis]
        if n == 1:
            return x
        send = torch.stack(x.chunk(n, dim=split_dim)).contiguous()
        received = torch.empty_like(send)
        self.counter.record(phase, "all_to_all", collective_bytes("all_to_all", _nbytes(x), n), axis)
        if (shared := self._shared_for(axis, x)) is not None:
            shared.all_to_all(received, send)
        else:
            dist.all_to_all_single(received, send, group=self.groups[axis])
        return torch.cat(received.unbind(0), dim=concat_dim)

    def _slice(self, x: torch.Tensor, axis: str, dim: int, blocks: int = 1) -> torch.Tensor:
        n, coordinate = self.size[axis], self.coordinate[axis]
        return torch.cat([block.chunk(n, dim=dim)[coordinate] for block in x.chunk(blocks, dim=dim)], dim=dim)

    # -- host side: shards of full tensors, and full tensors from shards -----------------------------

    def shard_micro_batched(self, full: torch.Tensor, layout: Layout | tuple[str, ...], microbatches: int) -> torch.Tensor:
        """This rank's local batch for a pipeline: each micro-batch's own shard, one after another. The
        schedule cuts the local batch into micro-batches along dim 0, so where the layout splits dim 0,
        the rows a rank holds of micro-batch k must be chunk k of what it is given (a shard of the whole
        batch would hand rank r rows of other micro-batches, mismatched with an input it holds whole)."""
        return torch.cat([self.shard(part, layout) for part in full.tensor_split(microbatches)])

    def shard(self, full: torch.Tensor, layout: Layout | tuple[str, ...]) -> torch.Tensor:
        """This rank's local value of a full tensor (B: all of it, S(d): its chunk, P: on coordinate 0)."""
        layout = layout if isinstance(layout, Layout) else Layout.from_key(layout)
        local = full
        for axis, placement in zip(self.mesh.axis_names, layout.placements):
            if placement.kind == "S":
                local = self._slice(local, axis, placement.dim, placement.blocks)
            elif placement.kind == "P" and self.coordinate[axis] != 0:
                local = torch.zeros_like(local)
        return local.contiguous()

    def unshard(self, local: torch.Tensor, layout: Layout | tuple[str, ...]) -> torch.Tensor:
        """The full tensor from every rank's local value; collective, and not counted."""
        layout = layout if isinstance(layout, Layout) else Layout.from_key(layout)
        full = local.detach()
        for axis_index in reversed(range(self.mesh.ndim)):  # innermost axis first
            axis, placement = self.mesh.axis_names[axis_index], layout.placements[axis_index]
            if self.size[axis] == 1:
                continue
            if placement.kind == "P":
                full = full.contiguous().clone()
                dist.all_reduce(full, group=self.groups[axis])
            elif placement.kind == "S":
                parts = [torch.empty_like(full) for _ in range(self.size[axis])]
                dist.all_gather(parts, full.contiguous(), group=self.groups[axis])
                k, d = placement.blocks, placement.dim
                full = torch.cat([torch.cat([p.chunk(k, dim=d)[j] for p in parts], dim=d) for j in range(k)], dim=d)
        return full


def _targets_counted(target: torch.Tensor, ignore_index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """How many targets a mean loss divides by, shape [1], in float32 at least (oprules: the `counts` and
    `mean` forms' collectives): exact up to 2^24 targets, where a half-precision count is only up to 256."""
    return (target != ignore_index).sum().to(dtype).reshape(1)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class _AllReduce(torch.autograd.Function):
    """P → B. Backward: identity (the gradient of a P value is the full gradient)."""

    @staticmethod
    def forward(ctx, x, rt, axis):
        return rt._all_reduce(x, axis, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _AllGather(torch.autograd.Function):
    """S(d) → B. Backward: take this rank's slice of the full gradient, or reduce-scatter a partial one."""

    @staticmethod
    def forward(ctx, x, rt, axis, dim, backward, blocks):
        ctx.rt, ctx.axis, ctx.dim, ctx.mode, ctx.blocks = rt, axis, dim, backward, blocks
        return rt._all_gather(x, axis, dim, "forward", blocks)

    @staticmethod
    def backward(ctx, grad):
        if ctx.mode == "reduce_scatter":
            return ctx.rt._reduce_scatter(grad, ctx.axis, ctx.dim, "backward", ctx.blocks), None, None, None, None, None
        return ctx.rt._slice(grad, ctx.axis, ctx.dim, ctx.blocks), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """P → S(d). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, rt, axis, dim, blocks):
        ctx.rt, ctx.axis, ctx.dim, ctx.blocks = rt, axis, dim, blocks
        return rt._reduce_scatter(x, axis, dim, "forward", blocks)

    @staticmethod
    def backward(ctx, grad):
        return ctx.rt._all_gather(grad, ctx.axis, ctx.dim, "backward", ctx.blocks), None, None, None, None


class _AllToAll(torch.autograd.Function):
    """S(concat_dim) → S(split_dim). Backward: the all-to-all back."""

    @staticmethod
    def forward(ctx, x, rt, axis, split_dim, concat_dim):
        ctx.rt, ctx.axis, ctx.split_dim, ctx.concat_dim = rt, axis, split_dim, concat_dim
        return rt._all_to_all(x, axis, split_dim, concat_dim, "forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.rt._all_to_all(grad, ctx.axis, ctx.concat_dim, ctx.split_dim, "backward"), None, None, None, None


class _Split(torch.autograd.Function):
    """B → S(d): a local slice. Backward: all-gather, so the B value's gradient is full on every rank."""

    @staticmethod
    def forward(ctx, x, rt, axis, dim, blocks):
        ctx.rt, ctx.axis, ctx.dim, ctx.blocks = rt, axis, dim, blocks
        return rt._slice(x, axis, dim, blocks)

    @staticmethod
    def backward(ctx, grad):
        return ctx.rt._all_gather(grad.contiguous(), ctx.axis, ctx.dim, "backward", ctx.blocks), None, None, None, None


class _ToPartial(torch.autograd.Function):
    """B → P: the value on coordinate 0, zeros elsewhere. Backward: identity (P's gradient is full)."""

    @staticmethod
    def forward(ctx, x, rt, axis):
        return x.clone() if rt.coordinate[axis] == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GradAllReduce(torch.autograd.Function):
    """Megatron's f: identity forward; backward all-reduces the partial gradients of a B value."""

    @staticmethod
    def forward(ctx, x, rt, axes):
        ctx.rt, ctx.axes = rt, axes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for axis in ctx.axes:
            grad = ctx.rt._all_reduce(grad, axis, "backward")
        return grad, None, None


@dataclass(frozen=True)
class Projection:
    """A linear-like ATen op of an input and a parameter: how forward computes it, how its weight is
    stored ([in, out] or linear's [out, in]), which backward's matrix products follow, and where the op
    keeps its input, weight and bias among its operands (lowering.LINEAR_FORMS reads them)."""
    compute: object  # (x, weight, bias or None) -> result
    weight_in_out: bool
    input: int
    weight: int
    bias: int | None


# The ops a column-parallel step computes for its readers of one input: linear's weight is [out, in],
# the others' [in, out] (GPT-2's Conv1D is an addmm; `x @ W` an mm or matmul)
PROJECTIONS = {
    "linear": Projection(lambda x, w, b: torch.ops.aten.linear.default(x, w, b), False, 0, 1, 2),
    "addmm": Projection(lambda x, w, b: torch.ops.aten.addmm.default(b, x, w), True, 1, 2, 0),
    "mm": Projection(lambda x, w, b: torch.ops.aten.mm.default(x, w), True, 0, 1, None),
    "matmul": Projection(lambda x, w, b: torch.ops.aten.matmul.default(x, w), True, 0, 1, None),
}


class _ColumnParallelLinears(torch.autograd.Function):
    """f (or SP's g), then linears of its value. Backward: the input's gradient (summed over the linears)
    first, its all-reduce (or reduce-scatter) issued asynchronously, the weights' and biases' gradients
    computed meanwhile, then waited on."""

    @staticmethod
    def forward(ctx, x, rt, axes, how, *weights_and_biases):
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        ctx.rt, ctx.axes, ctx.how, ctx.has_bias = rt, axes, how, [b is not None for b in biases]
        gather_dim, blocks, projection = how
        if gather_dim is not None:
            x = rt._all_gather(x, axes[0], gather_dim, "forward", blocks)
        ctx.save_for_backward(x, *weights)
        return tuple(projection.compute(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        rt = ctx.rt
        gather_dim, blocks, projection = ctx.how
        grad_x, work, result = None, None, None
        products = [(grad.reshape(-1, grad.shape[-1]), weight.t() if projection.weight_in_out else weight)
                    for grad, weight in zip(grads, weights) if grad is not None]
        if ctx.needs_input_grad[0] and products:
            # summed by the products themselves (addmm's beta = 1), straight into memory the collective's
            # peers read: no separate adds, and no copy when the collective starts
            grad_x = rt.collective_input(ctx.axes[0], x.shape, like=x)
            rows_of_grad_x = grad_x.view(-1, x.shape[-1])
            torch.mm(*products[0], out=rows_of_grad_x)
            for grad_rows, factor in products[1:]:
                rows_of_grad_x.addmm_(grad_rows, factor)
            if gather_dim is not None:
                work, result = rt._reduce_scatter_started(grad_x, ctx.axes[0], gather_dim, "backward", blocks)
            else:
                work, result = rt._all_reduce_started(grad_x, ctx.axes[0], "backward")
        rows = x.reshape(-1, x.shape[-1])
        parameter_grads = []
        for index, (grad, has_bias) in enumerate(zip(grads, ctx.has_bias)):
            grad_w = grad_b = None
            if grad is not None:
                grad_rows = grad.reshape(-1, grad.shape[-1])
                if ctx.needs_input_grad[4 + 2 * index]:
                    grad_w = rows.t().matmul(grad_rows) if projection.weight_in_out else grad_rows.t().matmul(rows)
                if has_bias and ctx.needs_input_grad[5 + 2 * index]:
                    grad_b = grad_rows.sum(0)
            parameter_grads += [grad_w, grad_b]
        if work is not None:
            work.wait()
        if result is not None:
            grad_x = result()
        for axis in ctx.axes[1:]:
            if grad_x is not None:
                grad_x = rt._all_reduce(grad_x, axis, "backward")
        return (grad_x, None, None, None, *parameter_grads)


class _RMSNorm(torch.autograd.Function):
    """On a CPU, in float32 or float64 with no cast: numba's fused kernels (pardsl/runtime/kernels.py), one pass per
    row each way; they keep x and r. Otherwise the ops the model's chain runs forward (pow, mean, add,
    rsqrt, mul, to, mul), so the same bits, keeping n = x·r and r; backward, the weight's gradient
    Σ g·n.to(dtype) over every dim but the last, and, with m = (g·w) in x's dtype, x's r·(m − n·mean(m·n)):
    what autograd's ops through the chain add up to (the weight's the same ops, so the same bits)."""

    @staticmethod
    def forward(ctx, x, weight, eps, dtype):
        ctx.dtype = dtype
        ctx.fused = kernels.rms_norm_fits(x, weight, dtype)
        if ctx.fused:
            out, rows, r = kernels.rms_norm_forward(x, weight, eps)
            ctx.save_for_backward(rows, r, weight)
            return out
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        normed = x * r
        ctx.save_for_backward(normed, r, weight)
        return weight * normed.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fused:
            rows, r, weight = ctx.saved_tensors
            grad_x, grad_weight = kernels.rms_norm_backward(grad, rows, r, weight, ctx.needs_input_grad[1])
            return grad_x, grad_weight, None, None
        normed, r, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(ctx.dtype)).sum(tuple(range(grad.dim() - 1)))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = (grad * weight).to(normed.dtype)
            # addcmul_ takes n·mean(m·n) from m in the one pass, where sub_ would need the product made first
            grad_x = grad_normed.addcmul_(normed, (grad_normed * normed).mean(-1, keepdim=True), value=-1).mul_(r)
        return grad_x, grad_weight, None, None


class _Rotary(torch.autograd.Function):
    """Forward x·cos, then, of its halves along the last dim, x₂·sin₁ taken from the first and x₁·sin₂ added
    to the second: the chain's products and two-term sums (a − b is a + (−b) exactly), so its bits, with no
    cat. Backward, gx = g·cos with g₂·sin₂ added to its first half and g₁·sin₁ taken from its second: what
    autograd adds up through the chain's muls, cat, neg and slices (zero-filled parts add nothing)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        learned_tables = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        # constant tables on a CPU: numba's kernel (pardsl/runtime/kernels.py), one pass, the same bits
        ctx.kernel = not learned_tables and kernels.rotary_fits(x, cos, sin)
        if ctx.kernel:
            ctx.save_for_backward(None, cos, sin)
            return kernels.rotary_forward(x, cos, sin)
        h = x.shape[-1] // 2
        rotated = x * cos
        rotated[..., :h].sub_(x[..., h:] * _half(sin, 0, h))
        rotated[..., h:].add_(x[..., :h] * _half(sin, 1, h))
        # x only where a table needs a gradient: what the chain's muls keep
        ctx.save_for_backward(x if learned_tables else None, cos, sin)
        ctx.x_shape = x.shape  # smaller than the result's where x broadcasts against the tables
        return rotated

    @staticmethod
    def backward(ctx, grad):
        x, cos, sin = ctx.saved_tensors
        if ctx.kernel:
            return kernels.rotary_backward(grad, cos, sin) if ctx.needs_input_grad[0] else None, None, None
        h = grad.shape[-1] // 2
        grad_x = grad_cos = grad_sin = None
        if ctx.needs_input_grad[0]:
            grad_x = grad * cos
            grad_x[..., :h].add_(grad[..., h:] * _half(sin, 1, h))
            grad_x[..., h:].sub_(grad[..., :h] * _half(sin, 0, h))
            grad_x = grad_x.sum_to_size(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_cos = (grad * x).sum_to_size(cos.shape)
        if ctx.needs_input_grad[2]:
            grad_sin = (grad * torch.cat([-x[..., h:], x[..., :h]], -1)).sum_to_size(sin.shape)
        return grad_x, grad_cos, grad_sin


def _half(table: torch.Tensor, which: int, h: int) -> torch.Tensor:
    """Half `which` of a table along its last dim, or the table itself where that dim broadcasts (size 1)."""
    return table if table.shape[-1] == 1 else table[..., which * h:(which + 1) * h]


class _ClassSplitCrossEntropy(torch.autograd.Function):
    """Per row, the cross-entropy of logits whose class dim (1) is split over `axes` (Runtime.cross_entropy).

    A max and a sum of exps do not add up across ranks, so Megatron all-reduces the max first and the sums
    below it second. Here each rank sends its own (max m, sum of exps below m, target logit, logit sum) in
    one all-gather per axis, and every rank combines them alike: the max M of the m, and Σ s·exp(m − M).
    One latency instead of two, and on two ranks the same bytes. Statistics are kept in float32 at least.
    Backward needs no communication: softmax (saved in forward) minus the smoothed one-hot."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, rt, axes):
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        classes = wide.shape[1]
        local_target = target - rt._chunk(axes) * classes
        held = (local_target >= 0) & (local_target < classes)
        index = local_target.clamp(0, classes - 1).unsqueeze(1)
        local_max = wide.amax(dim=1)
        exps = (wide - local_max.unsqueeze(1)).exp()
        stats = [local_max, exps.sum(dim=1), wide.gather(1, index).squeeze(1).masked_fill(~held, 0.0)]
        if label_smoothing:
            stats.append(wide.sum(dim=1))
        stats = torch.stack(stats)
        for axis in axes:
            every = rt._all_gather(stats.unsqueeze(0), axis, 0, "forward")  # [ranks, statistic, rows...]
            top = every[:, 0].amax(dim=0)
            total = (every[:, 1] * (every[:, 0] - top).exp()).sum(dim=0)
            stats = torch.cat([torch.stack([top, total]), every[:, 2:].sum(dim=0)])
        top, total = stats[0], stats[1]
        all_classes = classes * math.prod(rt.size[a] for a in axes)
        losses = total.log() + top - (1.0 - label_smoothing) * stats[2]
        if label_smoothing:
            losses = losses - label_smoothing * stats[3] / all_classes
        ignored = target == ignore_index
        softmax = exps.mul_(((local_max - top).exp() / total).unsqueeze(1))
        ctx.save_for_backward(softmax, index, held, ignored)
        ctx.smoothing, ctx.all_classes, ctx.dtype = label_smoothing, all_classes, logits.dtype
        return losses.masked_fill(ignored, 0.0).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, index, held, ignored = ctx.saved_tensors
        grad_logits = softmax - ctx.smoothing / ctx.all_classes if ctx.smoothing else softmax.clone()
        grad_logits.scatter_add_(1, index, held.unsqueeze(1).to(softmax.dtype) * -(1.0 - ctx.smoothing))
        grad_logits.mul_(grad.to(softmax.dtype).masked_fill(ignored, 0.0).unsqueeze(1))
        return grad_logits.to(ctx.dtype), None, None, None, None, None


class _SyncBatchNorm(torch.autograd.Function):
    """Batch norm over a batch split across ranks (Runtime.batch_norm). The weight's and bias's gradients
    are this rank's share (the plan all-reduces them, as every B parameter read by split data)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, rt, axes):
        reduced = [0, *range(2, x.dim())]
        per_channel = (1, -1) + (1,) * (x.dim() - 2)
        count = x.numel() // x.shape[1]
        local_mean = x.mean(reduced)
        centered = (x - local_mean.view(per_channel)).square().sum(reduced)
        local_mean = local_mean.double()
        stats = torch.cat([local_mean * count, centered.double() + count * local_mean.square()])
        for axis in axes:
            stats = rt._all_reduce(stats, axis, "forward")
        # every rank holds as many rows (the plan splits the batch evenly): the total is known here, and
        # reading it back from the device would stall the host on CUDA
        channels, total = x.shape[1], float(count * math.prod(rt.size[axis] for axis in axes))
        mean = stats[:channels] / total
        variance = (stats[channels:2 * channels] / total - mean.square()).clamp_min(0.0)
        invstd = (variance + eps).rsqrt().to(x.dtype)
        xhat = (x - mean.to(x.dtype).view(per_channel)) * invstd.view(per_channel)
        y = xhat if weight is None else xhat * weight.view(per_channel)
        if bias is not None:
            y = y + bias.view(per_channel)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1.0 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:
                unbiased = variance * (total / max(total - 1.0, 1.0))
                running_var.mul_(1.0 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.rt, ctx.axes, ctx.total, ctx.reduced, ctx.per_channel = rt, axes, total, reduced, per_channel
        return y

    @staticmethod
    def backward(ctx, grad):
        xhat, weight, invstd = ctx.saved_tensors
        grad_bias = grad.sum(ctx.reduced)
        grad_weight = (grad * xhat).sum(ctx.reduced)
        grad_x = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([grad_bias, grad_weight])
            for axis in ctx.axes:
                sums = ctx.rt._all_reduce(sums, axis, "backward")
            channels = grad_bias.shape[0]
            mean_grad = (sums[:channels] / ctx.total).view(ctx.per_channel)
            mean_grad_xhat = (sums[channels:] / ctx.total).view(ctx.per_channel)
            scale = invstd if weight is None else invstd * weight
            grad_x = (grad - mean_grad - xhat * mean_grad_xhat) * scale.view(ctx.per_channel)
        return (grad_x, grad_weight if weight is not None else None, grad_bias if ctx.needs_input_grad[2] else None,
                None, None, None, None, None, None)


class _SplitLayerNorm(torch.autograd.Function):
    """Layer norm over a last dim split across ranks (Runtime.layer_norm). Half-precision inputs are
    normalised in float32 and the result cast back, as aten's layer norm accumulates."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rt, axes):
        wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        count = x.shape[-1] * math.prod(rt.size[a] for a in axes)
        local_mean = wide.mean(-1)
        centered = (wide - local_mean.unsqueeze(-1)).square().sum(-1)
        local_mean = local_mean.double()
        # this rank's sum and sum of squares per row, the latter from its centered one (less cancellation)
        stats = torch.stack([local_mean * x.shape[-1], centered.double() + x.shape[-1] * local_mean.square()])
        for axis in axes:
            stats = rt._all_reduce(stats, axis, "forward")
        mean = stats[0] / count
        variance = (stats[1] / count - mean.square()).clamp_min(0.0)
        rstd = (variance + eps).rsqrt().to(wide.dtype).unsqueeze(-1)
        xhat = (wide - mean.to(wide.dtype).unsqueeze(-1)) * rstd
        y = xhat if weight is None else xhat * weight.to(wide.dtype)
        if bias is not None:
            y = y + bias.to(wide.dtype)
        ctx.save_for_backward(xhat, weight, rstd)
        ctx.rt, ctx.axes, ctx.count, ctx.has_bias = rt, axes, count, bias is not None
        ctx.dtypes = (x.dtype, None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xhat, weight, rstd = ctx.saved_tensors
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad = grad.to(xhat.dtype)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_bias = grad_x = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (rows * xhat.reshape(rows.shape)).sum(0).to(weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0).to(bias_dtype)
        if ctx.needs_input_grad[0]:
            scaled = grad if weight is None else grad * weight.to(xhat.dtype)
            sums = torch.stack([scaled.sum(-1), (scaled * xhat).sum(-1)])
            for axis in ctx.axes:
                sums = ctx.rt._all_reduce(sums, axis, "backward")
            grad_x = (scaled - (sums[0] / ctx.count).unsqueeze(-1) - xhat * (sums[1] / ctx.count).unsqueeze(-1)) * rstd
            grad_x = grad_x.to(x_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None
