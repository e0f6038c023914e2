"""The model's initial values, one tensor at a time: what the factory gives under the current seed, without
building the whole model.

The factory runs once on the meta device, where its tensors take no memory: a dispatch mode makes each
tensor a factory function asks for there (not a device context, which Hugging Face's models take as a
reason to skip their weights' initialisation), and writes down every op made on them: each as its function, its arguments
(a meta tensor as its storage and the view of it the op took), and for a random op (one torch tags
`nondeterministic_seeded`) the state of the CPU generator before it. A random op also runs once on a
real scratch tensor of its view's shape, so the generator advances exactly as in the serial model's
build, and the seed the program sees afterwards is serial's too.

A parameter's value is then made again from the record: the op that made its storage, and every op that
wrote to it after, in order, each random one from its own generator state; a value an op read from
another storage (a temporary drawn and copied in, a tied weight) is made the same way, as it was at that
point. So a rank holds one whole tensor at a time, and the values equal serial's bit for bit: the same
ops run on the same generator states.

Buffers are not made here: the traced model's values of them (`BoundPlan.buffer_values`) are used. A
factory that needs values while it builds (a `.item()`, data-dependent Python) cannot run on meta:
`record` raises, and the caller builds the whole model instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map


@dataclass(frozen=True)
class _View:
    """A meta tensor as an op took it: its storage (by key) and its geometry."""

    storage: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    generator_state: torch.Tensor | None  # the CPU generator's, before a random op


class InitRecord:
    """What a factory did to its tensors (`record`), and each parameter's value made again from it."""

    def __init__(self):
        self.ops: list[_Op] = []
        self.made_by: dict[int, tuple[int, int]] = {}  # storage → (op index, output position)
        self.writes: dict[int, list[int]] = {}  # storage → the ops that wrote to it, in order
        self._storages: list = []  # held, so that no key is reused while the record lives
        self.model: torch.nn.Module | None = None

    def write(self, function, tensor: torch.Tensor, args: tuple, kwargs: dict, state: torch.Tensor) -> None:
        """An op that writes `tensor` in place: `function(tensor, *args, **kwargs)` from generator `state`."""
        self.writes.setdefault(_key(tensor), []).append(len(self.ops))
        self.ops.append(_Op(function, (_view_of(tensor), *tree_map(_as_view, args)), tree_map(_as_view, kwargs), state))

    def value(self, tensor: torch.Tensor) -> torch.Tensor:
        """The real value of one of the model's meta tensors (a parameter), as the factory left it."""
        view = _view_of(tensor)
        base = self._storage_value(view.storage, len(self.ops))
        return torch.as_strided(base, view.size, view.stride, view.offset)

    def _storage_value(self, storage: int, before: int) -> torch.Tensor:
        """The storage as the ops before index `before` left it: a real tensor over all of it."""
        if storage not in self.made_by:
            raise RuntimeError("a tensor the factory did not make on the meta device")
        index, position = self.made_by[storage]
        outputs = self._run(self.ops[index], index, own=None)
        made = tree_flatten(outputs)[0][position]
        base = torch.as_strided(made, (made.untyped_storage().nbytes() // made.element_size(),), (1,), 0)
        for write in self.writes.get(storage, []):
            if index < write < before:
                self._run(self.ops[write], write, own=(storage, base))
        return base

    def _run(self, op: _Op, index: int, own):
        """Run one recorded op for real: its meta views mapped to real tensors (`own`: the storage being made
        and its base; any other storage as it was before this op), on CPU, from its generator state."""
        def real(value):
            if isinstance(value, _View):
                base = own[1] if own is not None and value.storage == own[0] else self._storage_value(value.storage, index)
                return torch.as_strided(base, value.size, value.stride, value.offset)
            if isinstance(value, torch.device) and value.type == "meta":
                return torch.device("cpu")
            return value

        args, kwargs = tree_map(real, op.args), tree_map(real, op.kwargs)
        if op.generator_state is not None:
            torch.set_rng_state(op.generator_state)
        return op.func(*args, **kwargs)


class _Recording(TorchDispatchMode):
    def __init__(self, record: InitRecord):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(isinstance(t, torch.Tensor) for t in tree_flatten(args)[0]) and \
                any(a.name == "device" for a in func._schema.arguments):
            kwargs = {**kwargs, "device": torch.device("meta")}  # a factory: its tensor made on meta
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if _is_meta(t)}
        on_meta = bool(inputs) or kwargs.get("device") == torch.device("meta")
        random = on_meta and torch.Tag.nondeterministic_seeded in func.tags
        state = torch.get_rng_state() if random else None
        if random:  # the generator advances as in serial's build: the op once on real scratch of its shape
            if kwargs.get("generator") is not None:
                raise NotImplementedError("a random op with a generator of its own")
            func(*tree_map(_scratch, args), **tree_map(_scratch, kwargs))
            give_back_freed_memory()
        result = func(*args, **kwargs)
        outputs = tree_flatten(result)[0]
        if inputs or any(_is_meta(t) for t in outputs):  # an op on real tensors alone makes no meta value
            self._write_down(func, args, kwargs, state, inputs, outputs)
        return result

    def _write_down(self, func, args, kwargs, state, inputs, outputs) -> None:
        record = self.record
        index = len(record.ops)
        op = _Op(func, tree_map(_as_view, args), tree_map(_as_view, kwargs), state)
        record.ops.append(op)
        for position, output in enumerate(outputs):
            if _is_meta(output) and _key(output) not in inputs and _key(output) not in record.made_by:
                record.made_by[_key(output)] = (index, position)
                record._storages.append(output.untyped_storage())
        written = [value for argument, value in zip(func._schema.arguments, args) if _writes(argument)]
        written += [kwargs[a.name] for a in func._schema.arguments if a.name in kwargs and _writes(a)]
        for value in written:
            if _is_meta(value):
                record.writes.setdefault(_key(value), []).append(index)


# torch's initialisers that leave a meta tensor as it is (its own guard), and what they are called in
# modules that keep their own reference to them
_SKIPPING_META = ("orthogonal_", "trunc_normal_", "dirac_", "sparse_")


@contextlib.contextmanager
def _initialisers_written_down(made: InitRecord):
    """Within the block, an initialiser that skips meta tensors runs once on real scratch of the tensor's
    shape (the generator advances as serial's) and is written down as one op that writes the tensor."""
    holders = [torch.nn.init.__dict__]
    hugging_face = sys.modules.get("transformers.initialization")
    if hugging_face is not None and isinstance(getattr(hugging_face, "TORCH_INIT_FUNCTIONS", None), dict):
        holders.append(hugging_face.TORCH_INIT_FUNCTIONS)
    originals = [(holder, name, holder[name]) for holder in holders for name in _SKIPPING_META if name in holder]

    def written_down(original):
        def initialise(tensor, *args, **kwargs):
            if not _is_meta(tensor):
                return original(tensor, *args, **kwargs)
            if kwargs.get("generator") is not None:
                raise NotImplementedError(f"{original.__name__} with a generator of its own")
            state = torch.get_rng_state()
            with _disable_current_modes():  # real scratch: the recording would make it on meta
                original(_scratch(tensor), *args, **kwargs)
            give_back_freed_memory()
            made.write(original, tensor, args, kwargs, state)
            return tensor
        return initialise

    for holder, name, original in originals:
        holder[name] = written_down(original)
    try:
        yield
    finally:
        for holder, name, original in originals:
            holder[name] = original


def record(factory: Callable[[], torch.nn.Module]) -> InitRecord:
    """Run `factory()` on the meta device and write down what it did (InitRecord); the CPU generator ends
    where serial's build leaves it."""
    made = InitRecord()
    with _initialisers_written_down(made), _Recording(made):
        model = factory()
    made.model = model
    return made


@contextlib.contextmanager
def generator_kept():
    """The CPU generator as it is now, again after the block (making values sets it to recorded states)."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to ask
        return None


_LIBC = _libc()


def give_back_freed_memory() -> None:
    """Return the memory of freed tensors to the system. glibc keeps a freed block below its mmap threshold
    for reuse, and raises the threshold to the size of each large block freed: after a few tensors of a
    size are made and freed, the next ones come from the heap, which keeps their pages, and a rank making
    a 200 M-parameter model's values one at a time grew as if it held them all (1.1 GiB against 0.5)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def _writes(argument) -> bool:
    return argument.alias_info is not None and argument.alias_info.is_write


def _is_meta(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _view_of(tensor: torch.Tensor) -> _View:
    return _View(_key(tensor), tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def _as_view(value):
    return _view_of(value) if _is_meta(value) else value


def _scratch(value):
    """A real tensor of a meta tensor's geometry (its values do not matter), for a random op to draw into."""
    if _is_meta(value):
        span = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride())) if value.numel() else 0
        return torch.empty(span, dtype=value.dtype).as_strided(tuple(value.shape), tuple(value.stride()), 0)
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    return value


class InitialValues(Mapping):
    """Every parameter of a recorded model by every name (tied weights under each), each made when asked
    for and not kept; and the buffers' values given (the traced model's)."""

    def __init__(self, made: InitRecord, buffers: dict[str, torch.Tensor]):
        self._made = made
        self._parameters = dict(made.model.named_parameters(remove_duplicate=False))
        self._buffers = buffers

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._parameters:
            parameter = self._parameters[name].detach()
            if not _is_meta(parameter):  # made from real data (`torch.tensor([...])`): its value is there
                return parameter
            give_back_freed_memory()  # the value asked for before, freed by the caller since
            with generator_kept():
                return self._made.value(parameter)
        return self._buffers[name]

    def __iter__(self):
        return iter([*self._parameters, *(name for name in self._buffers if name not in self._parameters)])

    def __len__(self) -> int:
        return len(set(self._parameters) | set(self._buffers))
