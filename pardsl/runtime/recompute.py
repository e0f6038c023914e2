"""A recomputed region at run time (`rt.recompute`): the local function the generated forward makes of a
submodule the file recomputes (pardsl/passes/recompute.py), run under `torch.utils.checkpoint`.

Non-reentrant checkpointing keeps the region's inputs and runs it again in backward, where autograd
asks for what it would have kept; the RNG state of the region's start is restored for that run, so
dropout draws the same masks, and the run goes to the region's end (no early stop), so the collectives
it issues again are the same on every rank and as many as the plan counts.

Under `selective`, the statements whose results are costly to make again — linear layers, fused
attention, unfused attention's weighted values — run inside `rt.kept`: their matrix products' results
are kept in the region's first run and given back in its second, in order, where autograd records the
same ops and keeps what they read as in the first run. The runtime's column-parallel linears keep and
give back their products themselves, ring attention its result (its key/value chunks are not passed
around again), and every forward collective of the region is kept and given back the same way, without
communicating. What runs again is the cheap rest, with no dispatch mode around it: only the few ATen ops
of the kept statements pass through Python, where torch's selective checkpoint contexts would take every
op of the region through it, twice.

A product whose result nothing backward needs (`rt.made_once`: a row-parallel linear's partial sums, which
only its all-reduce reads, and that result is kept) is neither kept nor made again: the second run gets
zeros in its place, and autograd still keeps what the product reads.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

aten = torch.ops.aten

# The ATen ops whose results a selective region keeps, inside a statement the compiler marks `rt.kept`:
# products with a weight (a linear layer's mm), fused attention, as the op-level policy of torchtitan's
# selective activation checkpointing keeps them, and a batched product of two activations no larger than
# what it reads (unfused attention's weighted values). Unfused attention's scores are not marked: they grow
# with the square of the sequence, and Megatron's selective recomputation exists to drop them.
COSTLY_OPS = frozenset(op for op in (
    aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None) and
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    getattr(aten, "_scaled_dot_product_cudnn_attention", None) and aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_attention_math.default,
) if op is not None)


class RegionRun:
    """One run of a recomputed region: `keep` (the first run of a selective region: each forward
    collective's result and each kept product's kept), `replay` (its second run: each given back, none
    made, no collective issued) or `again` (the second run of a full region: its collectives issued
    again, and counted in backward). `kept`: what the first run kept, shared by both runs."""

    def __init__(self, mode: str, kept: dict):
        self.mode, self.kept = mode, kept
        self._next = {"collective": 0, "product": 0}

    def issued(self, issue):
        """The result of a forward collective `issue(phase)` (a tensor)."""
        if self.mode == "replay":
            return self.given_back("collective")
        result = issue("backward" if self.mode == "again" else "forward")
        if self.mode == "keep":
            self.kept["collective"].append(result)
        return result

    def started(self, issue):
        """A forward collective started asynchronously, `issue(phase)` → (work, a function giving the result
        once waited on): the same, the result kept or given back where the function is called."""
        if self.mode == "replay":
            result = self.given_back("collective")
            return None, lambda: result
        work, result = issue("backward" if self.mode == "again" else "forward")
        if self.mode != "keep":
            return work, result

        def kept():
            value = result()
            self.kept["collective"].append(value)
            return value
        return work, kept

    def given_back(self, kind: str):
        """The next result of `kind` ("collective" or "product") the first run kept."""
        kept, at = self.kept[kind], self._next[kind]
        if at >= len(kept):
            raise RuntimeError(f"a recomputed region made more {kind}s in backward than in forward: its forward "
                               "is not the same both times")
        if kept[at] is _GIVEN:
            raise RuntimeError("a selective region's backward ran a second time (retain_graph): what its forward "
                               "kept was given to the first and is freed; recompute it with the full policy")
        self._next[kind] = at + 1
        value, kept[at] = kept[at], _GIVEN  # the recomputed ops hold it now, and free it as their backward ends
        return value

    def keep_product(self, made_by, result):
        """In the first run: `result` (a tensor or a tuple of them) of the product `made_by`, kept."""
        alias = tree_map_only(torch.Tensor, _detached, result)
        self.kept["product"].append((made_by, alias, _versions(alias)))

    def product_given_back(self, made_by):
        """In the second run: the result the first run kept of the product `made_by` called at this point."""
        kept_by, result, versions = self.given_back("product")
        if kept_by != made_by or versions != _versions(result):
            raise RuntimeError(f"a recomputed region's kept result of {kept_by} was changed in place, or its second "
                               f"run made {made_by} instead: its forward is not the same both times")
        return result


_GIVEN = object()


def kept(rt, op, *args, **kwargs):
    """`op(*args, **kwargs)`, a statement of a selective region whose products' results are kept (the
    compiler marks them: pardsl/passes/recompute.py): in the region's first run each product (`COSTLY_OPS`)
    is made and its result kept; in its second, given back instead of made again. Elsewhere, and in a full
    region, made as usual."""
    region = rt.region
    if region is None or region.mode not in ("keep", "replay"):
        return op(*args, **kwargs)
    with _ProductsKept(region):
        return op(*args, **kwargs)


def kept_by_itself(rt, made_by, make):
    """`make()`, a runtime op that keeps its own result in a selective region (column-parallel linears'
    products, ring attention): in the region's first run made, its collectives issued as outside any region
    (the second run does not make it again, so they are not kept), and the result kept; in the second,
    given back. Elsewhere made as usual."""
    region = rt.region
    if region is None or region.mode not in ("keep", "replay"):
        return make()
    if region.mode == "replay":
        return region.product_given_back(made_by)
    with _running(rt, None):
        result = make()
    region.keep_product(made_by, result)
    return result


class _ProductsKept(TorchDispatchMode):
    """Around one kept statement: each product's result kept (the region's first run) or given back (its
    second), every other op run as it is. The mode is below autograd, so autograd records each product
    and keeps what it reads in both runs alike, as checkpointing needs; the kept result is a detached
    alias, which autograd takes as the op's new output in the second run."""

    def __init__(self, region: RegionRun):
        super().__init__()
        self.region = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in COSTLY_OPS:
            return func(*args, **kwargs)
        if self.region.mode == "replay":
            return self.region.product_given_back(func)
        result = func(*args, **kwargs)
        self.region.keep_product(func, result)
        return result


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    # beneath autograd a detach is a plain alias; with the view key on, it shares the version counter, so a
    # later in-place change of the result shows
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


