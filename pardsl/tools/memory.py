"""A rank's measured memory: the peak of the bytes its tensors hold during a step.

On CUDA the caching allocator counts it (`torch.cuda.max_memory_allocated`). A CPU allocator keeps no
such count, so on CPU each storage an ATen op makes during the step is counted from its making to its
freeing (a dispatch mode sees every op's results, a finalizer on the storage its end). Either way the
step's peak is what the rank held when it began — its parameters, buffers, gradients, optimizer state
and inputs — plus the most it made on top and held at once. The serial model in the same process is not
counted: it neither runs during the step nor belongs to the rank's plan.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageBytes(TorchDispatchMode):
    """Within the mode: the bytes of the storages its ops made that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        # a view, or an op that wrote in place, returns the storage of one of its operands: not a new one
        operands = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for tensor in tree_leaves(result):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in operands:
                    self._count(storage)
        return result

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or key in self._alive:
            return
        self._alive[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live -= self._alive.pop(key, 0)


def held_bytes(tensors) -> int:
    """The bytes of the distinct storages these tensors use."""
    storages = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class StepBytes:
    """A measured step's memory so far: called, its peak (what the rank held as it began plus the most it
    has made on top and held at once); `made_and_held()`, what it has made and still holds now."""

    def __init__(self, held: int, peak, live):
        self._held, self._peak, self._live = held, peak, live

    def __call__(self) -> int:
        return self._held + self._peak()

    def made_and_held(self) -> int:
        return self._live()


@contextlib.contextmanager
def peak_so_far(device: torch.device, held: int):
    """Within the block, a StepBytes of the step (`held`: what the rank holds as it begins, held_bytes)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield StepBytes(held, lambda: torch.cuda.max_memory_allocated(device) - start,
                        lambda: torch.cuda.memory_allocated(device) - start)
        return
    counting = _StorageBytes()
    with counting:
        yield StepBytes(held, lambda: counting.peak, lambda: counting.live)


@contextlib.contextmanager
def peak_measured(device: torch.device, held: int):
    """Within the block, the step to measure; `held`: what the rank holds as it begins (held_bytes).
    Yields a list that holds the step's peak in bytes once the block ends."""
    peak_bytes: list[int] = []
    with peak_so_far(device, held) as peak:
        yield peak_bytes
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        peak_bytes.append(peak())


def optimizer_state(optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer holds as its state (none for one without)."""
    state = getattr(optimizer, "state", {})
    return [value for per_parameter in state.values() for value in per_parameter.values()
            if isinstance(value, torch.Tensor)]
