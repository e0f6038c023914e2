"""Parameter communication off the critical path: gradients in buckets, all-gathers ahead of use.

The generated module lists, as data, the parameters it all-gathers before use (`PARAMETER_GATHERS`, in
forward order) and the buckets its parameters' gradients are synchronised in (`GRADIENT_BUCKETS`, in the
order backward fills them). Each forward makes one `ParameterSync`, which its backward finishes: state
never outlives a step, and a copy of the module shares none:

- **gradients** (DDP's reducer, FSDP's reduce-scatter): each parameter's partial gradient is handed to
  its bucket as backward produces it, copied at once into its place in the bucket's one buffer (DDP's
  copy, made while the gradient is still in cache, and the gradient freed), so that when a bucket's last
  gradient arrives, the bucket's one collective (an all-reduce, or a reduce-scatter back to the shards)
  is issued on that buffer asynchronously and backward goes on. On a shared-memory transport the buffer
  lies where the peers read it (`Runtime.collective_input`), so the collective copies it no further;
  a gradient partial over further axes as well is all-reduced over them once that has finished.
  At the end of backward (a callback queued on autograd's engine) every bucket is waited on and its
  results added to the parameters' `.grad`. Each backward's contribution is reduced on its own and added,
  so accumulating gradients over several backwards before a step stays exact. A pipeline stage
  (`pardsl/runtime/schedule.py`) instead holds each micro-batch's gradients until the step's last backward, whose
  buckets carry their sum: one collective per bucket per step, not per micro-batch;
- **all-gathers** (FSDP's units and forward prefetch): parameters are gathered in groups (a layer's, or
  consecutive ones outside the layers), one all-gather per group; when the forward takes group k, the
  all-gather of group k + 1 is issued asynchronously, so it moves while group k's ops compute;
- **reshard after forward** (pardsl/passes/reshard.py): under `resharded_after_forward`, autograd keeps a
  resharded group's gathered weights as their place in the group (saved-tensor hooks) while the forward
  drops them after use; backward gathers the group again when it first needs one, and issues the
  all-gather of the resharded group before it meanwhile. A recomputed layer (pardsl/runtime/recompute.py)
  gathers its group again the same way when backward runs its forward again.

The autograd function that carries a parameter's gradient into a bucket returns no gradient for the
parameter itself: the bucket writes `.grad` once the collective has finished.

**Offload** (pardsl/passes/offload.py): the module's parameters are the float32 masters in host memory
(pinned on CUDA), which the optimizer steps there. `fetch` gives an op its device copy (in the compute
dtype under a mixed-precision policy), and a gather group is gathered from the device copies of its
shards. Under `offload optimizer` each device copy stays between steps and is written again only after
its master may have changed (an optimizer step, an in-place write, new storage); under `offload
parameters` it is made for each use and dropped after. Gradients go to the masters' `.grad` on the host:
a bucket's result is copied out once waited on, the others by the fetch's backward.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from typing import NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from pardsl.layouts.algebra import block_major, collective_bytes, rank_major


class ParameterSync:
    def __init__(self, rt, module: torch.nn.Module, gathers: list[tuple], buckets: list[tuple],
                 precision: tuple[torch.dtype, torch.dtype] | None = None, offload: str | None = None):
        self.rt = rt
        self.offload = offload  # None, "optimizer" (device copies kept between steps) or "parameters"
        # a mixed-precision policy's: parameters gathered in the first dtype, gradients reduced in the second
        self.compute_dtype, self.reduce_dtype = precision if precision is not None else (None, None)
        self._module = module
        self.gathers = gathers  # groups in forward order: (axis, [(parameter attribute, dim, blocks), ...])
        self.buckets = buckets  # (collective, axes, [(parameter attribute, dim, blocks), ...])
        # per bucket, this backward's: the buffer its gradients are copied into (allocated at the first), and
        # the members that have arrived with their gradients' shapes
        self._buffers: list[torch.Tensor | None] = [None] * len(buckets)
        self._arrived: list[dict[int, torch.Size]] = [{} for _ in buckets]
        self._offsets: list[list[int]] | None = None  # per bucket, where each member's columns start
        # (bucket, work, a function giving its result once waited on, [(member, gradient shape)]), in launch order
        self._launched: list[tuple] = []
        self._backward: int | None = None  # the autograd graph task whose gradients are arriving
        self._prefetched: tuple[int, object, torch.Tensor] | None = None  # (group, work, buffer)
        self._current: tuple[int, list[torch.Tensor]] | None = None  # the group being used: its parameters whole
        self._resharded: dict[int, bool] = {}  # group → whether backward gathers it again; in backward's order
        # storage → (group, base, the base tensor, weakly): the resharded groups gathered in this forward
        self._holding: dict[int, tuple[int, int, weakref.ref]] = {}
        # backward: the group gathered again, its bases and its members whole
        self._regathered: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._prefetched_backward: tuple[int, object, torch.Tensor] | None = None

    @functools.cached_property
    def _held(self) -> dict | None:
        """A pipeline stage's gradients held until the step's last backward (pardsl/runtime/schedule.py), else None;
        looked up once (a module's missing attribute is an exception caught, on every gradient otherwise)."""
        return getattr(self._module, "held_gradients", None)

    def _parameter(self, attr: str) -> torch.nn.Parameter:
        return getattr(self._module, attr)

    # -- offload: host masters, device copies ---------------------------------------------------------

    def fetch(self, parameter: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An offloaded parameter's device copy, in `dtype` where given; backward hands its gradient to the
        master on the host."""
        return _Fetched.apply(parameter, self, dtype)

    def _on_device(self, parameter: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """The device copy of `parameter` (not tracked by autograd): the master itself where the host is
        the device and the dtypes agree (CPU ranks without a policy), else kept between steps under
        `offload optimizer` and made now under `offload parameters`."""
        dtype = parameter.dtype if dtype is None else dtype
        master = parameter.detach()
        if master.device == self.rt.device and master.dtype == dtype:
            return master
        if self.offload != "optimizer":
            return master.to(self.rt.device, dtype, non_blocking=True)
        copies = self._module.device_copies  # id(master) → _DeviceCopy
        known = copies.get(id(parameter))
        if known is None or known.master() is not parameter or known.copy.dtype != dtype:
            known = _DeviceCopy(weakref.ref(parameter), None, torch.empty(master.shape, dtype=dtype,
                                                                          device=self.rt.device))
        state = _master_state(parameter)
        if known.state != state:  # an optimizer stepped (or a checkpoint was loaded) since it was copied
            known.copy.copy_(master, non_blocking=True)
            known = known._replace(state=state)
        copies[id(parameter)] = known
        return known.copy

    def _gather_source(self, attr: str) -> torch.Tensor:
        """What a gather group's all-gather sends of one member: its shard, on the device where offloaded."""
        parameter = self._parameter(attr)
        if self.offload is None:
            return parameter.detach()
        return self._on_device(parameter, self.compute_dtype)

    # -- forward: all-gathers by group, the next group prefetched -----------------------------------

    def all_gather(self, parameter: torch.Tensor, group: int, item: int, bucket: int | None = None,
                   member: int = 0) -> torch.Tensor:
        """Parameter `item` of gather group `group`, whole on the group's axis. Backward: the gradient goes to
        `bucket` to be reduce-scattered; without a bucket, this rank's slice of it is the gradient."""
        return _GatheredParameter.apply(parameter, self, group, item, bucket, member)

    def _gathered(self, group: int, item: int) -> torch.Tensor:
        region = self.rt.region
        if region is None or region.mode == "keep":
            return self._taken(group, item)
        # a recomputed layer's forward run again in backward: its group gathered again there, as a
        # resharded group's is for backward, and nothing of the forward's prefetching touched
        self._gathered_again(group)
        return self._regathered[2][item]

    def _taken(self, group: int, item: int) -> torch.Tensor:
        if item == 0 or self._current is None or self._current[0] != group:  # the forward takes items in order
            buffer = self._take(group)
            wholes = self._unpack(group, buffer)
            self._current = (group, wholes)
            if group in self._resharded:
                for base, tensor in enumerate(_bases(wholes)):
                    self._holding[tensor.untyped_storage().data_ptr()] = (group, base, weakref.ref(tensor))
            if group + 1 < len(self.gathers):
                self._prefetched = (group + 1, *self._issue_gather(group + 1))
        return self._current[1][item]

    # -- reshard after forward ----------------------------------------------------------------------

    def resharded_after_forward(self, groups: list[tuple[int, bool]]):
        """A context for the forward: `groups` are (group, gathered again for backward)."""
        self._resharded = dict(groups)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack_saved)

    def _pack(self, tensor: torch.Tensor):
        place = self._holding.get(tensor.untyped_storage().data_ptr()) if self._holding else None
        # A group stays in `_holding` after the next is taken: a weight read again later in the forward (a
        # tied head's) is kept by its place too. Its base alive means its storage is; once the base is freed,
        # the address may be any tensor's.
        if place is None or place[2]() is None:
            return tensor.detach()  # not the tensor itself: an op's saved output would hold its own node
        return _InGroup(place[0], place[1], tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def _unpack_saved(self, packed):
        if not isinstance(packed, _InGroup):
            return packed
        return self._gathered_again(packed.group)[packed.base].as_strided(packed.shape, packed.stride, packed.offset)

    def _gathered_again(self, group: int) -> list[torch.Tensor]:
        """Backward: the group whole again (the same bases, in the same layout as forward's), and the
        all-gather of the resharded group before it issued."""
        if self._regathered is not None and self._regathered[0] == group:
            return self._regathered[1]
        self._regathered = None  # the group after it is done with
        pending, self._prefetched_backward = self._prefetched_backward, None
        if pending is not None and pending[0] == group:
            _, work, buffer = pending
        else:
            if pending is not None:
                pending[1].wait()
            work, buffer = self._issue_gather(group, "backward")
        work.wait()
        wholes = self._unpack(group, buffer)
        self._regathered = (group, _bases(wholes), wholes)
        # the next group backward gathers again (`_resharded` is in backward's order)
        order = [g for g, again in self._resharded.items() if again]
        after = order[order.index(group) + 1:] if group in order else []
        if after:
            self._prefetched_backward = (after[0], *self._issue_gather(after[0], "backward"))
        return self._regathered[1]

    def _take(self, group: int):
        """The group's gathered buffer: its prefetched all-gather waited on, or issued now."""
        pending, self._prefetched = self._prefetched, None
        if pending is not None and pending[0] == group:
            _, work, buffer = pending
        else:
            if pending is not None:  # groups are taken in order, so only a group skipped gets here
                pending[1].wait()
            work, buffer = self._issue_gather(group)
        work.wait()
        return buffer

    def _issue_gather(self, group: int, phase: str = "forward"):
        axis, members = self.gathers[group]
        n = self.rt.size[axis]
        flat = torch.cat([self._gather_source(attr).movedim(dim, 0).reshape(-1) for attr, dim, _ in members])
        if self.compute_dtype is not None:  # gathered as computed: half the bytes of float32 masters in bf16
            flat = flat.to(self.compute_dtype)
        buffer = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
        self.rt.counter.record(phase, "all_gather", collective_bytes("all_gather", _nbytes(flat), n), axis)
        work = self.rt.all_gather_started(buffer, flat, axis)
        return work, buffer.view(n, flat.numel())

    def _unpack(self, group: int, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Rank-major [n, every member's shard] → each member whole, in its own layout."""
        axis, members = self.gathers[group]
        n = self.rt.size[axis]
        wholes, offset = [], 0
        for attr, dim, blocks in members:
            shard = self._parameter(attr).movedim(dim, 0)
            numel = shard.numel()
            whole = buffer[:, offset:offset + numel].reshape(n * shard.shape[0], *shard.shape[1:])
            offset += numel
            wholes.append(block_major(whole, n, blocks).movedim(0, dim))
        return wholes

    # -- backward: gradients in buckets -------------------------------------------------------------

    def grad_all_reduce(self, parameter: torch.Tensor, bucket: int, member: int) -> torch.Tensor:
        """Identity forward; backward hands the parameter's partial gradient to its all-reduce bucket."""
        return _BucketedGradient.apply(parameter, self, bucket, member)

    def arrive(self, bucket: int, member: int, grad: torch.Tensor) -> None:
        held = self._held
        if held is not None:  # a pipeline stage: micro-batches before the step's last hold their gradients
            # summed over micro-batches in the dtype they are reduced in, into a copy of the first this
            # rank owns: each later one is added in place, one gradient beside the sum rather than two (a
            # gradient autograd hands over may be another tensor's, an input's sent to the stage before)
            dtype = self.reduce_dtype or grad.dtype
            key = (bucket, member)
            if not self._module.sync_gradients:
                if key in held:
                    held[key].add_(grad)
                else:
                    held[key] = grad.to(dtype, copy=True)
                return
            if key in held:
                grad = held.pop(key).add_(grad)
        backward = torch._C._current_graph_task_id()
        if self._backward != backward:
            # the first gradient of this backward; what an earlier one left (it raised before its end)
            # is dropped, as autograd drops that backward's gradients
            self._buffers = [None] * len(self.buckets)
            self._arrived = [{} for _ in self.buckets]
            for _, work, _, _ in self._launched:
                if work is not None:
                    work.wait()
            self._launched = []
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._backward = backward
        kind, axes, members = self.buckets[bucket]
        n = 1 if kind == "all_reduce" else self.rt.size[axes[0]]
        if self._buffers[bucket] is None:
            # one row of every member's gradient (all-reduce), or n rows of its rank-major chunks
            # (reduce-scatter, chunk r in row r): a member's place is its parameter's size, in member order
            columns = sum(self._parameter(attr).numel() for attr, _, _ in members)
            like = grad if self.reduce_dtype is None else grad.new_empty(0, dtype=self.reduce_dtype)
            self._buffers[bucket] = self.rt.collective_input(axes[0], (n, columns), like)
        if kind == "all_reduce":
            shaped = grad.reshape(1, -1)
        else:
            _, dim, blocks = members[member]
            shaped = rank_major(grad.movedim(dim, 0), n, blocks).reshape(n, -1)
        place = self._place(bucket, member)
        arrived = self._arrived[bucket]
        if member in arrived:  # a second contribution in the same backward
            place.add_(shaped)
        else:
            place.copy_(shaped)
            arrived[member] = grad.shape
        if len(arrived) == len(members):
            self._launch(bucket)

    def _place(self, bucket: int, member: int) -> torch.Tensor:
        """Where the member's gradient lies in the bucket's buffer."""
        columns = self._columns(bucket, member)
        return self._buffers[bucket].narrow(1, columns.start, columns.stop - columns.start)

    def _columns(self, bucket: int, member: int) -> slice:
        """The member's columns in its bucket's buffer: its parameter's size, after the members before it."""
        if self._offsets is None:
            self._offsets = [list(itertools.accumulate((self._parameter(attr).numel() for attr, _, _ in members),
                                                       initial=0)) for _, _, members in self.buckets]
        offsets = self._offsets[bucket]
        return slice(offsets[member], offsets[member + 1])

    def _launch(self, bucket: int) -> None:
        kind, axes, members = self.buckets[bucket]
        shapes = sorted(self._arrived[bucket].items())
        buffer = self._buffers[bucket]
        self._arrived[bucket], self._buffers[bucket] = {}, None
        if len(shapes) < len(members):  # gradients that never came (_finish): only those that did are sent
            buffer = torch.cat([buffer[:, self._columns(bucket, m)] for m, _ in shapes], dim=1)
        axis = axes[0]  # the further axes are all-reduced once it has finished (_finish)
        n = self.rt.size[axis]
        self.rt.counter.record("backward", kind, collective_bytes(kind, _nbytes(buffer), n), axis)
        if kind == "all_reduce":
            work, summed = self.rt.all_reduce_started(buffer.view(-1), axis)
        else:
            work, summed = self.rt.reduce_scatter_started(buffer.view(-1), axis)
        self._launched.append((bucket, work, summed, shapes))
        if kind == "reduce_scatter":
            self._let_go_of_sent_buckets()

    def _let_go_of_sent_buckets(self) -> None:
        """A reduce-scatter's input is its bucket's whole gradients: beyond the two buckets sent last (still
        overlapping backward), the oldest is waited for and its input let go, as FSDP frees it, so a rank
        holds the whole gradients of at most three buckets at once (cost.IN_FLIGHT_BUCKETS)."""
        sent = [index for index, (_, work, _, _) in enumerate(self._launched) if work is not None]
        for index in sent[:-2]:
            bucket, work, reduced, shapes = self._launched[index]
            if self.buckets[bucket][0] != "reduce_scatter":
                continue
            work.wait()
            result = reduced()
            self._launched[index] = (bucket, None, lambda result=result: result, shapes)

    def _finish(self) -> None:
        """End of backward: issue what did not fill (gradients that never came), wait, write `.grad`."""
        self._backward = None
        self._regathered = None
        if self._prefetched_backward is not None:  # a group gathered again that no backward op read after all
            self._prefetched_backward[1].wait()
            self._prefetched_backward = None
        for bucket, arrived in enumerate(self._arrived):
            if arrived:
                self._launch(bucket)
        launched, self._launched = self._launched, []
        copied_out = False
        for bucket, work, reduced, shapes in launched:
            if work is not None:  # else waited for already, its input let go (_let_go_of_sent_buckets)
                work.wait()
            result = reduced()
            kind, axes, members = self.buckets[bucket]
            for axis in axes[1:]:  # a gradient partial over several axes: the further ones in turn
                self.rt.counter.record("backward", "all_reduce",
                                       collective_bytes("all_reduce", _nbytes(result), self.rt.size[axis]), axis)
                work, summed = self.rt.all_reduce_started(result, axis)
                work.wait()
                result = summed()
            offset = 0
            for member, full_shape in shapes:
                attr, dim, _ = members[member]
                parameter = self._parameter(attr)
                numel = math.prod(full_shape) // (self.rt.size[axes[0]] if kind == "reduce_scatter" else 1)
                piece = result[offset:offset + numel]
                offset += numel
                if kind == "reduce_scatter":
                    moved_shape = list(torch.Size(full_shape)[dim:dim + 1] + full_shape[:dim] + full_shape[dim + 1:])
                    moved_shape[0] //= self.rt.size[axes[0]]
                    grad = piece.view(moved_shape).movedim(0, dim)
                else:
                    grad = piece.view(full_shape)
                if grad.device != parameter.device:  # an offloaded master's: copied out to the host
                    grad, copied_out = _to_host(grad, parameter), True
                elif grad.dtype != parameter.dtype:  # reduced in another dtype than the master's
                    grad = grad.to(parameter.dtype)
                if parameter.grad is None:
                    parameter.grad = grad if grad.is_contiguous() else grad.contiguous()
                else:
                    parameter.grad.add_(grad)
        if copied_out and self.rt.device.type == "cuda":
            torch.cuda.current_stream(self.rt.device).synchronize()  # the host steps on these next


class _DeviceCopy(NamedTuple):
    """An offloaded master's copy on the device, kept between steps, and the master's state it was made at."""

    master: weakref.ref
    state: tuple[int, int, int] | None
    copy: torch.Tensor


# optimizer steps taken in this process, by any optimizer; None until a device copy is first kept
_OPTIMIZER_STEPS: list[int] | None = None


def _count_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


def _master_state(master: torch.Tensor) -> tuple[int, int, int]:
    """What changes when a master's values may have: an optimizer step, an in-place write, new storage.
    torch's fused optimizer steps leave a tensor's version counter as it was, so a step is known by a
    hook on every optimizer's step, registered when the first device copy is kept."""
    global _OPTIMIZER_STEPS
    if _OPTIMIZER_STEPS is None:
        _OPTIMIZER_STEPS = [0]
        register_optimizer_step_post_hook(_count_step)
    return _OPTIMIZER_STEPS[0], master._version, master.data_ptr()


def _to_host(grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """A device gradient copied into host memory as `master`'s (pinned where CUDA is there, so the copy
    does not hold the host up; the end of backward waits for it)."""
    host = torch.empty(grad.shape, dtype=master.dtype, device=master.device, pin_memory=grad.is_cuda)
    return host.copy_(grad, non_blocking=True)


class _InGroup(NamedTuple):
    """A saved tensor that is a view of a resharded group's gathered parameters: where it lies in them."""

    group: int
    base: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _bases(wholes: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage that holds a gathered group's members whole: the all-gather's buffer where a
    member is a view of it, each member made whole by a copy (a group of several, or blocks); in a fixed
    order, so backward's gather of the group finds each saved view's storage at the same place. Only what
    the group's members keep alive: a freed storage's address may be reused by any tensor."""
    bases, seen = [], set()
    for tensor in wholes:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in seen:
            seen.add(pointer)
            bases.append(tensor)
    return bases


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class _BucketedGradient(torch.autograd.Function):
    """Megatron's f for a parameter: identity forward; backward, the partial gradient joins its bucket."""

    @staticmethod
    def forward(ctx, parameter, sync, bucket, member):
        ctx.sync, ctx.bucket, ctx.member = sync, bucket, member
        return parameter.view_as(parameter)

    @staticmethod
    def backward(ctx, grad):
        ctx.sync.arrive(ctx.bucket, ctx.member, grad)
        return None, None, None, None


class _Fetched(torch.autograd.Function):
    """An offloaded parameter on the device. Backward: its gradient copied to the master's device and dtype."""

    @staticmethod
    def forward(ctx, parameter, sync, dtype):
        ctx.device, ctx.dtype = parameter.device, parameter.dtype
        copy = sync._on_device(parameter, dtype)
        return copy.view_as(copy)  # a view: the copy kept between steps carries no step's graph

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.device, ctx.dtype), None, None


class _GatheredParameter(torch.autograd.Function):
    """S(d) → B of a parameter, prefetched. Backward: reduce-scatter in a bucket (the gradient is partial
    over the axis), or this rank's slice (it is whole on every rank)."""

    @staticmethod
    def forward(ctx, parameter, sync, group, item, bucket, member):
        ctx.sync, ctx.group, ctx.item, ctx.bucket, ctx.member = sync, group, item, bucket, member
        ctx.device = parameter.device  # an offloaded master's is the host
        return sync._gathered(group, item)

    @staticmethod
    def backward(ctx, grad):
        sync = ctx.sync
        if ctx.bucket is not None:
            sync.arrive(ctx.bucket, ctx.member, grad)
            return None, None, None, None, None, None
        axis, members = sync.gathers[ctx.group]
        _, dim, blocks = members[ctx.item]
        return sync.rt._slice(grad, axis, dim, blocks).to(ctx.device), None, None, None, None, None
