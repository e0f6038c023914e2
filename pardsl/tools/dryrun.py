"""A dry run: one rank's real program at its real size, in this process, with nothing sent.

`pardsl dryrun FILE.par --rank R` builds rank R's shards of every parameter at their real shapes (empty
storage: values are not initialised, so it starts in seconds at any size), makes its local inputs, and
runs training steps — forward, backward, an AdamW step — with every collective answered by torch's fake
process group (`torch.testing._internal.distributed.fake_pg`: each call returns at once and moves
nothing). What it measures is what that rank would hold and issue on the cluster: its peak memory after
each phase (CUDA: the allocator's; CPU: pardsl/tools/memory.py's count of tensor storage), each phase's
time on this device, and the collectives it issued, kind by kind and axis by axis, against the plan's.
Values are whatever empty storage holds: nothing is compared, and a data-dependent branch may go either way.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pardsl.layouts.algebra import COLLECTIVE_KINDS
from pardsl.planning.cost import default_machine, estimate
from pardsl.program.codegen import load_module
from pardsl.program.ir import format_bytes, torch_dtype
from pardsl.runtime.core import Runtime
from pardsl.tools.memory import held_bytes, optimizer_state, peak_so_far

PHASES = ("forward", "backward", "optimizer")


class DryRunRefused(Exception):
    """The plan cannot be dry-run as asked (a rank outside the mesh, a pipelined plan, a device missing)."""


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
    if compiled.pipeline is not None:
        raise DryRunRefused("a pipelined plan cannot be dry-run yet: dry-run it without its `pipeline` line, "
                            "with the pipeline axis's size in a data-parallel axis")
    if not 0 <= rank < mesh.size:
        raise DryRunRefused(f"rank {rank} is not on the mesh ({mesh}: ranks 0 to {mesh.size - 1})")
    if device == "cuda" and not torch.cuda.is_available():
        raise DryRunRefused("--device cuda needs a CUDA device; this machine has none")
    machine = machine or default_machine()
    planned_memory = estimate(compiled, machine).memory
    device_memory = machine.device_memory_bytes
    if device_memory and planned_memory["peak"] > device_memory:
        raise DryRunRefused(
            f"the plan needs {format_bytes(planned_memory['peak'])} per rank by its estimate, more than the "
            f"{format_bytes(device_memory)} of {machine.name or 'the machine'}'s devices: split more, recompute "
            f"(`recompute model.layers.*`) or offload (`offload optimizer`)")
    with _fake_process_group(rank, mesh.size):
        return _run(compiled, rank, torch.device(device), steps, planned_memory["peak"], device_memory)


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
    peak_after, seconds, peak, issued = {}, {}, 0, None
    for step in range(steps):
        rt.counter.reset()
        with peak_so_far(device, set_up + held_bytes(optimizer_state(optimizer))) as measure:
            outputs = _timed(seconds, "forward", device, lambda: module(*inputs))
            peak_after["forward"] = measure()
            _timed(seconds, "backward", device, functools.partial(_backward, outputs))
            peak_after["backward"] = measure()
            del outputs
            _timed(seconds, "optimizer", device, optimizer.step)
            optimizer.zero_grad(set_to_none=True)
            peak_after["optimizer"] = measure()
        peak = max(peak, peak_after["optimizer"])
        issued = issued or _by_axis(rt.counter.summary()["collectives_by_axis"])
    notes = [] if device.type == "cuda" else [
        "CPU: memory is tensor storage counted by pardsl (views and in-place writes make none); times are this CPU's"]
    return DryRun(rank, device.type, steps, set_up, peak, peak_after, seconds, issued,
                  _by_axis(program.collective_counts_by_axis()), estimated, device_memory, notes)


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
    low, high = decl.value_range or (0, 2)
    return torch.randint(low, high, shape, dtype=dtype, device=device)


def _timed(seconds: dict, phase: str, device: torch.device, work):
    start = time.perf_counter()
    result = work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds[phase] = time.perf_counter() - start
    return result


def _by_axis(counts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per phase, the nonzero counts by "axis:kind", sorted."""
    return {phase: dict(sorted((key, n) for key, n in counts.get(phase, {}).items()
                               if n and key.split(":")[-1] in COLLECTIVE_KINDS))
            for phase in ("forward", "backward")}