def _versions(result) -> tuple[int, ...]:
    return tuple(t._version for t in tree_leaves(result) if isinstance(t, torch.Tensor))


def made_once(rt, op, *args):
    """`op(*args)`, a product of a recomputed region whose result nothing backward needs (the compiler proves
    it: pardsl/passes/recompute.py): in the region's first run, made and not kept; in its second, a
    stand-in. Elsewhere made as usual."""
    region = rt.region
    if region is not None and region.mode in ("replay", "again"):
        with _StandIns():
            return op(*args)
    return op(*args)


class _StandIns(TorchDispatchMode):
    """Each ATen op's result stood in for by zeros of its shape, dtype and strides: no work done. The
    strides are the op's own (the op run on meta tensors), so what reads the stand-in takes the same path
    as in the first run (a reshape copies or views as it did). Views are taken as usual. Autograd, above
    this mode, records the ops and keeps what they read, as in the first run."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not tensors or any(returned.alias_info is not None for returned in func._schema.returns):
            return func(*args, **kwargs)
        shaped_args, shaped_kwargs = tree_map_only(torch.Tensor, lambda t: torch.empty_strided(
            t.shape, t.stride(), dtype=t.dtype, device="meta"), (args, kwargs))
        shaped = func(*shaped_args, **shaped_kwargs)
        return tree_map_only(torch.Tensor, lambda result: torch.empty_strided(
            result.shape, result.stride(), dtype=result.dtype, device=tensors[0].device).zero_(), shaped)


def recompute(rt, region, policy: str, *arguments):
    """`region(*arguments)`, its activations made again in backward (`policy`: "full" or "selective")."""
    if not torch.is_grad_enabled():
        return region(*arguments)
    selective = policy == "selective"
    kept_by_first_run: dict = {"collective": [], "product": []}
    runs = 0

    def run(*inputs):
        nonlocal runs
        runs += 1
        mode = ("keep" if runs == 1 else "replay") if selective else (None if runs == 1 else "again")
        with _running(rt, RegionRun(mode, kept_by_first_run) if mode else None):
            return region(*inputs)

    with set_checkpoint_early_stop(False):
        return checkpoint(run, *arguments, use_reentrant=False, preserve_rng_state=True)


@contextlib.contextmanager
def _running(rt, region: RegionRun | None):
    before, rt.region = rt.region, region
    try:
        yield
    finally:
        rt.region = before
