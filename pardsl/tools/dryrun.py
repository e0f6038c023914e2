"""A dry run: one rank's real program at its real size, in this process, with nothing sent.

`pardsl dryrun FILE.par --rank R` builds rank R's shards of every parameter at their real shapes (empty
storage: values are not initialised, so it starts in seconds at any size), makes its local inputs, and
runs training steps — forward, backward, an AdamW step — with every collective answered by torch's fake
process group (`torch.testing._internal.distributed.fake_pg`: each call returns at once and moves
nothing). What it measures is what that rank would hold and issue on the cluster: its peak memory after
each phase (CUDA: the allocator's; CPU: pardsl/tools/memory.py's count of tensor storage), each phase's
time on this device, and the collectives it issued, kind by kind and axis by axis, against the plan's.
Values are whatever empty storage holds: nothing is compared, and a data-dependent branch may go either way.

A pipelined plan's rank runs its stage(s) alone: as many micro-batches' forwards as its schedule holds
at once (1F1B: p − r on rank r along the pipeline axis; the others: every micro-batch), then their
backwards, the gradients synchronised in the last, then the optimizer step. What crosses a stage boundary
is made up (the stage's inputs at their real shapes) and not sent: the sends are the pipeline's, not
counted here; the collectives of the other axes are, per micro-batch, against the stage programs'.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pardsl.language.progress import tell
from pardsl.layouts.algebra import COLLECTIVE_KINDS
from pardsl.planning.cost import default_machine, estimate, pipeline_rank_memory, stage_buffer_slots
from pardsl.program.codegen import load_module
from pardsl.program.ir import format_bytes, torch_dtype
from pardsl.runtime.core import Runtime
from pardsl.runtime.schedules import stage_micro_batches_held, stages_of_rank
from pardsl.tools.memory import held_bytes, optimizer_state, peak_so_far

PHASES = ("forward", "backward", "optimizer")


class DryRunRefused(Exception):
    """The plan cannot be dry-run as asked (a rank outside the mesh, a device missing, a plan over the
    machine's memory)."""


@dataclass
class DryRun:
    rank: int
    device: str
    steps: int
    set_up_bytes: int  # parameters, buffers and inputs (the optimizer's state apart), before the first step
    peak_bytes: int  # over every step
    peak_after: dict[str, int]  # the peak up to the end of each phase of the first step
    seconds: dict[str, float]  # per phase, the last step's
    issued: dict[str, dict[str, int]]  # per phase, "axis:kind" → count, one step's
    planned: dict[str, dict[str, int]]
    estimated_bytes: int
    device_memory_bytes: int = 0  # the machine's, where known
    notes: list[str] = field(default_factory=list)

    @property
    def collectives_match(self) -> bool:
        return self.issued == self.planned

    @property
    def fits(self) -> bool | None:
        return None if not self.device_memory_bytes else self.peak_bytes <= self.device_memory_bytes

    def to_json(self) -> dict:
        return {"rank": self.rank, "device": self.device, "steps": self.steps, "peak_bytes": self.peak_bytes,
                "estimated_bytes": self.estimated_bytes, "set_up_bytes": self.set_up_bytes,
                "peak_after": self.peak_after, "seconds": self.seconds,
                "collectives_match": self.collectives_match, "collectives": self.issued, "planned": self.planned,
                "device_memory_bytes": self.device_memory_bytes or None, "fits": self.fits, "notes": self.notes}


def dry_run(compiled, rank: int = 0, device: str = "cpu", steps: int = 1, machine=None) -> DryRun:
    """Rank `rank`'s program of `compiled` at its real size on `device` ("cpu" or "cuda"), `steps`
    training steps; the estimate it is set beside is `machine`'s (cost.estimate)."""
    mesh = compiled.program.mesh
    if not 0 <= rank < mesh.size:
        raise DryRunRefused(f"rank {rank} is not on the mesh ({mesh}: ranks 0 to {mesh.size - 1})")
    if device == "cuda" and not torch.cuda.is_available():
        raise DryRunRefused("--device cuda needs a CUDA device; this machine has none")
    machine = machine or default_machine()
    planned_memory = estimate(compiled, machine).memory
    if compiled.pipeline is not None:  # this rank's stages, not the rank that holds the most
        axis = mesh.axis_index(compiled.pipeline.axis)
        planned_memory = pipeline_rank_memory(compiled.stages, compiled.pipeline, mesh.coordinates(rank)[axis])
    device_memory = machine.device_memory_bytes
    if device_memory and planned_memory["peak"] > device_memory:
        raise DryRunRefused(
            f"the plan needs {format_bytes(planned_memory['peak'])} per rank by its estimate, more than the "
            f"{format_bytes(device_memory)} of {machine.name or 'the machine'}'s devices: split more, recompute "
            f"(`recompute model.layers.*`) or offload (`offload optimizer`)")
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device == "cpu" and planned_memory["peak"] > host_memory:
        raise DryRunRefused(
            f"the plan needs {format_bytes(planned_memory['peak'])} per rank by its estimate, more than this "
            f"machine's {format_bytes(host_memory)} of memory: dry-run it where one rank's share fits (--device "
            f"cuda on a GPU of the size planned for)")
    run = _run_pipelined if compiled.pipeline is not None else _run
    tell(f"rank {rank}: making its shards at their real size")
    with _fake_process_group(rank, mesh.size):
        return run(compiled, rank, torch.device(device), steps, planned_memory["peak"], device_memory)


@contextlib.contextmanager
def _fake_process_group(rank: int, world_size: int):
    """torch's fake process group as the default one: collectives return at once, moving nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise DryRunRefused("a dry run makes its own process group: run it outside torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run(compiled, rank: int, device: torch.device, steps: int, estimated: int, device_memory: int) -> DryRun:
    program = compiled.program
    generated = load_module(compiled.source)
    rt = Runtime(program.mesh, device)
    module = generated.CompiledModule(rt)  # empty storage: its values are never read as numbers
    inputs = [_local_input(slot, decl, device) for slot, decl in zip(program.inputs, compiled.par.inputs)]
    # fused: one kernel over every parameter, without the whole-model temporaries of the `foreach` step
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3, fused=True)
    _with_optimizer_state(optimizer)
    set_up = held_bytes([*module.parameters(), *module.buffers(), *inputs])
    peak, peak_after, seconds, issued = _steps(rt, device, steps, set_up, optimizer, lambda: module(*inputs), _backward)
    notes = [] if device.type == "cuda" else [
        "CPU: memory is tensor storage counted by pardsl (views and in-place writes make none); times are this CPU's"]
    return DryRun(rank, device.type, steps, set_up, peak, peak_after, seconds, issued,
                  _by_axis(program.collective_counts_by_axis()), estimated, device_memory, notes)


def _run_pipelined(compiled, rank: int, device: torch.device, steps: int, estimated: int,
                   device_memory: int) -> DryRun:
    plan, mesh = compiled.pipeline, compiled.program.mesh
    generated = load_module(compiled.source)
    rt = Runtime(mesh, device)
    axis = mesh.axis_index(plan.axis)
    coordinate, ranks = mesh.coordinates(rank)[axis], mesh.axis_sizes[axis]
    mine = stages_of_rank(coordinate, ranks, len(compiled.stages), plan.schedule)
    held = stage_micro_batches_held(plan.schedule, plan.microbatches, ranks, coordinate, len(compiled.stages) // ranks)
    modules = {stage: generated.STAGES[stage](rt) for stage in mine}
    for module in modules.values():  # gradients held over micro-batches, as the pipeline's stages hold them
        module.sync_gradients, module.held_gradients = True, {}
    inputs = {stage: _stage_inputs(compiled, stage, device) for stage in mine}
    optimizer = torch.optim.AdamW([p for m in modules.values() for p in m.parameters() if p.requires_grad],
                                  lr=1e-3, fused=True)
    _with_optimizer_state(optimizer)
    buffers = _stage_buffers(compiled, mine, device)
    set_up = held_bytes([t for m in modules.values() for t in (*m.parameters(), *m.buffers())] +
                        [t for ts in inputs.values() for t in ts] + buffers)

    def forward(stage: int) -> tuple[int, object]:  # one micro-batch's forward through one stage
        return stage, modules[stage](*inputs[stage])

    def in_flight() -> list[tuple[int, object]]:  # each stage's forwards of the micro-batches it holds at once
        return [forward(stage) for stage in mine for _ in range(held[stage])]

    peak, peak_after, seconds, issued = _steps(
        rt, device, steps, set_up, optimizer, in_flight,
        functools.partial(_rest_of_step, forward=forward, modules=modules, count=plan.microbatches))
    planned: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    for stage in mine:  # each micro-batch's collectives, and the gradient buckets' once a step
        program = compiled.stages[stage]
        once = Counter((c.phase, f"{c.axis}:{c.kind}") for bucket in program.buckets for c in bucket.collectives)
        for phase, counts in program.collective_counts_by_axis().items():
            for key, count in counts.items():
                per_step = once[(phase, key)]
                planned[phase][key] = planned[phase].get(key, 0) + (count - per_step) * plan.microbatches + per_step
    holds = ", ".join(f"{held[stage]} in stage {stage}" for stage in mine)
    notes = [f"pipeline: stage(s) {', '.join(map(str, mine))} of {len(compiled.stages)}, micro-batches held at once: "
             f"{holds} ({plan.schedule}, {plan.microbatches} micro-batches, each run); the sends between stages are "
             f"not run"]
    if device.type != "cuda":
        notes.append("CPU: memory is tensor storage counted by pardsl (views and in-place writes make none); "
                     "times are this CPU's")
    return DryRun(rank, device.type, steps, set_up, peak, peak_after, seconds, issued, _by_axis(planned),
                  estimated, device_memory, notes)


def _steps(rt, device: torch.device, steps: int, set_up: int, optimizer, forward, backward):
    """`steps` training steps, `forward()` then `backward(its outputs)` then the optimizer's: the peak over
    them all, the peak by the end of each phase and each phase's seconds (the last step's), and the
    collectives the first step issued, by axis."""
    peak_after, seconds, peak, issued = {}, {}, 0, None
    for step in range(steps):
        rt.counter.reset()
        with peak_so_far(device, set_up + held_bytes(optimizer_state(optimizer))) as measure:
            tell(f"step {step + 1} of {steps}: forward")
            outputs = _timed(seconds, "forward", device, forward)
            peak_after["forward"] = measure()
            tell(f"step {step + 1} of {steps}: backward")
            _timed(seconds, "backward", device, functools.partial(backward, outputs))
            peak_after["backward"] = measure()
            del outputs
            tell(f"step {step + 1} of {steps}: the optimizer's step")
            _timed(seconds, "optimizer", device, optimizer.step)
            optimizer.zero_grad(set_to_none=True)
            peak_after["optimizer"] = measure()
        peak = max(peak, peak_after["optimizer"])
        issued = issued or _by_axis(rt.counter.summary()["collectives_by_axis"])
    return peak, peak_after, seconds, issued


def _rest_of_step(in_flight: list, forward, modules: dict, count: int) -> None:
    """After the forwards of the micro-batches each stage of a rank holds at once (`in_flight`: (stage,
    result) pairs), the rest of its step: the oldest forward's backward, then that stage's next forward,
    until each stage has run `count` forward, then the backwards of those left (GPipe holds them all: its
    forwards, then its backwards). No stage holds more than it did at the start, which is what the
    schedule has it hold at most (schedules.stage_micro_batches_held). Every micro-batch's gradients are
    added to those held; each stage synchronises them in its last backward, as the pipeline's schedule
    has them."""
    remaining = {stage: count for stage in modules}
    for stage, _ in in_flight:
        remaining[stage] -= 1
    while in_flight:
        stage, result = in_flight.pop(0)
        modules[stage].sync_gradients = not remaining[stage] and all(other != stage for other, _ in in_flight)
        _backward(result if isinstance(result, (tuple, list)) else (result,))
        del result  # its activations go with it, as the schedule drops a micro-batch after its backward
        if remaining[stage]:
            in_flight.append(forward(stage))
            remaining[stage] -= 1


def _stage_buffers(compiled, mine: list[int], device: torch.device) -> list[torch.Tensor]:
    """The buffers torch's PipelineStage keeps for the rank's stages (cost.stage_buffer_slots), one per
    micro-batch; the dry run's own inputs of a stage are one micro-batch's received ones. Nothing arrives
    in them here."""
    microbatches = compiled.pipeline.microbatches
    buffers = []
    for stage in mine:
        received, returned = stage_buffer_slots(compiled.stages, stage)
        buffers += [torch.empty(slot.local_shape, dtype=torch_dtype(slot.dtype), device=device)
                    for slot in received * (microbatches - 1) + returned * microbatches]
    return buffers


def _stage_inputs(compiled, stage: int, device: torch.device) -> list[torch.Tensor]:
    """A stage's inputs at this rank's shapes: the model's inputs for the first, else what the stage
    before would send (floats from a normal, needing a gradient where the plan sends one back)."""
    program = compiled.stages[stage]
    if stage == 0:
        return [_local_input(slot, decl, device) for slot, decl in zip(program.inputs, compiled.par.inputs)]
    made = []
    for slot in program.inputs:
        value = _local_input(slot, None, device)
        made.append(value.requires_grad_(slot.requires_grad) if value.is_floating_point() else value)
    return made


def _with_optimizer_state(optimizer) -> None:
    """The optimizer's state made before the measured steps, as a step of zero gradients makes it: a rank
    in training holds it through every forward and backward, not only from its first step on."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _backward(outputs) -> None:
    """Backward from every output that needs a gradient, each seeded with ones."""
    floating = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if floating:
        torch.autograd.backward(floating, [torch.ones_like(o) for o in floating])


def _local_input(slot, decl, device: torch.device) -> torch.Tensor:
    """This rank's input at its local shape: integers in the declared range, floats from a normal."""
    dtype = torch_dtype(slot.dtype)
    shape = tuple(slot.local_shape)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    low, high = (decl.value_range if decl is not None else None) or (0, 2)
    return torch.randint(low, high, shape, dtype=dtype, device=device)


def _timed(seconds: dict, phase: str, device: torch.device, work):
    start = time.perf_counter()
    result = work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds[phase] = time.perf_counter() - start
    return result


def _by_axis(counts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per phase, the nonzero counts by "axis:kind", sorted: the collectives, and the point-to-point sends
    a plan makes inside a stage (ring attention's, halo exchanges)."""
    return {phase: dict(sorted((key, n) for key, n in counts.get(phase, {}).items()
                               if n and key.split(":")[-1] in (*COLLECTIVE_KINDS, "send")))
            for phase in ("forward", "backward")}
