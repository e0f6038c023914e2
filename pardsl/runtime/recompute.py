"""A recomputed region at run time (`rt.recompute`): the local function the generated forward makes of a
submodule the file recomputes (pardsl/passes/recompute.py), run under `torch.utils.checkpoint`.

Non-reentrant checkpointing keeps the region's inputs and runs it again in backward, where autograd
asks for what it would have kept; the RNG state of the region's start is restored for that run, so
dropout draws the same masks, and the run goes to the region's end (no early stop), so the collectives
it issues again are the same on every rank and as many as the plan counts.

Under `selective`, the ATen ops that are costly to run again — matrix products and attention — keep
their results (torch's selective checkpoint contexts), and so does every forward collective of the
region: the runtime keeps each result in the first run and gives it back, in order, in the second,
without communicating. What runs again is the cheap rest.

A product whose result nothing backward needs (`rt.made_once`: a row-parallel linear's partial sums, which
only its all-reduce reads, and that result is kept) is neither kept nor made again: the second run gets
zeros in its place, and autograd still keeps what the product reads.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
    set_checkpoint_early_stop,
)

aten = torch.ops.aten

# The ATen ops whose results a selective region keeps: products with a weight (a linear layer's mm) and
# fused attention, as the op-level policy of torchtitan's selective activation checkpointing keeps them.
# Products of two activations (unfused attention's scores and weighted values, batched) are made again
# with the softmax between them: they are what grows with the square of the sequence, and Megatron's
# selective recomputation exists to drop them.
COSTLY_OPS = frozenset(op for op in (
    aten.mm.default, aten.addmm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None) and
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    getattr(aten, "_scaled_dot_product_cudnn_attention", None) and aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_attention_math.default,
) if op is not None)


def _costly_kept(rt, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    made_once = rt.region is not None and rt.region.making_once
    return CheckpointPolicy.MUST_SAVE if op in COSTLY_OPS and not made_once else CheckpointPolicy.PREFER_RECOMPUTE


# the modes torch.utils.checkpoint's selective contexts enter: forward's (results cached) and recomputation's
_SELECTIVE_CHECKPOINT_MODES = (torch.utils.checkpoint._CachingTorchDispatchMode,
                               torch.utils.checkpoint._CachedTorchDispatchMode)


class RegionCollectives:
    """The forward collectives of one run of a region: `keep` (the first run of a selective region: each
    result kept), `replay` (its second run: each given back, none issued) or `again` (the second run of
    a full region: issued again, and counted in backward)."""

    def __init__(self, mode: str, kept: list):
        self.mode, self.kept, self._next = mode, kept, 0
        self.making_once = False  # within `made_once` in the first run: the selective policy keeps nothing

    def unseen(self):
        """A context for the runtime's own work within a selective region (a collective's copies, a group's
        gathers): torch's selective checkpointing wants the second run to call the ATen ops the first did,
        in the same order, and the runtime's own work differs between them (a kept result given back, a
        group gathered again instead of prefetched), so it is done out of the checkpoint's sight; not out
        of any other mode's (a rank's measured memory counts what it keeps)."""
        return _out_of_selective_checkpoints_sight() if self.mode in ("keep", "replay") else contextlib.nullcontext()

    def issued(self, issue):
        """The result of a forward collective `issue(phase)` (a tensor)."""
        if self.mode == "replay":
            return self._given_back()
        with self.unseen():
            result = issue("backward" if self.mode == "again" else "forward")
        if self.mode == "keep":
            self.kept.append(result)
        return result

    def started(self, issue):
        """A forward collective started asynchronously, `issue(phase)` → (work, a function giving the result
        once waited on): the same, the result kept or given back where the function is called."""
        if self.mode == "replay":
            result = self._given_back()
            return None, lambda: result
        with self.unseen():
            work, result = issue("backward" if self.mode == "again" else "forward")
        if self.mode != "keep":
            return work, result

        def kept():
            with self.unseen():
                value = result()
            self.kept.append(value)
            return value
        return work, kept

    def _given_back(self) -> torch.Tensor:
        if self._next >= len(self.kept):
            raise RuntimeError("a recomputed region issued more collectives in backward than in forward: "
                               "its forward is not the same both times")
        value = self.kept[self._next]
        self._next += 1
        return value


@contextlib.contextmanager
def _out_of_selective_checkpoints_sight():
    """The dispatch modes of torch's selective checkpointing set aside (the innermost, as its contexts enter
    them within the region's run); the others, entered before the region ran, stay."""
    with contextlib.ExitStack() as set_aside:
        while isinstance(_get_current_dispatch_mode(), _SELECTIVE_CHECKPOINT_MODES):
            set_aside.enter_context(_pop_mode_temporarily())
        yield


def made_once(rt, op, *args):
    """`op(*args)`, a product of a selective region whose result nothing backward needs (the compiler proves
    it: pardsl/passes/recompute.py): in the region's first run, made and not kept; in its second, a
    stand-in. Elsewhere, and in a full region, made as usual."""
    region = rt.region
    if region is None or region.mode not in ("keep", "replay"):
        return op(*args)
    if region.mode == "replay":
        with _StandIns():
            return op(*args)
    region.making_once = True
    try:
        return op(*args)
    finally:
        region.making_once = False


class _StandIns(TorchDispatchMode):
    """Each ATen op's result stood in for by zeros of its shape, dtype and strides: no work done. The
    strides are the op's own, so what reads the stand-in takes the same path as in the first run (a
    reshape copies or views as it did). Views are taken as usual. Autograd, above this mode, records the
    ops and keeps what they read, as in the first run. Torch's selective checkpointing, below it, counts
    every op of both runs to match them: each op reaches it, on meta tensors where stood in for."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or any(returned.alias_info is not None for returned in func._schema.returns):
            return func(*args, **kwargs)
        with _out_of_selective_checkpoints_sight():  # its own tensors are none of the region's ops
            shaped_args, shaped_kwargs = tree_map_only(torch.Tensor, lambda t: torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype, device="meta"), (args, kwargs))
        shaped = func(*shaped_args, **shaped_kwargs)
        with _out_of_selective_checkpoints_sight():
            return tree_map_only(torch.Tensor, lambda result: torch.empty_strided(
                result.shape, result.stride(), dtype=result.dtype, device=tensors[0].device).zero_(), shaped)


def recompute(rt, region, policy: str, *arguments):
    """`region(*arguments)`, its activations made again in backward (`policy`: "full" or "selective")."""
    if not torch.is_grad_enabled():
        return region(*arguments)
    selective = policy == "selective"
    kept: list = []
    runs = 0

    def run(*inputs):
        nonlocal runs
        runs += 1
        mode = ("keep" if runs == 1 else "replay") if selective else (None if runs == 1 else "again")
        with _collectives(rt, RegionCollectives(mode, kept) if mode else None):
            return region(*inputs)

    context = functools.partial(create_selective_checkpoint_contexts, functools.partial(_costly_kept, rt)) \
        if selective else noop_context_fn
    with set_checkpoint_early_stop(False):
        return checkpoint(run, *arguments, use_reentrant=False, preserve_rng_state=True, context_fn=context)


@contextlib.contextmanager
def _collectives(rt, region: RegionCollectives | None):
    before, rt.region = rt.region, region
    try:
        yield
    finally:
        rt.region = before
