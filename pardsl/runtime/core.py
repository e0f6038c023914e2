"""What a generated module calls at run time (`rt`): the runtime of one rank on the mesh.

Each conversion of the catalogue is one autograd function whose backward is its adjoint
(`runtime/conversions.py`), over the process group of one mesh axis (from `torch.distributed.device_mesh`),
through the collectives of `runtime/collectives.py`; the parallel forms of ops are in
`runtime/parallel_ops.py`. There is no per-op dispatch: the generated forward calls ATen ops directly
and the runtime only where the layouts change.

The runtime counts every collective it issues, per phase (forward, backward), with the bytes each rank
sends, so tests and users can assert communication exactly.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pardsl.layouts.algebra import (
    COLLECTIVE_KINDS,
    Layout,
    Mesh,
    block_lengths,
    block_major,
    chunk_of_block,
    collective_bytes,
    halo_rows,
    per_dim,
    rank_major,
    transposed_halo_rows,
)
from pardsl.runtime.collectives import (
    all_gather_started,
    all_reduce_started,
    collectives_by_all_to_all,
    device_mesh,
    nbytes,
    reduce_scatter_started,
)
from pardsl.runtime import functional
from pardsl.runtime.conversions import AllGather, AllReduce, AllToAll, GradAllReduce, ReduceScatter, Split, ToPartial
from pardsl.runtime.parallel_ops import (
    PROJECTIONS,
    ClassSplitCrossEntropy,
    ColumnParallelLinears,
    KeptSplit,
    LinearOfGathered,
    RMSNorm,
    Rotary,
    SwiGLU,
    SplitLayerNorm,
    HaloExchange,
    AllGatherLinear,
    LinearReduceScatter,
    SyncBatchNorm,
    targets_counted,
)
from pardsl.runtime.experts import experts_exchanged, experts_local, grouped_mm
from pardsl.runtime.parameter_sync import ParameterSync
from pardsl.runtime.recompute import RegionRun, kept, made_once, recompute
from pardsl.runtime.ring_attention import RingAttention
from pardsl.runtime.shared_memory import shared_memory_group

PHASES = ("forward", "backward")


@dataclass
class CommCounter:
    counts: dict[str, Counter] = field(default_factory=lambda: {p: Counter() for p in PHASES})
    by_axis: dict[str, Counter] = field(default_factory=lambda: {p: Counter() for p in PHASES})
    bytes: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    routed_bytes: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})  # what the data decided
    routed: bool = False  # whether any collective's bytes were the data's to decide (a mixture's exchanges)

    progress: object = None  # where `pardsl run` records each collective for its watchdog (advance(what))

    def record(self, phase: str, kind: str, nbytes: int, axis: str, routed: bool = False) -> None:
        if self.progress is not None:
            self.progress.advance(f"{phase} {kind} over {axis}")
        self.counts[phase][kind] += 1
        self.by_axis[phase][(axis, kind)] += 1
        (self.routed_bytes if routed else self.bytes)[phase] += nbytes
        self.routed |= routed

    def reset(self) -> None:
        for phase in PHASES:
            self.counts[phase].clear()
            self.by_axis[phase].clear()
            self.bytes[phase] = 0
            self.routed_bytes[phase] = 0

    def summary(self) -> dict:
        sends = {p: self.counts[p]["send"] for p in PHASES}
        return {
            "collectives": {p: {k: self.counts[p][k] for k in COLLECTIVE_KINDS} for p in PHASES},
            **({"sends": sends} if any(sends.values()) else {}),  # a pipeline's point-to-point sends
            "collectives_by_axis": {p: {f"{axis}:{kind}": n for (axis, kind), n in sorted(self.by_axis[p].items())}
                                    for p in PHASES},
            "bytes": dict(self.bytes),
            **({"routed_bytes": dict(self.routed_bytes)} if self.routed else {}),
        }


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
        self.region: RegionRun | None = None  # the recomputed region running (runtime/recompute.py)
        self.group_names: dict[str, str] = {}  # per axis, its group's name, as functional collectives take it
        # where a compiled piece's collectives are logged while it runs on fake tensors (runtime/pieces.py)
        self.piece_log: list[tuple] | None = None
        if mesh.size > 1 or (dist.is_available() and dist.is_initialized()):
            if not dist.is_initialized():
                raise RuntimeError(f"a mesh of {mesh.size} ranks needs torch.distributed to be initialized")
            if dist.get_world_size() != mesh.size:
                raise RuntimeError(f"the mesh ({mesh}) has {mesh.size} ranks but the world has "
                                   f"{dist.get_world_size()}")
            groups = device_mesh(mesh, self.device.type)
            for name in mesh.axis_names:
                self.groups[name] = groups.get_group(name)
                self.group_names[name] = self.groups[name].group_name
                self.coordinate[name] = groups.get_local_rank(name)
            self.by_all_to_all = collectives_by_all_to_all(dist.get_backend())
            self.shared = {name: shared_memory_group(self.groups[name]) for name in mesh.axis_names if self.size[name] > 1}

    @staticmethod
    def require_divisible(size: int, ways: int, dim: str) -> None:
        """A named dim's size at run time must split as the plan splits it."""
        if size % ways:
            raise ValueError(f"dim `{dim}` has size {size} at run time; the plan splits it {ways} ways, "
                             f"which needs a multiple of {ways}")

    def recompute(self, region, policy: str, *arguments):
        """`region(*arguments)`, a submodule's statements, its activations made again in backward rather
        than kept (`policy`: "full" or "selective"; pardsl/runtime/recompute.py)."""
        return recompute(self, region, policy, *arguments)

    def kept(self, op, *args, **kwargs):
        """`op(*args, **kwargs)`, a statement of a selective region whose matrix products' results are kept
        for backward and given back when the region runs again (pardsl/runtime/recompute.py)."""
        return kept(self, op, *args, **kwargs)

    def made_once(self, op, *args):
        """`op(*args)`, a product in a selective region that backward needs nothing of: not kept, and a
        stand-in of its shape when the region runs again (pardsl/runtime/recompute.py)."""
        return made_once(self, op, *args)

    @staticmethod
    def made_from_constants(module, make, *buffers: torch.Tensor) -> tuple:
        """`make()`, what a pipeline stage builds from `buffers` and constants alone (a causal mask, rotary
        tables; pardsl/passes/shared_constants.py): made on the first micro-batch and kept on `module` for
        every later one, so one copy is what the attentions keep for backward; made again where a buffer
        has changed since (a checkpoint loaded into it in place moves its version on). Made as ordinary
        tensors without gradient whatever mode the forward runs in: made under inference mode, they could
        not be kept for a training step's backward."""
        # the buffers themselves (compared by identity: an id can be taken again by a later tensor), and
        # what a write or a move changes of each
        key = [(buffer._version, buffer.device, buffer.dtype) for buffer in buffers]
        cached = module.__dict__.get("_made_from_constants")
        if cached is not None and len(cached[0]) == len(buffers) and \
                all(old is new for old, new in zip(cached[0], buffers)) and cached[1] == key:
            return cached[2]
        with torch.inference_mode(False), torch.no_grad():
            made = make()
        module.__dict__["_made_from_constants"] = (tuple(buffers), key, made)
        return made

    @staticmethod
    @torch.no_grad()
    def write_parameter(parameter: torch.nn.Parameter, write) -> None:
        """`write(parameter)` (an in-place clamp the model makes through `.data`), made at the top of every
        forward (a pipeline stage's once per micro-batch): only where it changes a value. A write moves the
        parameter's version on, and forwards not yet run backward (the micro-batches in flight, or losses
        summed before one backward) keep the parameter, whose backward would then refuse it; serial's write
        through `.data` moves no version, and a write that changes nothing (the same clamp again) leaves it."""
        written = write(parameter.detach().clone())
        if not torch.allclose(written, parameter, rtol=0, atol=0, equal_nan=True):  # a NaN stays a NaN
            parameter.copy_(written)

    def parameter_sync(self, module, gathers: list[tuple], buckets: list[tuple], precision: tuple | None = None,
                       offload: str | None = None):
        """What one forward of a generated module gathers its stored-split parameters and buckets its
        parameters' gradients with (pardsl/runtime/parameter_sync.py); `precision`: the dtypes parameters
        are gathered and their gradients reduced in, under a mixed-precision policy; `offload`: what of
        the parameters lives in host memory ("optimizer" or "parameters")."""
        return ParameterSync(self, module, gathers, buckets, precision, offload)

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An offloaded parameter's master: in host memory, pinned where the device is a GPU (so copies to
        and from it run beside compute)."""
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.device.type == "cuda")

    @staticmethod
    def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x in `dtype` (a float32 master parameter in its compute dtype); backward casts its gradient back."""
        return x.to(dtype)

    # -- collectives the generated code calls ---------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        return AllReduce.apply(x, self, axis)

    def all_gather(self, x: torch.Tensor, axis: str, dim: int, backward: str = "slice", blocks: int = 1,
                   mirrored: bool = False) -> torch.Tensor:
        return AllGather.apply(x, self, axis, dim, backward, (blocks, mirrored))

    def reduce_scatter(self, x: torch.Tensor, axis: str, dim: int, blocks: int = 1,
                       mirrored: bool = False) -> torch.Tensor:
        return ReduceScatter.apply(x, self, axis, dim, (blocks, mirrored))

    def all_to_all(self, x: torch.Tensor, axis: str, split_dim: int, concat_dim: int) -> torch.Tensor:
        return AllToAll.apply(x, self, axis, split_dim, concat_dim)

    def split(self, x: torch.Tensor, axis: str, dim: int, blocks: int = 1, mirrored: bool = False) -> torch.Tensor:
        return Split.apply(x, self, axis, dim, (blocks, mirrored))

    def dropout(self, x: torch.Tensor, p: float, train: bool, splits: tuple[tuple, ...]) -> torch.Tensor:
        """Dropout with serial's mask, whatever x's layout: the whole tensor's mask is drawn by the op serial
        calls, on ones of the whole shape, dtype and device (so the generator advances as serial's does,
        and each rank draws the same), and this rank keeps its part: its chunk along each (axis, dim,
        blocks[, mirrored]) of `splits`, x's S placements in mesh order (B and P hold all of it, a partial
        sum's every part scaled alike)."""
        if not train or p == 0:
            return torch.ops.aten.dropout.default(x, p, train)
        shape = list(x.shape)
        for axis, dim, *_ in splits:
            shape[dim] *= self.size[axis]
        scaled_mask = torch.ops.aten.dropout.default(torch.ones(shape, dtype=x.dtype, device=x.device), p, True)
        for axis, dim, *arrangement in splits:
            scaled_mask = self._slice(scaled_mask, axis, dim, *arrangement)
        return x * scaled_mask

    def to_partial(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        return ToPartial.apply(x, self, axis)

    def grad_all_reduce(self, x: torch.Tensor, *axes: str) -> torch.Tensor:
        return GradAllReduce.apply(x, self, axes)

    def column_parallel_linears(self, x: torch.Tensor, axes: tuple[str, ...], *linears, gather_dim: int | None = None,
                                blocks: int = 1, mirrored: bool = False, op: str = "linear",
                                chunks: int = 1, regather: bool = False) -> tuple[torch.Tensor, ...]:
        """Megatron's f and the linears that read its value, as one step: `linears` are (weight, bias or
        None) pairs, the results are each linear of x. Backward computes x's gradient first, issues its
        all-reduce over `axes` and computes the weights' gradients while it moves (Megatron's overlap).

        With `gather_dim` (Megatron-SP's g), x is split on that dim over the one axis and all-gathered
        first; backward reduce-scatters its gradient instead, overlapped the same way.

        `op`: the ATen op each linear is, as the serial model computes it (`PROJECTIONS`): `linear` (weight
        [out, in]), or `addmm`, `mm`, `matmul` (weight [in, out]: GPT-2's Conv1D, `x @ W`).

        `chunks` > 1, with `gather_dim` (a collective matmul): x is gathered in that many pieces, cut along
        a dim that is neither `gather_dim` nor the last, and the linears of each piece are computed while
        the next piece's gather moves, so that the gather's time hides behind the products'. The result,
        backward and what is counted are the unchunked step's.

        `regather`, with `gather_dim` (Megatron-SP's own form): x is kept for backward as this rank's split,
        not gathered, and gathered again in backward, while the input's gradient is computed, for the
        weights' gradients: a rank holds 1/n of x until backward, for one all-gather more."""
        return ColumnParallelLinears.apply(x, self, axes, (gather_dim, (blocks, mirrored), PROJECTIONS[op], chunks,
                                                           regather and gather_dim is not None),
                                            *(t for pair in linears for t in pair))

    def kept_split(self, split: torch.Tensor, axis: str, dim: int, readers: int, blocks: int = 1,
                   mirrored: bool = False) -> KeptSplit:
        """The split of a value all-gathered along `dim` over `axis`, kept for the backward of its gathered
        copy's `readers` (linear_of_gathered) in place of the copy: the first to need it gathers it again."""
        return KeptSplit(split, self, axis, dim, (blocks, mirrored), readers)

    def linear_of_gathered(self, whole: torch.Tensor, weight: torch.Tensor, bias, kept: KeptSplit) -> torch.Tensor:
        """`aten.linear(whole, weight, bias)` where `whole` is an all-gather whose split `kept` holds: backward
        computes the weight's gradient from the whole gathered again, so the rank does not hold the whole
        from forward to backward (Megatron-SP's saved input)."""
        return LinearOfGathered.apply(whole, weight, bias, kept)

    def all_gather_linear(self, x: torch.Tensor, weight: torch.Tensor, axis: str, dim: int, blocks: int = 1,
                          mirrored: bool = False, op: str = "linear", chunks: int = 1):
        """Sequence parallelism's gather of x (split on `dim` over `axis`) and the first linear that reads
        it, as one step: (x gathered, the linear's result); the gathered x's other readers take it as they
        would the gather's. Backward reduce-scatters x's gradient, the weight's gradient computed while it
        moves. `chunks` > 1 (a collective matmul): gathered in that many pieces, cut along a dim that is
        neither `dim` nor the last, each piece's product computed while the next moves."""
        return AllGatherLinear.apply(x, weight, self, axis, dim, (blocks, mirrored), PROJECTIONS[op], chunks)

    def linear_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor, axis: str, dim: int, blocks: int = 1,
                              mirrored: bool = False, op: str = "linear", chunks: int = 1) -> torch.Tensor:
        """A row-parallel linear and the reduce-scatter of its partial sums, as one step:
        `reduce_scatter(<op of x and weight>, axis, dim, blocks, mirrored)`, x's last dim split over `axis`
        (so each rank's product is a partial sum); `op` as `column_parallel_linears`', with no bias.
        Backward all-gathers the output's gradient, then x's and the weight's gradients from it.

        `chunks` > 1 (a collective matmul): the product is made in that many pieces, cut along a dim that
        is neither `dim` nor the last, each piece's reduce-scatter started as soon as it is made and the
        next piece computed while it moves; backward gathers the gradient in pieces the same way, x's
        gradient of each piece computed while the next arrives. The result and what is counted are the
        unchunked step's."""
        return LinearReduceScatter.apply(x, weight, self, axis, dim, (blocks, mirrored), PROJECTIONS[op], chunks)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 dtype: torch.dtype | None = None, compute: torch.dtype | None = None) -> torch.Tensor:
        """weight · (x · rsqrt(mean(x², -1) + eps)).to(dtype): a model's RMSNorm, its seven ATen ops as one,
        with a backward in closed form (pardsl/passes/fused_norms.py). Local: x's last dim is whole on this rank.
        `dtype`: what the normalised x is cast to before the weight (a half-precision model's, its norm
        computed in float32); None: x's. `compute`: the dtype x is cast to first (the model's own cast,
        made here so that backward keeps x in its own dtype); None: x's."""
        return RMSNorm.apply(x, weight, eps, dtype or x.dtype, compute)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up, keeping gate and up alone for backward, silu(gate) made again there: a gated
        MLP's activation, with the ops' bits forward and backward (pardsl/passes/fused_swiglu.py)."""
        return SwiGLU.apply(gate, up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x·cos + rotate_half(x)·sin, rotate_half(x) = cat(−x₂, x₁) of x's halves along the last dim: a
        model's rotary position embedding, its seven ATen ops as one, with the chain's bits forward and
        backward (pardsl/passes/fused_rotary.py). Local: x's last dim is whole on this rank."""
        return Rotary.apply(x, cos, sin)

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
        return self._all_reduce_started(targets_counted(target, ignore_index), axis, "forward")

    def cross_entropy(self, logits: torch.Tensor, target: torch.Tensor, weight=None, reduction: int = 1,
                      ignore_index: int = -100, label_smoothing: float = 0.0, *, classes: tuple[str, ...] = (),
                      counts: tuple[str, ...] = (), mean: tuple[str, ...] = (), count_started=None) -> torch.Tensor:
        """aten.cross_entropy_loss (no class weight) of logits whose class dim (1) is split over `classes`,
        and whose rows (reduction mean) are split over `counts`.

        Classes: per axis, one all-gather of a few values per row from each rank: its max, its sum of exps
        below that max, the target's logit (held by one rank) and, with label smoothing, its logit sum
        (ClassSplitCrossEntropy). Backward is local: each rank's classes' softmax minus one-hot.
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
                count = targets_counted(target, ignore_index)
        if classes:
            losses = ClassSplitCrossEntropy.apply(logits, target, ignore_index, label_smoothing, self, classes)
        else:
            losses = torch.ops.aten.cross_entropy_loss.default(logits, target, None, 0, ignore_index, label_smoothing)
        if reduction == 0:
            return losses
        if reduction == 2:
            return losses.sum()
        if mean:
            wide = torch.promote_types(losses.dtype, torch.float32)
            pair = torch.cat([losses.sum().to(wide).reshape(1), targets_counted(target, ignore_index, wide)])
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
        return SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, self, batch)

    def layer_norm(self, x: torch.Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5,
                   cudnn_enable: bool = True, *, features: tuple[str, ...] = ()) -> torch.Tensor:
        """aten.layer_norm of x whose normalised (last) dim is split over `features`, weight and bias
        alike (Optimus's and Tesseract's distributed LayerNorm): each row's statistics are summed over the
        ranks holding its parts. Forward: one all-reduce per axis of each row's sum and sum of squares
        (float64: the variance is their difference); backward: one of the two sums the input's gradient
        needs. The weight's and bias's gradients are this rank's own columns."""
        if not features:
            return torch.ops.aten.layer_norm.default(x, normalized_shape, weight, bias, eps, cudnn_enable)
        return SplitLayerNorm.apply(x, weight, bias, eps, self, features)

    def experts(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                gate_up_bias, down: torch.Tensor, gate: str, transposed: bool, act: str, alpha: float, limit,
                expert_parallel: tuple[str, ...] = (), intermediate: tuple[str, ...] = ()) -> torch.Tensor:
        """pardsl::experts (runtime/experts.py) on this rank's shards: with the tokens and the experts split
        over `expert_parallel` axes, each pair sent to its expert's rank and back; the intermediate dim
        split over `intermediate` axes gives a partial sum with nothing to exchange."""
        if expert_parallel:
            return experts_exchanged(self, hidden, index, weights, gate_up, gate_up_bias, down, gate, transposed,
                                     act, alpha, limit, expert_parallel)
        return experts_local(hidden, index, weights, gate_up, gate_up_bias, down, gate, transposed, act, alpha, limit)

    def grouped_mm(self, rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """pardsl::grouped_mm (runtime/experts.py) on this rank's shards: the rows and the experts whole, the
        projection's features this rank's (a partial sum where they are its input's)."""
        return grouped_mm(rows, weight, ends)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                  ring: tuple[str, ...] = (), ring_zigzag: tuple[str, ...] = ()) -> torch.Tensor:
        """aten.scaled_dot_product_attention (no dropout: the rule requires none); with the sequence split
        over `ring` axes (queries, keys and values alike, a mask's query rows too), ring attention
        (runtime/ring_attention.py): the key/value chunks passed around; `ring_zigzag`: the sequence split
        zig-zag over that axis, which evens the ranks' work under a causal mask."""
        if not ring and not ring_zigzag:  # in a selective recomputed region, its result kept
            return kept(self, torch.ops.aten.scaled_dot_product_attention.default,
                        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return RingAttention.apply(q, k, v, attn_mask, bool(is_causal),
                                   scale if scale is not None else q.shape[-1] ** -0.5, self, ring or ring_zigzag,
                                   bool(ring_zigzag))

    def ring_shift(self, x: torch.Tensor, axes: tuple[str, ...], phase: str) -> torch.Tensor:
        """Send x to the next rank along a dim split over `axes` (a ring, in the split's order), and receive
        the previous rank's: one `send`, counted over the innermost axis."""
        return self.ring_shift_started(x, axes, phase)()

    def ring_shift_started(self, x: torch.Tensor, axes: tuple[str, ...], phase: str):
        """ring_shift, started: a function giving the previous rank's x once it has come. x is read while
        it travels: the caller does not write it before calling the function."""
        def issue(phase: str):
            previous, following = self._neighbour_ranks(axes)
            sent = x.contiguous()
            received = torch.empty_like(sent)
            self.counter.record(phase, "send", nbytes(sent), axes[-1])
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, following),
                                            dist.P2POp(dist.irecv, received, previous)])

            def arrived() -> torch.Tensor:
                for work in works:
                    work.wait()
                return received
            return works, arrived
        _, arrived = self._started(phase, issue)
        return arrived

    def conv_halo(self, x: torch.Tensor, weight, bias=None, stride=1, padding=0, dilation=1, groups=1,
                  **halos: tuple[str, ...]) -> torch.Tensor:
        """aten.conv{1,2,3}d of x split along spatial dims (`halo_<dim>=axes`): each rank's rows extended
        by the rows of its neighbours its windows read (HaloExchange; zeros past the image's edges, which
        are the convolution's own padding there), then convolved without padding along those dims."""
        k = weight.dim() - 2
        return self.convolution_halo(x, weight, bias, stride, padding, dilation, False, [0] * k, groups, **halos)

    def conv_transpose_halo(self, x: torch.Tensor, weight, bias=None, stride=1, padding=0, output_padding=0,
                            groups=1, dilation=1, **halos: tuple[str, ...]) -> torch.Tensor:
        """aten.conv_transpose{1,2,3}d of x split along spatial dims: see convolution_halo."""
        return self.convolution_halo(x, weight, bias, stride, padding, dilation, True, output_padding, groups, **halos)

    def convolution_halo(self, x: torch.Tensor, weight, bias, stride, padding, dilation, transposed, output_padding,
                         groups, **halos: tuple[str, ...]) -> torch.Tensor:
        """aten.convolution with spatial dims split (`halo_<dim>=axes`): see conv_halo. Transposed, each
        input row makes `stride` output rows: the rank's rows extended by the neighbours' rows whose
        contributions reach its own output rows, convolved without padding along those dims, and its own
        output rows taken from the result."""
        k = weight.dim() - 2
        stride, padding, dilation, output_padding = (per_dim(v, k) for v in (stride, padding, dilation, output_padding))
        rows = transposed_halo_rows if transposed else halo_rows
        x, extended = self._with_halos(x, halos, k, lambda j: rows(weight.shape[2 + j], stride[j], padding[j],
                                                                   dilation[j]), 0.0)
        taken = [(dim, before * stride[j] + padding[j], (x.shape[dim] - before - after) * stride[j])
                 for dim, j, before, after in extended]  # a transposed one's own output rows
        for _, j, _, _ in extended:
            padding[j] = output_padding[j] = 0
        y = torch.ops.aten.convolution.default(x, weight, bias, stride, padding, dilation, transposed, output_padding,
                                               groups)
        if not transposed:
            return y
        for dim, start, count in taken:
            y = y.narrow(dim, start, count)
        return y.contiguous()  # as serial's result is: the exported graph may view it

    def max_pool_halo(self, x: torch.Tensor, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False,
                      **halos: tuple[str, ...]) -> torch.Tensor:
        """aten.max_pool{1,2,3}d with spatial dims split: each rank's rows extended by its neighbours' it
        reads (-inf past the image's edges, the pool's own padding there), then pooled without padding
        along those dims."""
        k = len(kernel_size) if isinstance(kernel_size, (list, tuple)) else 1
        kernel = per_dim(kernel_size, k)
        stride, padding, dilation = per_dim(stride, k, kernel), per_dim(padding, k, 0), per_dim(dilation, k)
        x, extended = self._with_halos(x, halos, k, lambda j: halo_rows(kernel[j], stride[j], padding[j],
                                                                        dilation[j]), float("-inf"))
        for _, j, _, _ in extended:
            padding[j] = 0
        op = {1: torch.ops.aten.max_pool1d, 2: torch.ops.aten.max_pool2d, 3: torch.ops.aten.max_pool3d}[k]
        return op.default(x, kernel, stride, padding, dilation, ceil_mode)

    def _with_halos(self, x: torch.Tensor, halos: dict[str, tuple[str, ...]], k: int, rows, fill: float):
        """x extended along each spatial dim split over axes (`halo_<dim>=axes`, dims counted from x's first)
        by the rows of its neighbours `rows(j)` gives for the j-th spatial dim (HaloExchange): the extended x
        and, per dim, (dim, j, rows before, rows after)."""
        extended = []
        for name, axes in sorted(halos.items()):
            dim = int(name.removeprefix("halo_"))
            j = dim - (x.dim() - k)
            before, after = rows(j)
            x = HaloExchange.apply(x, self, axes, dim, before, after, fill)
            extended.append((dim, j, before, after))
        return x, extended

    def exchange_with_neighbours(self, to_next: torch.Tensor, to_previous: torch.Tensor, axes: tuple[str, ...],
                                 dim: int, phase: str) -> torch.Tensor:
        """Send `to_next` to the next rank along a dim split over `axes` (in the split's order, a ring: the
        last rank's next is the first) and `to_previous` to the one before; receive theirs. Returns what the
        rank before sent, then what the rank after sent, joined along `dim`. Sends that carry nothing are
        not made; each that is counts as one `send` over the innermost axis."""

        def issue(phase: str) -> torch.Tensor:
            previous, following = self._neighbour_ranks(axes)
            from_previous, from_next = torch.empty_like(to_next), torch.empty_like(to_previous)
            operations = []
            for sent, received, peer_to, peer_from in ((to_next, from_previous, following, previous),
                                                      (to_previous, from_next, previous, following)):
                if sent.numel():
                    sent = sent.contiguous()
                    self.counter.record(phase, "send", nbytes(sent), axes[-1])
                    operations += [dist.P2POp(dist.isend, sent, peer_to), dist.P2POp(dist.irecv, received, peer_from)]
            for work in dist.batch_isend_irecv(operations) if operations else ():
                work.wait()
            return torch.cat([from_previous, from_next], dim)
        return self._issued(phase, issue)

    def _neighbour_ranks(self, axes: tuple[str, ...]) -> tuple[int, int]:
        """The global ranks holding the chunks before and after this rank's, of a dim split over `axes`
        (outermost first), around a ring."""
        ranks = math.prod(self.size[axis] for axis in axes)
        me = dist.get_rank()

        def rank_of(chunk: int) -> int:
            rank = me
            for axis in reversed(axes):
                index = self.mesh.axis_index(axis)
                rank += (chunk % self.size[axis] - self.coordinate[axis]) * self.mesh.axis_stride(index)
                chunk //= self.size[axis]
            return rank

        chunk = self._chunk(axes)
        return rank_of((chunk - 1) % ranks), rank_of((chunk + 1) % ranks)

    def _chunk(self, axes: tuple[str, ...]) -> int:
        """This rank's chunk index of a dim split over `axes`, outermost first."""
        chunk = 0
        for axis in axes:
            chunk = chunk * self.size[axis] + self.coordinate[axis]
        return chunk

    # -- the primitives, counted ----------------------------------------------------------------------

    def _in_graph(self) -> bool:
        """Whether a collective is being traced into a compiled graph, or run on fake tensors to log what
        that graph will issue (runtime/pieces.py): then it is a functional one (runtime/functional.py),
        which torch.compile traces."""
        return torch.compiler.is_compiling() or self.piece_log is not None

    def log_traced(self, phase: str, kind: str, x: torch.Tensor, axis: str) -> None:
        """A functional collective's kind and bytes, logged while its piece runs on fake tensors; nothing
        while torch.compile traces it."""
        if not torch.compiler.is_compiling() and self.piece_log is not None:
            self.piece_log.append((phase, kind, collective_bytes(kind, nbytes(x), self.size[axis]), axis))

    def _all_reduce(self, x: torch.Tensor, axis: str, phase: str) -> torch.Tensor:
        if self._in_graph():
            return functional.all_reduce(x, self, axis, phase)
        if self.size[axis] == 1:
            return x
        work, summed = self._all_reduce_started(x.contiguous(), axis, phase, overwrite=False)
        if work is not None:  # None: a recomputed region's result given back (runtime/recompute.py)
            work.wait()
        return summed()

    def _all_reduce_started(self, x: torch.Tensor, axis: str, phase: str, overwrite: bool = True):
        """Sum x (contiguous) over `axis`, asynchronously: (work or None, a function giving the sum once
        waited on). `overwrite`: the backend may sum into x itself."""
        n = self.size[axis]
        if n == 1:
            return None, lambda: x

        def issue(phase: str):
            self.counter.record(phase, "all_reduce", collective_bytes("all_reduce", nbytes(x), n), axis)
            return self.all_reduce_started(x, axis, overwrite)
        return self._started(phase, issue)

    def _started(self, phase: str, issue):
        """`issue(phase)`: a collective started asynchronously, or within a recomputed region's forward,
        kept, given back or issued again as the region asks (runtime/recompute.py)."""
        if phase == "forward" and self.region is not None:
            return self.region.started(issue)
        return issue(phase)

    def _issued(self, phase: str, issue):
        """`issue(phase)`: a collective's result, or within a recomputed region's forward, kept, given back
        or issued again as the region asks (runtime/recompute.py)."""
        if phase == "forward" and self.region is not None:
            return self.region.issued(issue)
        return issue(phase)

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

    def _reduce_scatter_started(self, x: torch.Tensor, axis: str, dim: int, phase: str, blocks: int = 1,
                                mirrored: bool = False):
        """Reduce-scatter x asynchronously: (work or None, a function giving the result once waited on)."""
        n = self.size[axis]
        if n == 1:
            return None, lambda: x

        def issue(phase: str):
            self.counter.record(phase, "reduce_scatter", collective_bytes("reduce_scatter", nbytes(x), n), axis)
            return self._reduce_scatter_uncounted(x, axis, dim, blocks, mirrored)
        return self._started(phase, issue)

    def _reduce_scatter_uncounted(self, x: torch.Tensor, axis: str, dim: int, blocks: int = 1, mirrored: bool = False):
        """Reduce-scatter x asynchronously, not counted (the caller counts it, or the whole it is a piece of):
        (work, a function giving the result once waited on)."""
        if (shared := self._shared_for(axis, x)) is not None:
            return shared.reduce_scatter_along(x, dim, blocks, mirrored)
        n = self.size[axis]
        moved = rank_major(x.movedim(dim, 0), n, blocks, mirrored).contiguous()
        work, summed = self.reduce_scatter_started(moved, axis)
        return work, lambda: summed().movedim(0, dim).contiguous()

    def _all_gather_started(self, x: torch.Tensor, axis: str, dim: int, phase: str, blocks: int = 1,
                            mirrored: bool = False):
        """All-gather x along `dim` asynchronously: (work or None, a function giving the result once waited on)."""
        n = self.size[axis]
        if n == 1:
            return None, lambda: x

        def issue(phase: str):
            self.counter.record(phase, "all_gather", collective_bytes("all_gather", nbytes(x), n), axis)
            return self._all_gather_uncounted(x, axis, dim, blocks, mirrored)
        return self._started(phase, issue)

    def _all_gather_uncounted(self, x: torch.Tensor, axis: str, dim: int, blocks: int = 1, mirrored: bool = False):
        """All-gather x asynchronously, not counted: (work, a function giving the result, a view whose `dim`
        is not first, once waited on). Through `all_gather_started`, which every transport starts without
        waiting (gloo's and NCCL's as async work; the shared-memory one posts x and reads the peers' at the
        wait); the shared-memory transport's gather along a dim (`all_gather_along`, which `_all_gather`
        uses) waits at once, so here x's dim is moved first on every transport."""
        n = self.size[axis]
        moved = x.movedim(dim, 0).contiguous()
        out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
        work = self.all_gather_started(out, moved, axis)
        return work, lambda: block_major(out, n, blocks, mirrored).movedim(0, dim)

    def _all_gather_in_pieces(self, x: torch.Tensor, axis: str, dim: int, phase: str, blocks: int, mirrored: bool,
                              along: int, chunks: int):
        """x all-gathered along `dim` in `chunks` pieces cut along `along` (another dim): yields each piece
        gathered, in order, the next piece's gather started before it is handed out, so that what the
        caller computes from one piece runs while the next moves. Two gathers in flight at most: a
        transport's buffers are bounded. Counted once, as the one all-gather of x."""
        self.counter.record(phase, "all_gather", collective_bytes("all_gather", nbytes(x), self.size[axis]), axis)
        pieces = x.tensor_split(min(chunks, x.shape[along]), along)
        following = self._all_gather_uncounted(pieces[0], axis, dim, blocks, mirrored)
        for index in range(len(pieces)):
            work, gathered = following
            if index + 1 < len(pieces):
                following = self._all_gather_uncounted(pieces[index + 1], axis, dim, blocks, mirrored)
            work.wait()
            yield gathered()

    def _reduce_scatter_in_pieces(self, pieces, axis: str, dim: int, phase: str, blocks: int, mirrored: bool,
                                  along: int) -> torch.Tensor:
        """The reduce-scatter along `dim` of the tensor whose pieces along `along` (another dim) `pieces`
        yields, each made as it is asked for: each piece's reduce-scatter is started as soon as it is made
        and waited on after the next is made, so that making one hides the other's transfer. Two in flight
        at most. Counted once, as the one reduce-scatter of the whole tensor."""
        scattered, in_flight, whole_bytes = [], None, 0
        for piece in pieces:
            started = self._reduce_scatter_uncounted(piece, axis, dim, blocks, mirrored)
            whole_bytes += nbytes(piece)
            if in_flight is not None:
                in_flight[0].wait()
                scattered.append(in_flight[1]())
            in_flight = started
        in_flight[0].wait()
        scattered.append(in_flight[1]())
        self.counter.record(phase, "reduce_scatter", collective_bytes("reduce_scatter", whole_bytes, self.size[axis]),
                            axis)
        return torch.cat(scattered, along)

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

    def _all_gather(self, x: torch.Tensor, axis: str, dim: int, phase: str, blocks: int = 1,
                    mirrored: bool = False) -> torch.Tensor:
        if self._in_graph():
            return functional.all_gather(x, self, axis, dim, phase, blocks, mirrored)
        n = self.size[axis]
        if n == 1:
            return x

        def issue(phase: str) -> torch.Tensor:
            self.counter.record(phase, "all_gather", collective_bytes("all_gather", nbytes(x), n), axis)
            if (shared := self._shared_for(axis, x)) is not None:
                return shared.all_gather_along(x, dim, blocks, mirrored)
            work, gathered = self._all_gather_uncounted(x, axis, dim, blocks, mirrored)
            work.wait()
            # contiguous as the serial value was: the exported graph may `view` it (a copy only where dim > 0)
            return gathered().contiguous()
        return self._issued(phase, issue)

    def _reduce_scatter(self, x: torch.Tensor, axis: str, dim: int, phase: str, blocks: int = 1,
                        mirrored: bool = False) -> torch.Tensor:
        if self._in_graph():
            return functional.reduce_scatter(x, self, axis, dim, phase, blocks, mirrored)
        work, result = self._reduce_scatter_started(x, axis, dim, phase, blocks, mirrored)
        if work is not None:
            work.wait()
        return result()

    def _all_to_all(self, x: torch.Tensor, axis: str, split_dim: int, concat_dim: int, phase: str) -> torch.Tensor:
        if self._in_graph():
            return functional.all_to_all(x, self, axis, split_dim, concat_dim, phase)
        n = self.size[axis]
        if n == 1:
            return x

        def issue(phase: str) -> torch.Tensor:
            send = torch.stack(x.chunk(n, dim=split_dim)).contiguous()
            received = torch.empty_like(send)
            self.counter.record(phase, "all_to_all", collective_bytes("all_to_all", nbytes(x), n), axis)
            if (shared := self._shared_for(axis, x)) is not None:
                shared.all_to_all(received, send)
            else:
                dist.all_to_all_single(received, send, group=self.groups[axis])
            return torch.cat(received.unbind(0), dim=concat_dim)
        return self._issued(phase, issue)

    def _slice(self, x: torch.Tensor, axis: str, dim: int, blocks: int | tuple[int, ...] = 1,
               mirrored: bool = False) -> torch.Tensor:
        n, coordinate = self.size[axis], self.coordinate[axis]
        return torch.cat([block.chunk(n, dim=dim)[chunk_of_block(b, coordinate, n, mirrored)]
                          for b, block in enumerate(x.split(block_lengths(x.shape[dim], blocks), dim=dim))], dim=dim)

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
                local = self._slice(local, axis, placement.dim, *placement.arrangement)
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
                k, d, n = placement.blocks, placement.dim, len(parts)
                lengths = block_lengths(full.shape[d], placement.arrangement[0])
                full = torch.cat([torch.cat([parts[chunk_of_block(j, r, n, placement.mirrored)].split(lengths, dim=d)[j]
                                             for r in range(n)], dim=d) for j in range(k)], dim=d)
        return full
