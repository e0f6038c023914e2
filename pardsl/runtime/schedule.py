"""Running a pipelined module: this rank's stages under torch.distributed.pipelining's schedule.

The generated module has a class per stage (`STAGES`) and a `PIPELINE` table; each rank builds the stages
its coordinate on the pipeline axis runs and hands them to torch's `PipelineStage` and schedule class,
which split the batch into micro-batches, send activations and gradients point to point over the
pipeline axis's process group, and order forwards and backwards. pardsl adds three things to torch's stage:

- it counts what it sends, per phase, in the runtime's counter (`send` over the pipeline axis, one per
  micro-batch and stage boundary, with the bytes of every tensor crossing it);
- a stage's gradient buckets (data parallelism, ZeRO, parameters read by sharded ops) are synchronised
  once per step, during the last micro-batch's backward, not once per micro-batch: earlier backwards hold
  their gradients (`sync_gradients`, `held_gradients`, read by pardsl/runtime/parameter_sync.py);
- shapes are known at compile time, so the stages are built with static metadata: nothing is exchanged
  to infer them.

After the schedule's step, the gradient of a parameter that several stages hold (tied embeddings) is
summed over the ranks that hold it: one all-reduce per such parameter per step.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed as dist

from pardsl.layouts.algebra import Layout, collective_bytes
from pardsl.runtime.schedules import schedule_class, stages_of_rank


def _meta(entry: tuple, mesh) -> torch.Tensor:
    """A stage's INPUTS or OUTPUTS row as the tensor torch's stage reads its static metadata from: this
    rank's shape, the dtype, whether a gradient goes with it (on the meta device: nothing allocated)."""
    _, layout, shape, dtype, grad = entry
    local = Layout.from_key(layout).local_shape(tuple(shape), mesh)
    return torch.empty(local, dtype=dtype, device="meta").requires_grad_(grad and dtype.is_floating_point)


def loss_output(outputs: list[tuple]) -> int | None:
    """Which of the last stage's OUTPUTS is the model's own loss: its one scalar with a gradient."""
    scalars = [index for index, (_, _, shape, dtype, grad) in enumerate(outputs)
               if not shape and dtype.is_floating_point and grad]
    return scalars[0] if len(scalars) == 1 else None


def _contiguous(x):
    return x.contiguous() if isinstance(x, torch.Tensor) and not x.is_contiguous() else x


