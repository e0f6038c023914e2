"""The conversion catalogue at run time: each one-axis conversion an autograd function whose backward is its
adjoint (`layouts.algebra.CONVERSIONS` lists them), and Megatron's f, all over the runtime's collectives."""

from __future__ import annotations

import torch


class AllReduce(torch.autograd.Function):
    """P → B. Backward: identity (the gradient of a P value is the full gradient)."""

    @staticmethod
    def forward(ctx, x, rt, axis):
        return rt._all_reduce(x, axis, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class AllGather(torch.autograd.Function):
    """S(d) → B (`arrangement`: the split's (blocks, mirrored)). Backward: take this rank's slice of the full gradient, or reduce-scatter a partial one."""

    @staticmethod
    def forward(ctx, x, rt, axis, dim, backward, arrangement):
        ctx.rt, ctx.axis, ctx.dim, ctx.mode, ctx.arrangement = rt, axis, dim, backward, arrangement
        return rt._all_gather(x, axis, dim, "forward", *arrangement)

    @staticmethod
    def backward(ctx, grad):
        if ctx.mode == "reduce_scatter":
            return ctx.rt._reduce_scatter(grad, ctx.axis, ctx.dim, "backward", *ctx.arrangement), \
                None, None, None, None, None
        return ctx.rt._slice(grad, ctx.axis, ctx.dim, *ctx.arrangement), None, None, None, None, None


class ReduceScatter(torch.autograd.Function):
    """P → S(d). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, rt, axis, dim, arrangement):
        ctx.rt, ctx.axis, ctx.dim, ctx.arrangement = rt, axis, dim, arrangement
        return rt._reduce_scatter(x, axis, dim, "forward", *arrangement)

    @staticmethod
    def backward(ctx, grad):
        return ctx.rt._all_gather(grad, ctx.axis, ctx.dim, "backward", *ctx.arrangement), None, None, None, None


class AllToAll(torch.autograd.Function):
    """S(concat_dim) → S(split_dim). Backward: the all-to-all back."""

    @staticmethod
    def forward(ctx, x, rt, axis, split_dim, concat_dim):
        ctx.rt, ctx.axis, ctx.split_dim, ctx.concat_dim = rt, axis, split_dim, concat_dim
        return rt._all_to_all(x, axis, split_dim, concat_dim, "forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.rt._all_to_all(grad, ctx.axis, ctx.concat_dim, ctx.split_dim, "backward"), None, None, None, None


class Split(torch.autograd.Function):
    """B → S(d): a local slice. Backward: all-gather, so the B value's gradient is full on every rank."""

    @staticmethod
    def forward(ctx, x, rt, axis, dim, arrangement):
        ctx.rt, ctx.axis, ctx.dim, ctx.arrangement = rt, axis, dim, arrangement
        return rt._slice(x, axis, dim, *arrangement)

    @staticmethod
    def backward(ctx, grad):
        return ctx.rt._all_gather(grad.contiguous(), ctx.axis, ctx.dim, "backward", *ctx.arrangement), \
            None, None, None, None


class ToPartial(torch.autograd.Function):
    """B → P: the value on coordinate 0, zeros elsewhere. Backward: identity (P's gradient is full)."""

    @staticmethod
    def forward(ctx, x, rt, axis):
        return x.clone() if rt.coordinate[axis] == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GradAllReduce(torch.autograd.Function):
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
