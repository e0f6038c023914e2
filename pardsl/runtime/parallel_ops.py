"""Parallel forms of ops, each an autograd function: the column-parallel step of the linears that read one
input, a row-parallel linear with the reduce-scatter of its partial sums, fused RMSNorm and rotary
embeddings, the vocabulary-parallel cross-entropy, batch norm over a split batch, layer norm over a split
hidden dim, the halo exchange of a spatially split image."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pardsl.layouts.algebra import collective_matmul_cut
from pardsl.runtime import kernels
from pardsl.runtime.recompute import kept_by_itself


def targets_counted(target: torch.Tensor, ignore_index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """How many targets a mean loss divides by, shape [1], in float32 at least (oprules: the `counts` and
    `mean` forms' collectives): exact up to 2^24 targets, where a half-precision count is only up to 256."""
    return (target != ignore_index).sum().to(dtype).reshape(1)


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

    def input_factor(self, weight: torch.Tensor) -> torch.Tensor:
        """What the result's gradient is multiplied by for the input's: the weight as [out, in]."""
        return weight.t() if self.weight_in_out else weight

    def weight_grad(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The weight's gradient from the input and the result's gradient, rows flattened, as stored."""
        rows, grad_rows = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        return rows.t().matmul(grad_rows) if self.weight_in_out else grad_rows.t().matmul(rows)


# The ops a column-parallel step computes for its readers of one input: linear's weight is [out, in],
# the others' [in, out] (GPT-2's Conv1D is an addmm; `x @ W` an mm or matmul)
PROJECTIONS = {
    "linear": Projection(lambda x, w, b: torch.ops.aten.linear.default(x, w, b), False, 0, 1, 2),
    "addmm": Projection(lambda x, w, b: torch.ops.aten.addmm.default(b, x, w), True, 1, 2, 0),
    "mm": Projection(lambda x, w, b: torch.ops.aten.mm.default(x, w), True, 0, 1, None),
    "matmul": Projection(lambda x, w, b: torch.ops.aten.matmul.default(x, w), True, 0, 1, None),
}


class ColumnParallelLinears(torch.autograd.Function):
    """f (or SP's g), then linears of its value. Backward: the input's gradient (summed over the linears)
    first, its all-reduce (or reduce-scatter) issued asynchronously, the weights' and biases' gradients
    computed meanwhile, then waited on. With `chunks` > 1, SP's gather is made in pieces, each piece's
    linears computed while the next moves (a collective matmul); backward reads the whole gathered x. With
    `regather` (Megatron-SP's form), backward gathers x again from the split it kept, beside the input's
    gradient."""

    @staticmethod
    def forward(ctx, x, rt, axes, how, *weights_and_biases):
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        ctx.rt, ctx.axes, ctx.how, ctx.has_bias = rt, axes, how, [b is not None for b in biases]
        gather_dim, arrangement, projection, chunks, regather = how
        split = x
        if gather_dim is not None:
            along = _pieces_dim(rt, x, axes[0], chunks, gather_dim, "forward")
            if along is not None:
                x, results = _linears_of_gathered_pieces(x, rt, axes[0], gather_dim, arrangement, projection,
                                                         weights, biases, along, chunks)
                ctx.save_for_backward(split if regather else x, *weights)
                return results
            x = rt._all_gather(x, axes[0], gather_dim, "forward", *arrangement)
        ctx.save_for_backward(split if regather else x, *weights)
        # in a selective recomputed region, kept from the first run and given back in the second
        # (pardsl/runtime/recompute.py); x is saved for backward in both runs
        return kept_by_itself(rt, ColumnParallelLinears,
                              lambda: tuple(projection.compute(x, w, b) for w, b in zip(weights, biases)))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        rt = ctx.rt
        gather_dim, arrangement, projection, _, regather = ctx.how
        grad_x, work, result = None, None, None
        products = [(grad.reshape(-1, grad.shape[-1]), projection.input_factor(weight))
                    for grad, weight in zip(grads, weights) if grad is not None]
        gathering, shape = None, list(x.shape)
        # x's split gathered again, moving while the input's gradient is computed; not where no weight
        # takes a gradient (frozen), as x is read for nothing else
        if regather and any(ctx.needs_input_grad[4::2]):
            gathering = rt._all_gather_started(x.contiguous(), ctx.axes[0], gather_dim, "backward", *arrangement)
            shape[gather_dim] *= rt.size[ctx.axes[0]]
        if ctx.needs_input_grad[0] and products:
            # summed by the products themselves (addmm's beta = 1), straight into memory the collective's
            # peers read: no separate adds, and no copy when the collective starts
            grad_x = rt.collective_input(ctx.axes[0], tuple(shape), like=x)
            rows_of_grad_x = grad_x.view(-1, shape[-1])
            torch.mm(*products[0], out=rows_of_grad_x)
            for grad_rows, factor in products[1:]:
                rows_of_grad_x.addmm_(grad_rows, factor)
        if gathering is not None:  # one collective in flight at a time: a transport's buffers are bounded
            if gathering[0] is not None:
                gathering[0].wait()
            x = gathering[1]().contiguous()  # as forward's gather gives it: each weight's gradient reads it whole
        if grad_x is not None:
            if gather_dim is not None:
                work, result = rt._reduce_scatter_started(grad_x, ctx.axes[0], gather_dim, "backward", *arrangement)
            else:
                work, result = rt._all_reduce_started(grad_x, ctx.axes[0], "backward")
        parameter_grads = []
        for index, (grad, has_bias) in enumerate(zip(grads, ctx.has_bias)):
            grad_w = grad_b = None
            if grad is not None:
                if ctx.needs_input_grad[4 + 2 * index]:
                    grad_w = projection.weight_grad(x, grad)
                if has_bias and ctx.needs_input_grad[5 + 2 * index]:
                    grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
            parameter_grads += [grad_w, grad_b]
        if work is not None:
            work.wait()
        if result is not None:
            grad_x = result()
        for axis in ctx.axes[1:]:
            if grad_x is not None:
                grad_x = rt._all_reduce(grad_x, axis, "backward")
        return (grad_x, None, None, None, *parameter_grads)


def _pieces_dim(rt, x: torch.Tensor, axis: str, chunks: int, whole_dim: int, phase: str) -> int | None:
    """The dim a collective matmul cuts x into pieces along (layouts.collective_matmul_cut), or None where
    it runs unchunked: where no dim can be cut. Unchunked also where there is nothing to overlap (one chunk, one rank), where
    the collective is traced into a compiled graph (whose scheduler overlaps on its own terms), and in a
    selective recomputed region's forward, whose collectives are kept and given back whole
    (runtime/recompute.py); a full region's second run issues them again, in pieces as the first did."""
    if chunks <= 1 or rt.size[axis] == 1 or rt._in_graph() or \
            (phase == "forward" and rt.region is not None and rt.region.mode != "again"):
        return None
    cut = collective_matmul_cut(tuple(x.shape), whole_dim, rt.size[axis])
    return None if cut is None else cut[0]


def _forward_phase(rt) -> str:
    """The phase a forward collective counts in: backward's, where a full recomputed region runs again."""
    return "backward" if rt.region is not None and rt.region.mode == "again" else "forward"


def _linears_of_gathered_pieces(x, rt, axis, gather_dim, arrangement, projection, weights, biases, along, chunks):
    """The column-parallel linears of x gathered along `gather_dim`, x gathered in pieces along `along` and
    each piece's products made while the next piece moves: (the whole gathered x, which backward reads,
    and each linear's result)."""
    whole, pieces = _gathered_in_pieces(x, rt, axis, gather_dim, _forward_phase(rt), arrangement, along, chunks)
    results = [[projection.compute(piece, w, b) for w, b in zip(weights, biases)] for piece in pieces]
    return whole, tuple(torch.cat(parts, along) for parts in zip(*results))


def _gathered_in_pieces(x, rt, axis, dim, phase, arrangement, along, chunks):
    """x all-gathered along `dim` in pieces along `along` (Runtime._all_gather_in_pieces): (the whole
    gathered tensor, made empty, and an iterator of its pieces, each written into it as its gather
    arrives). Each piece lies where it is in the whole: backward reads the whole, and a piece along
    dim 0 is a contiguous view of it, which the products read without a copy."""
    shape = list(x.shape)
    shape[dim] *= rt.size[axis]
    whole = x.new_empty(shape)

    def pieces():
        start = 0
        for gathered in rt._all_gather_in_pieces(x, axis, dim, phase, *arrangement, along, chunks):
            yield whole.narrow(along, start, gathered.shape[along]).copy_(gathered)
            start += gathered.shape[along]
    return whole, pieces()


class LinearReduceScatter(torch.autograd.Function):
    """A row-parallel linear's partial sums reduce-scattered along `dim` (Runtime.linear_reduce_scatter):
    `chunks` > 1 makes and scatters them in pieces, each piece's transfer behind the next piece's product.
    Backward: the output's gradient all-gathered (in pieces, x's gradient of each made while the next
    arrives), x's gradient by the projection's input product, the weight's from the whole gathered
    gradient and x, as the unchunked composition's autograd computes them."""

    @staticmethod
    def forward(ctx, x, weight, rt, axis, dim, arrangement, projection, chunks):
        ctx.rt, ctx.axis, ctx.dim, ctx.arrangement, ctx.projection, ctx.chunks = \
            rt, axis, dim, arrangement, projection, chunks
        ctx.save_for_backward(x, weight)
        along = _pieces_dim(rt, x, axis, chunks, dim, "forward")
        if along is not None:
            pieces = (projection.compute(piece, weight, None)
                      for piece in x.tensor_split(min(chunks, x.shape[along]), along))
            return rt._reduce_scatter_in_pieces(pieces, axis, dim, _forward_phase(rt), *arrangement, along)
        # in a selective recomputed region, kept from the first run and given back in the second, product
        # and all, as the column-parallel linears' products are
        return kept_by_itself(rt, LinearReduceScatter, lambda: rt._reduce_scatter(
            projection.compute(x, weight, None), axis, dim, "forward", *arrangement))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rt, axis, dim, arrangement, projection = ctx.rt, ctx.axis, ctx.dim, ctx.arrangement, ctx.projection
        factor = projection.input_factor(weight)  # x's gradient is the gradient times it
        grad_x = None
        along = _pieces_dim(rt, grad, axis, ctx.chunks, dim, "backward")
        if along is None:
            whole = rt._all_gather(grad.contiguous(), axis, dim, "backward", *arrangement)
            if ctx.needs_input_grad[0]:
                grad_x = whole.matmul(factor)
        else:
            whole, pieces = _gathered_in_pieces(grad, rt, axis, dim, "backward", arrangement, along, ctx.chunks)
            parts = []
            for piece in pieces:  # every piece is gathered, whether x needs a gradient or not: the weight's reads all
                if ctx.needs_input_grad[0]:
                    parts.append(piece.matmul(factor))
            grad_x = torch.cat(parts, along) if parts else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = projection.weight_grad(x, whole)
        return grad_x, grad_weight, None, None, None, None, None, None


class KeptSplit:
    """How a split value kept for backward in place of its all-gather (Runtime.kept_split) is gathered
    again: by the first of its `readers` whose backward asks for the whole, which the others reuse; the
    last one's backward lets it go. Each reader saves the split itself (autograd's checks apply to it)."""

    def __init__(self, split: torch.Tensor, rt, axis: str, dim: int, arrangement: tuple, readers: int):
        self.split, self.rt, self.axis, self.dim, self.arrangement = split, rt, axis, dim, arrangement
        self.readers, self._whole, self._gathering = readers, None, None

    def start(self, split: torch.Tensor) -> None:
        """Start gathering the whole from `split` (a reader's saved copy of it), unless it is gathered or on
        its way: it moves while the reader computes what needs no whole."""
        if self._whole is None and self._gathering is None:
            self._gathering = self.rt._all_gather_started(split.contiguous(), self.axis, self.dim, "backward",
                                                          *self.arrangement)

    def whole(self, split: torch.Tensor) -> torch.Tensor:
        """The whole gathered again from `split`, waited on; counts the reader done."""
        self.start(split)
        if self._whole is None:
            work, gathered = self._gathering
            if work is not None:
                work.wait()
            self._whole, self._gathering = gathered().contiguous(), None
        whole = self._whole
        self.done()
        return whole

    def done(self) -> None:
        """A reader's backward no longer needs the whole: after the last, it is let go."""
        self.readers -= 1
        if self.readers <= 0:
            self._whole = None


class LinearOfGathered(torch.autograd.Function):
    """`aten.linear(whole, weight, bias)` of an all-gathered value that keeps its split for backward, not
    the whole (Runtime.linear_of_gathered): backward gathers it again (once for all such readers, `kept`)
    for the weight's gradient, the gather moving while the whole's gradient is computed; the whole's
    gradient flows back through the gather's own backward."""

    @staticmethod
    def forward(ctx, whole, weight, bias, kept):
        ctx.kept, ctx.has_bias = kept, bias is not None
        ctx.save_for_backward(weight, kept.split)
        return torch.ops.aten.linear.default(whole, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        weight, split = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            ctx.kept.start(split)
        grad_whole = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            whole = ctx.kept.whole(split)
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(whole.reshape(-1, whole.shape[-1]))
        else:
            ctx.kept.done()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_whole, grad_weight, grad_bias, None


class AllGatherLinear(torch.autograd.Function):
    """A split value all-gathered along `dim` and the first linear that reads it, as one step
    (Runtime.all_gather_linear): the gathered value and the linear's result. `chunks` > 1 gathers it in
    pieces, each piece's product made while the next moves. Backward: the gathered value's gradient (from
    its other readers, where it has any) plus the linear's input gradient, reduce-scattered back, started
    before the weight's gradient is computed and waited on after, as the column-parallel linears do."""

    @staticmethod
    def forward(ctx, x, weight, rt, axis, dim, arrangement, projection, chunks):
        ctx.rt, ctx.axis, ctx.dim, ctx.arrangement, ctx.projection = rt, axis, dim, arrangement, projection
        along = _pieces_dim(rt, x, axis, chunks, dim, "forward")
        if along is not None:
            whole, results = _linears_of_gathered_pieces(x, rt, axis, dim, arrangement, projection, (weight,),
                                                         (None,), along, chunks)
            product = results[0]
        else:
            whole = rt._all_gather(x, axis, dim, "forward", *arrangement)
            product = projection.compute(whole, weight, None)
        ctx.save_for_backward(whole, weight)
        return whole, product

    @staticmethod
    def backward(ctx, grad_whole, grad_product):
        whole, weight = ctx.saved_tensors
        rt, projection = ctx.rt, ctx.projection
        grad_x = grad_weight = None
        if grad_product is None:
            total = grad_whole
        else:
            total = grad_product.matmul(projection.input_factor(weight))
            if grad_whole is not None:
                total = total + grad_whole
        work = result = None
        if ctx.needs_input_grad[0] and total is not None:
            work, result = rt._reduce_scatter_started(total.contiguous(), ctx.axis, ctx.dim, "backward",
                                                      *ctx.arrangement)
        if ctx.needs_input_grad[1] and grad_product is not None:
            grad_weight = projection.weight_grad(whole, grad_product)
        if work is not None:
            work.wait()
        if result is not None:
            grad_x = result()
        return grad_x, grad_weight, None, None, None, None, None, None


class RMSNorm(torch.autograd.Function):
    """On a CPU, in float32 or float64 with no cast: numba's fused kernels (pardsl/runtime/kernels.py), one pass per
    row each way; they keep x and r. Otherwise the ops the model's chain runs forward (pow, mean, add,
    rsqrt, mul, to, mul), so the same bits, keeping n = x·r and r; where `compute` is given, x is the model's
    input before its cast to that dtype, cast here, and kept in its own dtype in place of n, which backward
    makes again (half the bytes for a bf16 model); backward, the weight's gradient
    Σ g·n.to(dtype) over every dim but the last, and, with m = (g·w) in x's dtype, x's r·(m − n·mean(m·n)):
    what autograd's ops through the chain add up to (the weight's the same ops, so the same bits)."""

    @staticmethod
    def forward(ctx, x, weight, eps, dtype, compute=None):
        ctx.dtype = dtype
        ctx.narrow = compute is not None and compute != x.dtype  # x cast here first, kept in its own dtype
        ctx.fused = not ctx.narrow and kernels.rms_norm_fits(x, weight, dtype)
        if ctx.fused:
            out, rows, r = kernels.rms_norm_forward(x, weight, eps)
            ctx.save_for_backward(rows, r, weight)
            return out
        wide = x.to(compute) if ctx.narrow else x
        r = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True).add_(eps))
        normed = wide * r
        ctx.save_for_backward(x if ctx.narrow else normed, r, weight)
        return weight * normed.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.fused:
            rows, r, weight = ctx.saved_tensors
            grad_x, grad_weight = kernels.rms_norm_backward(grad, rows, r, weight, ctx.needs_input_grad[1])
            return grad_x, grad_weight, None, None, None
        normed, r, weight = ctx.saved_tensors
        if ctx.narrow:  # x·r made again from the input kept narrow: the forward's ops, so its bits
            narrow_dtype = normed.dtype
            normed = normed.to(r.dtype) * r
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(ctx.dtype)).sum(tuple(range(grad.dim() - 1)))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = (grad * weight).to(normed.dtype)
            # addcmul_ takes n·mean(m·n) from m in the one pass, where sub_ would need the product made first
            grad_x = grad_normed.addcmul_(normed, (grad_normed * normed).mean(-1, keepdim=True), value=-1).mul_(r)
            if ctx.narrow:  # back through the cast, as autograd's backward of `to` casts the gradient
                grad_x = grad_x.to(narrow_dtype)
        return grad_x, grad_weight, None, None, None


class SwiGLU(torch.autograd.Function):
    """silu(gate) · up, keeping gate and up: backward makes silu(gate) again for up's gradient and gives
    gate's by silu_backward of g · up, the ops autograd runs through silu and the product, so the same bits."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * torch.nn.functional.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


class Rotary(torch.autograd.Function):
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


class ClassSplitCrossEntropy(torch.autograd.Function):
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


class SyncBatchNorm(torch.autograd.Function):
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


class HaloExchange(torch.autograd.Function):
    """A tensor split along `dim` over `axes`, each rank's rows extended by the last `before` rows of the
    rank before it and the first `after` rows of the rank after it (`fill` past the first and the last
    rank: a window op's own padding there). Forward: each rank sends its last rows to the next rank and its
    first rows to the one before (Runtime.exchange_with_neighbours); backward: the gradients of the rows it
    received go back to their owners, who add them to their own."""

    @staticmethod
    def forward(ctx, x, rt, axes, dim, before, after, fill):
        rows = x.shape[dim]
        if before > rows or after > rows:
            raise ValueError(f"a rank holds {rows} row(s) along dim {dim}, fewer than the {max(before, after)} its "
                             "neighbours' windows read: split the image over fewer ranks")
        ctx.rt, ctx.axes, ctx.dim, ctx.before, ctx.after = rt, axes, dim, before, after
        if math.prod(rt.size[axis] for axis in axes) == 1:  # not split after all: the padding alone
            shape = list(x.shape)
            return torch.cat([x.new_full(shape[:dim] + [before] + shape[dim + 1:], fill), x,
                              x.new_full(shape[:dim] + [after] + shape[dim + 1:], fill)], dim)
        received = rt.exchange_with_neighbours(x.narrow(dim, rows - before, before), x.narrow(dim, 0, after),
                                               axes, dim, "forward")
        first, last = received.narrow(dim, 0, before), received.narrow(dim, before, after)
        rank, ranks = rt._chunk(axes), math.prod(rt.size[axis] for axis in axes)
        if rank == 0:
            first = torch.full_like(first, fill)
        if rank == ranks - 1:
            last = torch.full_like(last, fill)
        return torch.cat([first, x, last], dim)

    @staticmethod
    def backward(ctx, grad):
        dim, before, after = ctx.dim, ctx.before, ctx.after
        rows = grad.shape[dim] - before - after
        own = grad.narrow(dim, before, rows).clone()
        if math.prod(ctx.rt.size[axis] for axis in ctx.axes) == 1:
            return own, None, None, None, None, None, None
        # the gradient of the rows the rank before lent goes back to it, of the rank after's to it
        returned = ctx.rt.exchange_with_neighbours(grad.narrow(dim, before + rows, after), grad.narrow(dim, 0, before),
                                                   ctx.axes, dim, "backward")
        rank, ranks = ctx.rt._chunk(ctx.axes), math.prod(ctx.rt.size[axis] for axis in ctx.axes)
        if rank < ranks - 1:  # the rank after read my last rows as its first
            own.narrow(dim, rows - before, before).add_(returned.narrow(dim, after, before))
        if rank > 0:  # the rank before read my first rows as its last
            own.narrow(dim, 0, after).add_(returned.narrow(dim, 0, after))
        return own, None, None, None, None, None, None


class SplitLayerNorm(torch.autograd.Function):
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