@functools.cache
def _counted_stage():
    """The stage class, made on a pipelined rank's first use: importing torch.distributed.pipelining
    imports dynamo and DTensor, 1.5 s of every process's start on this CPU, which a rank without a
    pipeline has no use for."""
    from torch.distributed.pipelining import PipelineStage

    class CountedStage(PipelineStage):
        """torch's pipeline stage over a generated stage module: counts its sends, and synchronises
        gradients on the step's last backward only."""

        def __init__(self, module: torch.nn.Module, index: int, count: int, rt, axis: str):
            module.sync_gradients = True
            module.held_gradients = {}
            super().__init__(module, index, count, rt.device,
                             input_args=tuple(_meta(entry, rt.mesh) for entry in module.INPUTS),
                             output_args=tuple(_meta(entry, rt.mesh) for entry in module.OUTPUTS),
                             group=rt.groups[axis])
            self._counter = rt.counter
            self._axis = axis

        def _count(self, phase: str, ops: list) -> list:
            if ops:
                nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                self._counter.record(phase, "send", nbytes, self._axis)
            return ops

        # torch sends contiguous tensors only, and a stage's output, or its input's gradient, may be a
        # permuted view (Gemma 3n's AltUp streams): such a one is sent as a contiguous copy, kept where
        # torch keeps what it sends (the output in the forward's cache, through which backward still runs).
        # The copy is a stage's output over again until its backward, which the memory estimate leaves out.

        def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
            outputs, inputs = self.fwd_cache[fwd_chunk_id]
            self.fwd_cache[fwd_chunk_id] = (tuple(_contiguous(x) for x in outputs), inputs)
            return self._count("forward", super().get_fwd_send_ops(fwd_chunk_id))

        def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
            if bwd_chunk_id in self.bwd_cache:
                self.bwd_cache[bwd_chunk_id] = tuple(_contiguous(g) for g in self.bwd_cache[bwd_chunk_id])
            return self._count("backward", super().get_bwd_send_ops(bwd_chunk_id))

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
            self.submod.sync_gradients = last_backward
            try:
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            finally:
                self.submod.sync_gradients = True

    return CountedStage


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(self, generated, rt, modules: dict[int, torch.nn.Module], loss_fn, scale_grads: bool = True):
        """`loss_fn(stage output, target micro-batch)`; `scale_grads`: divide the gradients by the number of
        micro-batches (a loss that is a mean over its micro-batch), as torch's schedules do."""
        table = generated.PIPELINE
        self.axis = table["axis"]
        self.schedule_name = table["schedule"]
        self.microbatches = table["microbatches"]
        self.count = len(generated.STAGES)
        self.rt = rt
        self.modules = modules  # stage index → generated stage module, this rank's
        self.stages = [_counted_stage()(modules[i], i, self.count, rt, self.axis) for i in sorted(modules)]
        cls = schedule_class(table["schedule"])
        single = len(self.stages) == 1 and table["stages_per_rank"] == 1
        self.schedule = cls(self.stages[0] if single else self.stages, self.microbatches, loss_fn=loss_fn,
                            scale_grads=scale_grads)
        every = [(name, tuple(held)) for name, held in generated.SHARED_PARAMETERS]
        # groups are made on every rank, in one order (dist.new_group is collective), then kept where used
        groups = {held: self._group_of(held) for _, held in every}
        self.shared = [(name, held) for name, held in every if any(stage in modules for stage in held)]
        self._shared_groups = {held: groups[held] for _, held in self.shared}

    @staticmethod
    def of_rank(generated, rt) -> list[int]:
        table = generated.PIPELINE
        axis = table["axis"]
        return stages_of_rank(rt.coordinate[axis], rt.size[axis], len(generated.STAGES), table["schedule"])

    @property
    def is_first(self) -> bool:
        return 0 in self.modules

    @property
    def is_last(self) -> bool:
        return self.count - 1 in self.modules

    def _group_of(self, held: tuple[int, ...]):
        """The process group of the ranks along the pipeline axis that hold these stages (this rank's
        coordinates on the other axes): the axis's own group where that is every rank on it."""
        axis = self.axis
        size = self.rt.size[axis]
        ranks_on_axis = sorted({r for r in range(size) for stage in held
                                if stage in stages_of_rank(r, size, self.count, self.schedule_name)})
        if len(ranks_on_axis) == size:
            return self.rt.groups[axis]
        # dist.new_group is collective over the world: every rank creates every such group, in one order
        mesh = self.rt.mesh
        axis_index = mesh.axis_names.index(axis)
        mine = None
        others = [range(s) for i, s in enumerate(mesh.axis_sizes) if i != axis_index]
        for coordinate in itertools.product(*others):
            ranks = []
            for r in ranks_on_axis:
                full = list(coordinate)
                full.insert(axis_index, r)
                rank = 0
                for c, s in zip(full, mesh.axis_sizes):
                    rank = rank * s + c
                ranks.append(rank)
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine

    def step(self, inputs: list[torch.Tensor], target=None, return_outputs: bool = False):
        """One step over the whole batch: every micro-batch's forward and backward, in the schedule's
        order. Returns the micro-batch losses on the last stage's ranks (else None), and with
        `return_outputs` the last stage's outputs, the micro-batches' concatenated (else None)."""
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        if target is None:  # the model's own loss: torch's schedule still splits a target per micro-batch
            target = torch.zeros(self.microbatches, device=self.rt.device)
        args = inputs if self.is_first else ()
        outputs = self.schedule.step(*args, target=target, losses=losses, return_outputs=return_outputs)
        self._sum_shared_gradients()
        return losses, outputs

    def _sum_shared_gradients(self) -> None:
        """A tied parameter's gradient: the sum of every holding stage's, on each of them. The copies on
        this rank are added first, then one all-reduce over the holding ranks."""
        for name, held in self.shared:
            copies = [getattr(self.modules[i], self.modules[i].PARAMETERS[name][0]) for i in held if i in self.modules]
            grad = sum((p.grad for p in copies if p.grad is not None), torch.zeros_like(copies[0]))
            group = self._shared_groups[held]
            self.rt.counter.record("backward", "all_reduce", collective_bytes(
                "all_reduce", grad.numel() * grad.element_size(), group.size()), self.axis)
            dist.all_reduce(grad, group=group)
            for index, copy in enumerate(copies):
                copy.grad = grad if index == 0 else grad.clone()
