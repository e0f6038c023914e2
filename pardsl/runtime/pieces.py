"""A piece of regional compilation (a function of the generated module, `self.pieces[k]`) compiled by
torch.compile, counting the collectives its graphs issue.

Where a piece holds conversions (collectives in the graphs), they are functional collectives inside the
compiled graph, out of the runtime's sight: the counter would miss them. So the first call with each input
signature runs the piece once more on fake tensors (no data, nothing sent), forward and backward, and logs
each collective's phase, kind, bytes and axis (runtime/functional.py). Every call then counts the logged
forward collectives, and the logged backward ones when its backward runs: exactly what the graphs issue,
at this call's sizes (a new size of a named dim is a new signature, logged again, as it is compiled again).
"""

from __future__ import annotations

import types

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

# what a fake run of a piece cannot do: an op whose result's shape or value is its data's (nonzero, item)
_NOT_FAKEABLE = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)

# what a piece calls on the runtime when it holds conversions (codegen: _CONVERSIONS_IN_GRAPHS); read from
# the names its code uses, which may also match an ATen op's (aten.split): such a piece is only run once
# more on fake tensors, logging nothing
_CONVERSIONS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "split", "grad_all_reduce"})


def collectives_in_graphs(backend: str) -> bool:
    """Where compiled pieces take in the conversions between them by default: on NCCL, whose functional
    collectives the compiler can overlap with the computation around them. On gloo the runtime's own CPU
    transports (runtime/collectives.py) are faster than gloo's collectives, which functional ones go
    through."""
    return backend == "nccl"


def compile_pieces(module: types.ModuleType, backend: str = "inductor") -> types.ModuleType:
    """The generated module with each of its pieces (codegen.render(..., pieces=True)) compiled by
    torch.compile: once per distinct piece and input shape, shared by every layer that calls it
    (dynamic=False: a new size of a named dim compiles it once more), counting the collectives inside.
    `backend`: torch.compile's (check_backend)."""
    if hasattr(module, "PIECES"):  # a forward with no run of ATen ops long enough has none
        module.PIECES[:] = [CompiledPiece(piece, backend) for piece in module.PIECES]
    return module


def check_backend(backend: str) -> str | None:
    """Why `backend` is no torch.compile backend, or None. Besides "inductor" (generated kernels),
    "aot_eager" captures the same graphs, forward and backward, and runs their ATen ops as they are: what
    to compare with when a compiled run differs, and a quick check that a plan compiles whole."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend in known:
        return None
    return f"no torch.compile backend is named {backend!r} (inductor, aot_eager, eager, ...)"


class CompiledPiece:
    def __init__(self, piece, backend: str = "inductor"):
        self.piece = piece
        self.compiled = torch.compile(piece, dynamic=False, backend=backend)
        self.converts = bool(_CONVERSIONS & set(piece.__code__.co_names))
        # per input signature: its (forward, backward) collectives, or None where the piece runs eagerly
        self.logged: dict[tuple, tuple[list, list] | None] = {}

    def __call__(self, rt, *args):
        if not self.converts:
            return self.compiled(rt, *args)
        signature = tuple((tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else a
                          for a in args)
        if signature not in self.logged:
            self.logged[signature] = self._log(rt, args)
        if self.logged[signature] is None:
            # its collectives cannot be known ahead: run as written, each collective counted as it is issued
            return self.piece(rt, *args)
        forward, backward = self.logged[signature]
        for collective in forward:
            rt.counter.record("forward", *collective)
        results = self.compiled(rt, *args)
        if backward:
            _count_backward(rt, backward, results)
        return results

    def _log(self, rt, args) -> tuple[list, list] | None:
        """The piece's collectives for these arguments' shapes: it runs on fake tensors, forward and then
        backward from zero gradients of its results, its conversions logging what they issue. None where an
        op of the piece cannot run on fake tensors (its result's shape is its data's)."""
        rt.piece_log = []
        try:
            with FakeTensorMode() as mode:
                fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                results = [r for r in self.piece(rt, *fakes) if isinstance(r, torch.Tensor) and r.requires_grad]
                inputs = [a for a in fakes if isinstance(a, torch.Tensor) and a.requires_grad]
                if results and inputs:
                    torch.autograd.grad(results, inputs, [torch.zeros_like(r) for r in results], allow_unused=True)
            logged = rt.piece_log
        except _NOT_FAKEABLE:
            return None
        finally:
            rt.piece_log = None
        return ([entry[1:] for entry in logged if entry[0] == "forward"],
                [entry[1:] for entry in logged if entry[0] == "backward"])


def _count_backward(rt, backward: list, results) -> None:
    """Count `backward` once, when the gradient of the first of `results` to receive one is computed: the
    compiled graph's backward runs then."""
    counted = []

    def count(grad):
        if not counted:
            counted.append(True)
            for collective in backward:
                rt.counter.record("backward", *collective)
        return grad

    for result in results:
        if isinstance(result, torch.Tensor) and result.requires_grad:
            result.register_hook(count)
