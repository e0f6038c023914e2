"""Running a compiled module on N ranks and checking it against the serial model.

`RankJob` is everything one rank needs: the generated source, how to build the model, the inputs. Each
rank builds the serial reference from the same factory and seed, loads its shards of the same weights,
and runs `steps` training steps (forward, backward with a fixed random output gradient, an optimizer
step) on both, comparing its local outputs and gradients with its shards of the serial ones at every
step. Every step starts from the same parameters: after each step the compiled shards are set to the
serial model's new values. Without that, a few steps of training on random output gradients amplify
rounding differences (serial itself, perturbed by 1e-7, drifts the same way), and a difference would
not mean a bug. Every step's compiled forward also starts from the random generator's state serial's
forward started from, so a dropout draws the masks serial drew.

The tolerance follows the dtype: |compiled − serial| ≤ tol × max(1, max |serial|) per tensor, with tol
1e-4 for float32 and float64, 1e-2 for float16 and 5e-2 for bfloat16 (8 bits of mantissa: a sum computed
in another order differs by several units in the last place).

`launch` runs the ranks as processes of this machine; `pardsl.pool.WorkerPool` runs the same
`run_rank` on long-lived workers for the test suite.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import pickle
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pardsl.language.progress import tell
from pardsl.language.syntax import InputDecl, ModelDecl
from pardsl.layouts.algebra import Layout, Mesh
from pardsl.model.export import without_key_value_caches
from pardsl.model.loading import build_model, full_state, import_paths, make_inputs, par_import_paths
from pardsl.program.codegen import load_module
from pardsl.runtime.pieces import collectives_in_graphs as in_graphs_by_default, compile_pieces
from pardsl.runtime.core import Runtime
from pardsl.runtime.devices import rank_device, resolve_device
from pardsl.runtime.rendezvous import init_local_ranks, private_folder
from pardsl.runtime.schedule import Pipeline, loss_output
from pardsl.tools.memory import held_bytes, optimizer_state, peak_so_far


@dataclass(frozen=True)
class RankJob:
    module_source: str
    module_name: str
    mesh: Mesh
    model: ModelDecl
    par_path: str
    inputs: tuple[InputDecl, ...]
    seed: int = 0
    steps: int = 1
    lr: float = 0.01
    backend: str = "gloo"
    device: str = "cpu"  # or "cuda": each rank on GPU `local rank % GPUs` (NCCL needs one GPU per rank)
    sys_path: tuple[str, ...] = ()
    timeout_s: float = 120.0
    tolerance: float = 1e-4  # relative to the tensor's magnitude: |compiled - serial| <= tol * max(1, max|serial|)
    optimizer: str = "sgd"  # sgd | adam | adamw
    stdout_to_stderr: bool = False  # what the model prints goes to stderr (the CLI's --json owns stdout)
    progress_dir: str | None = None  # each rank records its progress here for `launch`'s watchdog
    # tensors the forward makes from Python data (export's lifted constants): the serial model's state has
    # none of them, the plan has their values
    constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # a mixed-precision policy's (compute dtype, reduce dtype), torch names: serial's reference computes
    # in the first, from its float32 parameters, as the plan does
    precision: tuple[str, str] | None = None
    compile: bool = False  # module_source has pieces (codegen.render(..., pieces=True)): torch.compile them
    compile_backend: str = "inductor"  # torch.compile's backend for them


TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


class _NothingToOptimize:
    """The optimizer of a model without parameters (a bare LayerNorm without weights): torch's refuse an
    empty list."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass


def _optimizer(name: str, parameters, lr: float, fused: bool = False):
    """`fused`: one kernel for every parameter's step (offloaded masters, stepped on the host)."""
    parameters = list(parameters)
    return OPTIMIZERS[name](parameters, lr=lr, fused=fused or None) if parameters else _NothingToOptimize()


def tolerance_for(dtypes) -> float:
    """The loosest tolerance of the floating dtypes the program computes in (wrong numbers are the
    worst outcome, so a float32 program is judged at float32's)."""
    return max([TOLERANCE.get(d, 1e-4) for d in dtypes if d.is_floating_point] or [1e-4])


def job_for(compiled, *, seed: int = 0, steps: int = 1, backend: str = "gloo", device: str | None = None,
            timeout_s: float = 120.0, lr: float = 0.01, optimizer: str = "sgd",
            stdout_to_stderr: bool = False, compile: bool = False,
            collectives_in_graphs: bool | None = None, compile_backend: str = "inductor") -> RankJob:
    """`device`: "cpu" or "cuda" (default: CUDA under NCCL, else the CPU); `compile`, `collectives_in_graphs`:
    regional compilation (pardsl.load's), with the conversions inside the compiled graphs (default: on
    NCCL)."""
    par = compiled.par
    tolerance = tolerance_for({info.dtype for info in compiled.bound.tensors.values()})
    if collectives_in_graphs is None:
        collectives_in_graphs = in_graphs_by_default(backend)
    source = compiled.source_with_pieces(collectives_in_graphs) if compile else compiled.source
    return RankJob(source, "pardsl_module", compiled.program.mesh, par.model, par.source.path,
                   par.inputs, seed, steps, lr=lr, backend=backend, device=resolve_device(device, backend),
                   sys_path=par_import_paths(par.source.path, par.model.module), timeout_s=timeout_s,
                   tolerance=tolerance, optimizer=optimizer, stdout_to_stderr=stdout_to_stderr,
                   constants=compiled.bound.constant_values,
                   precision=None if par.precision is None else (par.precision.params, par.precision.reduce),
                   compile=compile, compile_backend=compile_backend)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise difference; inf where shapes differ or anything is not finite (NaN never passes)."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    err = (a.detach().double() - b.detach().double()).abs().max().item()
    return err if math.isfinite(err) else float("inf")


def _unit_norm(gradient: torch.Tensor) -> torch.Tensor:
    return gradient / max(1.0, gradient.norm().item())


class ProgressFile:
    """One rank's progress for the parent's watchdog: how many events (phases, collectives entered) it has
    reached, the last one, when, and its pid; rewritten atomically at each event."""

    def __init__(self, folder: str, rank: int):
        self.path = os.path.join(folder, f"rank-{rank}.json")
        self.count = 0

    def advance(self, what: str) -> None:
        self.count += 1
        with open(self.path + ".tmp", "w") as handle:
            json.dump({"count": self.count, "time": time.time(), "what": what, "pid": os.getpid()}, handle)
        os.replace(self.path + ".tmp", self.path)


class _Tally:
    """One rank's comparison with serial over its steps: the largest difference per kind (output, grad),
    absolute and relative to the tensor's magnitude, which tensor it was, and the step times."""

    def __init__(self):
        self.errors = {"output": 0.0, "grad": 0.0}
        self.relative = {"output": 0.0, "grad": 0.0}
        self.worst = {"output": None, "grad": None}
        self.compiled_ms, self.serial_ms = [], []
        self.serial_finite = True
        self.peak_bytes: int | None = None  # the measured step's (pardsl/tools/memory.py), where one was
        self.forward_bytes: int | None = None  # what its forward made and still held as it returned

    def note(self, kind: str, what: str, got: torch.Tensor | None, expected: torch.Tensor | None) -> None:
        err = float("inf") if got is None or expected is None else _max_err(got, expected)
        # in double: a bool or integer buffer (GPTBigCode's causal mask) is compared as the floats are
        scale = max(1.0, expected.detach().double().abs().max().item()) if expected is not None and expected.numel() else 1.0
        rel = err / scale if math.isfinite(scale) else float("inf")
        self.errors[kind] = max(self.errors[kind], err)
        if self.worst[kind] is None or rel > self.relative[kind]:
            self.relative[kind], self.worst[kind] = rel, what

    def compiled_step(self, step: int, steps: int, device: torch.device, held: list, work, optimizer,
                      measured: bool = True):
        """`work(forward_done)`'s result: the compiled step's forward and backward, timed; `work` calls
        `forward_done()` as its forward returns. The first step's memory is measured (pardsl/tools/memory.py;
        `held`: the tensors the rank holds as it begins, its optimizer's state added): its peak, and what the
        forward made and still held as it returned (the activations kept for backward, the outputs); its
        optimizer's first step is inside it, where that state is made; where there are other steps to time,
        its time is not counted. Later steps' optimizer steps are the caller's. `measured`: False where the
        measurement would change the step (torch.compile does not compile a function first called under the
        CPU count's dispatch mode, nor afterwards)."""
        measuring = peak_so_far(device, held_bytes([*held, *optimizer_state(optimizer)])) \
            if step == 0 and measured else contextlib.nullcontext(None)
        start = time.perf_counter()
        with measuring as measure:
            def forward_done():
                if measure is not None:
                    _sync(device)
                    self.forward_bytes = measure.made_and_held()
            result = work(forward_done)
            _sync(device)
            milliseconds = (time.perf_counter() - start) * 1000
            if step == 0:
                optimizer.step()
            if measure is not None:
                _sync(device)
                self.peak_bytes = max(self.peak_bytes or 0, measure())
        if step or steps == 1:
            self.compiled_ms.append(milliseconds)
        return result

    def report(self, counts: dict) -> dict:
        return {
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "serial_finite": self.serial_finite,
            "max_abs_err": self.errors,
            "max_rel_err": self.relative,
            "worst": self.worst,
            "step_ms": {"compiled": statistics.median(self.compiled_ms), "serial": statistics.median(self.serial_ms)},
            **({"peak_bytes": self.peak_bytes} if self.peak_bytes is not None else {}),
            **({"forward_bytes": self.forward_bytes} if self.forward_bytes is not None else {}),
            **counts,
        }


def run_rank(job: RankJob) -> dict:
    """One rank's part: build, shard, run `steps` steps of compiled and serial, compare. Needs the
    process group initialised (any world size equal to the mesh size)."""
    device = rank_device(job.device)
    rt = Runtime(job.mesh, device)
    progress = ProgressFile(job.progress_dir, dist.get_rank() if dist.is_initialized() else 0) \
        if job.progress_dir else None
    if progress:
        progress.advance("building the serial model")
        rt.counter.progress = progress
    module = load_module(job.module_source, job.module_name)
    if job.compile:
        compile_pieces(module, job.compile_backend)

    torch.manual_seed(job.seed)
    with import_paths(*job.sys_path):
        serial = build_model(job.model, job.par_path).to(device)
    if hasattr(module, "STAGES"):
        return _run_pipelined_rank(job, module, rt, serial, progress)
    compiled = module.CompiledModule(rt)
    full = {**full_state(serial), **job.constants}  # by every name: tied weights, non-persistent buffers
    compiled.load_full_state_dict(full)
    full_inputs = [t.to(device) for t in make_inputs(job.inputs, torch.Generator().manual_seed(job.seed + 1))]
    local_inputs = compiled.shard_inputs(*full_inputs)
    input_names = [decl.name for decl in job.inputs]
    compiled_params = {name: getattr(compiled, attr) for name, (attr, _, _) in module.PARAMETERS.items()}
    layouts = {name: layout for name, (_, layout, _) in module.PARAMETERS.items()}
    serial_opt = _optimizer(job.optimizer, serial.parameters(), job.lr)
    compiled_opt = _optimizer(job.optimizer, compiled.parameters(), job.lr, fused=hasattr(module, "OFFLOAD"))

    grad_generator = torch.Generator().manual_seed(job.seed + 2)
    output_grads = None
    tally, counts = _Tally(), None
    note = tally.note
    graphs: list[int] = []  # torch.compile's graphs made so far, after each step (regional compilation)

    for step in range(job.steps):
        if progress:
            progress.advance(f"step {step + 1}: the serial model")
        if step:  # the same parameters as serial's (module doc): each step is compared on its own
            compiled.load_full_state_dict(full)
        start = time.perf_counter()
        generator = _generator_state(device)  # the compiled step draws its random values from where serial's did
        reference = _under_precision(serial, job.precision)
        serial_params = dict(reference.named_parameters(remove_duplicate=False))  # tied weights under every name
        serial_buffers = dict(reference.named_buffers(remove_duplicate=False))
        given = _as_given(full_inputs, job.precision)
        serial_result = without_key_value_caches(reference(**dict(zip(input_names, given))))
        serial_out = torch.utils._pytree.tree_leaves(serial_result)
        if output_grads is None:
            # unit-norm output gradients (a mean, not a sum, of outputs × random weights): the objective is
            # linear, and steps the size of a summed one's carry deep models to inf within a few steps
            output_grads = [_unit_norm(torch.randn(o.shape, generator=grad_generator)).to(device, o.dtype)
                            for o in serial_out]
        serial_opt.zero_grad(set_to_none=True)
        torch.autograd.backward([o for o in serial_out if o.requires_grad],
                                [g for o, g in zip(serial_out, output_grads) if o.requires_grad])
        _sync(device)
        tally.serial_ms.append((time.perf_counter() - start) * 1000)

        rt.counter.reset()
        if progress:
            progress.advance(f"step {step + 1}: the compiled module")
        if dist.is_initialized():
            dist.barrier()
        # The gradient of an S output is its shard; of a B or P output, the full gradient (README, 'Gradients over a split batch').
        seeds = [g if Layout.from_key(layout).has_partial else rt.shard(g, layout)
                 for g, (_, layout, _) in zip(output_grads, module.OUTPUTS)]
        compiled_opt.zero_grad(set_to_none=True)

        def forward_and_backward(forward_done):
            _set_generator_state(device, generator)
            out = compiled(*local_inputs)
            forward_done()
            pairs = [(o, s.to(o.dtype)) for o, s in zip(out, seeds) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [s for _, s in pairs])
            return out

        held = [*compiled.parameters(), *compiled.buffers(), *local_inputs, *seeds]
        local_out = tally.compiled_step(step, job.steps, device, held, forward_and_backward, compiled_opt,
                                        measured=not (job.compile and device.type == "cpu"))
        counts = rt.counter.summary()

        tally.serial_finite = tally.serial_finite and all(bool(torch.isfinite(o).all()) for o in serial_out)
        for index, (out, expected, (path, layout, _)) in enumerate(zip(local_out, serial_out, module.OUTPUTS)):
            if Layout.from_key(layout).has_partial:
                note("output", path, rt.unshard(out, layout), expected)
            else:
                note("output", path, out, rt.shard(expected.detach(), layout))
        # buffers a forward updates (batch norm's running statistics) are part of the step's result
        for name, (attr, layout, _) in module.BUFFERS.items():
            expected = serial_buffers.get(name)
            if expected is not None:
                note("output", name, getattr(compiled, attr), rt.shard(expected, layout))
        for name, param in compiled_params.items():
            expected = serial_params[name].grad
            if expected is None and param.grad is None:
                continue
            note("grad", name, param.grad, None if expected is None else rt.shard(expected, layouts[name]))
        if reference is not serial:  # the float32 parameters step on the gradients computed in the policy's dtype
            for parameter, computed in zip(serial.parameters(), reference.parameters()):
                parameter.grad = None if computed.grad is None else computed.grad.to(parameter.dtype)
            with torch.no_grad():  # and the buffers the forward updated (batch norm's statistics) are its
                for buffer, updated in zip(serial.buffers(), reference.buffers()):
                    buffer.copy_(updated)
        serial_opt.step()
        if step:
            compiled_opt.step()
        if job.compile:
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    return _with_graphs(tally.report(counts), graphs)


def _with_graphs(report: dict, graphs: list[int]) -> dict:
    """The report, with the graphs torch.compile had made by the end of the first step and of the last
    under compiled layers (`graphs`: one count per step; none without them)."""
    if graphs:
        report["compiled_graphs"] = {"first_step": graphs[0], "last_step": graphs[-1]}
    return report


def _generator_state(device: torch.device):
    """The default generator's state for `device` (dropout's), to draw a second time what was drawn."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_generator_state(device: torch.device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _run_pipelined_rank(job: RankJob, module, rt, serial, progress) -> dict:
    """A pipelined plan's check: this rank's stages under the plan's schedule against the serial model on
    the whole batch. The objective is the model's own loss where it returns one scalar (each micro-batch's
    mean, averaged, as the schedule scales it), else its one output against a fixed random gradient (a
    sum over micro-batches). Compared: the loss or output on the last stage's ranks, and every gradient of
    this rank's stages."""
    device = rt.device
    full = {**full_state(serial), **job.constants}
    modules = {index: module.STAGES[index](rt) for index in Pipeline.of_rank(module, rt)}
    full_inputs = [t.to(device) for t in make_inputs(job.inputs, torch.Generator().manual_seed(job.seed + 1))]
    input_names = [decl.name for decl in job.inputs]
    first_inputs = module.STAGES[0].INPUTS
    microbatches = module.PIPELINE["microbatches"]
    local_inputs = [rt.shard_micro_batched(x, layout, microbatches) for x, (_, layout, _, _, _) in zip(full_inputs, first_inputs)]
    outputs = module.STAGES[-1].OUTPUTS
    loss = loss_output(outputs)
    own_loss = loss is not None
    if not own_loss and len(outputs) != 1:
        raise ValueError("`pardsl run` checks a pipelined plan whose model returns one scalar loss or one tensor; "
                         f"this one returns {len(outputs)} values")
    output_layout = outputs[loss if own_loss else 0][1]
    gradient = None  # the whole batch's, made from serial's first output
    if own_loss:
        pipeline = Pipeline(module, rt, modules, lambda output, target: output[loss])
    else:
        pipeline = Pipeline(module, rt, modules, lambda output, target: (output[0] * target).sum(), scale_grads=False)
    stage_params = [(name, getattr(m, attr), layout) for m in modules.values()
                    for name, (attr, layout, _) in m.PARAMETERS.items()]
    serial_opt = _optimizer(job.optimizer, serial.parameters(), job.lr)
    compiled_opt = _optimizer(job.optimizer, [p for m in modules.values() for p in m.parameters()], job.lr,
                              fused=hasattr(module, "OFFLOAD"))
    tally, counts = _Tally(), None
    note = tally.note

    graphs: list[int] = []  # torch.compile's graphs made so far, after each step (regional compilation)
    for step in range(job.steps):
        if progress:
            progress.advance(f"step {step + 1}: the serial model")
        for stage in modules.values():  # every step starts from serial's parameters (run_rank's reason)
            stage.load_full_state_dict(full)
        start = time.perf_counter()
        reference = _under_precision(serial, job.precision)
        serial_params = dict(reference.named_parameters(remove_duplicate=False))
        given = _as_given(full_inputs, job.precision)
        serial_result = without_key_value_caches(reference(**dict(zip(input_names, given))))
        serial_out = torch.utils._pytree.tree_leaves(serial_result)
        if not own_loss and gradient is None:
            gradient = _unit_norm(torch.randn(serial_out[0].shape, generator=torch.Generator().manual_seed(
                job.seed + 2))).to(device, serial_out[0].dtype)
        objective = serial_out[loss] if own_loss else (serial_out[0] * gradient).sum()
        serial_opt.zero_grad(set_to_none=True)
        objective.backward()
        tally.serial_ms.append((time.perf_counter() - start) * 1000)
        tally.serial_finite = tally.serial_finite and all(bool(torch.isfinite(o).all()) for o in serial_out)

        rt.counter.reset()
        if progress:
            progress.advance(f"step {step + 1}: the pipelined module")
        dist.barrier()
        compiled_opt.zero_grad(set_to_none=True)
        target = None if own_loss else rt.shard(gradient, output_layout)
        held = [*(t for m in modules.values() for t in (*m.parameters(), *m.buffers())), *local_inputs,
                *([target] if target is not None else [])]
        losses, merged = tally.compiled_step(step, job.steps, device, held, lambda _: pipeline.step(
            local_inputs, target, return_outputs=not own_loss), compiled_opt,  # (forward and backward interleave)
            measured=not (job.compile and device.type == "cpu"))
        counts = rt.counter.summary()
        if pipeline.is_last:
            # a partial output (P) is summed over the last stage's ranks, which alone hold it, as run_rank sums it
            partial = Layout.from_key(output_layout).has_partial
            if own_loss:
                value = torch.stack([l.detach() for l in losses]).mean()
                note("output", outputs[loss][0], rt.unshard(value, output_layout) if partial else value,
                     serial_out[loss].detach())
            elif partial:
                note("output", outputs[0][0], rt.unshard(merged[0], output_layout), serial_out[0].detach())
            else:
                note("output", outputs[0][0], merged[0], rt.shard(serial_out[0].detach(), output_layout))
        for name, parameter, layout in stage_params:
            expected = serial_params[name].grad
            if expected is None and parameter.grad is None:
                continue
            note("grad", name, parameter.grad, None if expected is None else rt.shard(expected, layout))
        serial_opt.step()
        if step:
            compiled_opt.step()
        if job.compile:
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    return _with_graphs(tally.report(counts), graphs)


def _under_precision(serial: torch.nn.Module, precision: tuple[str, str] | None) -> torch.nn.Module:
    """The serial model as a mixed-precision policy computes it: a copy in the compute dtype (floating
    parameters and buffers, as the plan traced them), or the model itself without a policy."""
    return serial if precision is None else copy.deepcopy(serial).to(getattr(torch, precision[0]))


def _as_given(inputs: list[torch.Tensor], precision: tuple[str, str] | None) -> list[torch.Tensor]:
    """The inputs as the plan takes them: under a mixed-precision policy, floating ones cast on entry."""
    if precision is None:
        return inputs
    return [x.to(getattr(torch, precision[0])) if x.is_floating_point() else x for x in inputs]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def combine(results: list[dict], job: RankJob) -> dict:
    """One report from every rank's: worst errors over ranks; rank 0's counts and times."""
    by_rank = sorted(results, key=lambda r: r["rank"])
    first = by_rank[0]
    output_err = max(r["max_abs_err"]["output"] for r in results)
    grad_err = max(r["max_abs_err"]["grad"] for r in results)
    relative = {k: max(r["max_rel_err"][k] for r in results) for k in ("output", "grad")}
    serial_finite = all(r.get("serial_finite", True) for r in results)
    ok = serial_finite and all(err <= job.tolerance for err in relative.values())
    worst = {k: max(results, key=lambda r: r["max_rel_err"][k])["worst"][k] for k in ("output", "grad")}
    return {
        "ok": ok,
        "world_size": job.mesh.size,
        "mesh": dict(zip(job.mesh.axis_names, job.mesh.axis_sizes)),
        "backend": job.backend,
        "device": job.device,
        "steps": job.steps,
        "serial_finite": serial_finite,
        "optimizer": job.optimizer,
        "tolerance": job.tolerance,
        "max_abs_err": {"output": output_err, "grad": grad_err},
        "max_rel_err": relative,
        "worst": worst,
        "collectives": first["collectives"],
        "collectives_by_axis": first["collectives_by_axis"],
        # a pipeline's point-to-point sends in one step, over every rank
        **({"sends": {phase: sum(r.get("sends", {}).get(phase, 0) for r in results) for phase in ("forward", "backward")}}
           if any("sends" in r for r in results) else {}),
        "bytes": first["bytes"],  # the collectives whose bytes the plan fixes
        # the all-to-alls a routing decides (a mixture's experts), each rank's, as the data sent them
        **({"routed_bytes": [r.get("routed_bytes", {"forward": 0, "backward": 0}) for r in by_rank]}
           if any("routed_bytes" in r for r in results) else {}),
        "step_ms": first["step_ms"],
        # each rank's measured peak over its first step (pardsl/tools/memory.py), and what its forward made
        # and still held as it returned (not for a pipeline, whose forwards and backwards interleave)
        **({"memory": {"peak_bytes": [r["peak_bytes"] for r in by_rank],
                       **({"forward_bytes": [r["forward_bytes"] for r in by_rank]}
                          if all("forward_bytes" in r for r in by_rank) else {})}}
           if all("peak_bytes" in r for r in results) else {}),
        # regional compilation: the graphs torch.compile made by the end of the first step and of the last
        **({"compiled_graphs": first["compiled_graphs"]} if "compiled_graphs" in first else {}),
    }


# ---------------------------------------------------------------------------------------------------
# the ranks of a run, started as processes of this machine


def _rank_entry(job_path: str) -> dict:
    with open(job_path, "rb") as file:  # written by `launch` into its private folder
        job = pickle.load(file)
    if job.stdout_to_stderr:
        sys.stdout = sys.stderr
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.mesh.size))
    init_local_ranks(job.backend, os.path.dirname(job_path), int(os.environ["RANK"]), job.mesh.size, job.timeout_s)
    try:
        return run_rank(job)
    finally:
        dist.destroy_process_group()


class RunFailed(RuntimeError):
    """A rank failed, exited or stopped making progress: the message says which and how."""


def _watch(folder: str, ranks: int, stall_s: float, stop: threading.Event, verdict: list, pids,
           time_limit_s: float | None = None) -> None:
    """End the ranks when none has made progress for `stall_s` seconds, naming the one that fell behind
    (the fewest events reached: the others wait for it in a collective it never entered), or when the run
    has taken `time_limit_s` seconds. `pids()`: the ranks' processes, once they are started."""
    started = time.monotonic()
    while not stop.wait(0.5):
        records = {}
        for rank in range(ranks):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(folder, f"rank-{rank}.json")) as handle:
                    records[rank] = json.load(handle)
        if records:  # for a terminal's status line: how far the rank furthest behind has got
            behind = min(records, key=lambda r: (records[r]["count"], records[r]["time"]))
            tell(f"{len(records)} of {ranks} ranks running; rank {behind} (furthest behind): {records[behind]['what']}")
        if time_limit_s is not None and time.monotonic() - started > time_limit_s:
            verdict.append(f"the run did not finish within its time limit of {time_limit_s:g} s (--time-limit); "
                           f"its ranks were ended")
        elif len(records) == ranks and time.time() - max(r["time"] for r in records.values()) >= stall_s:
            behind = min(records, key=lambda r: (records[r]["count"], records[r]["time"]))
            record = records[behind]
            verdict.append(f"rank {behind} stopped making progress: its last step was {record['what']!r}, "
                           f"{time.time() - record['time']:.0f} s ago; the other ranks waited for it "
                           f"(--stall-timeout {stall_s:g} s)")
        else:
            continue
        running = pids()
        if not running:  # still being started: end them once they are
            verdict.clear()
            continue
        for pid in running:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return


def describe_failure(failures: dict) -> str:
    """One line per failed rank (torch's ProcessFailure records, by rank): the exception a rank raised, its
    exit code, or the signal that ended it — the first failure first."""
    first = min(failures, key=lambda rank: (failures[rank].timestamp, rank))
    lines = []
    for rank in [first] + sorted(r for r in failures if r != first):
        failure = failures[rank]
        message = failure.message
        if isinstance(message, dict):  # the launcher's error file: the exception line, then the rank's stack
            stack = message.get("extraInfo", {}).get("py_callstack", "")
            message = message.get("message", "") + ("\n" + stack if stack else "")
        elif not (failure.error_file and os.path.isfile(failure.error_file)):  # no exception: an exit or a signal
            message = f"exited with code {failure.exitcode}" if failure.exitcode >= 0 else \
                f"was ended by {failure.signal_name()}" + (" after the failure above" if rank != first else "")
        lines.append(f"rank {rank}: {str(message).strip()}")
    return "\n".join(lines)


_LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_HELD_INTERRUPT_RETRY_S = 0.05


@contextlib.contextmanager
def _ctrl_c_held_while_spawning():
    """Ctrl-C while the ranks are being spawned takes effect once they are all started and held by their
    process context (torch's `start_processes` has returned). Taken at once, it leaves a rank whose
    launcher closed the pipe before writing its start-up data (the rank prints multiprocessing's EOFError
    traceback) or a started rank nothing knows of (never ended). Once held, `launch` ends them by SIGTERM.
    Where SIGINT is not Python's KeyboardInterrupt (ignored in a background job, or the user's own
    handler), or outside the main thread, nothing changes."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    import torch.multiprocessing
    from torch.distributed.elastic.multiprocessing import start_processes

    spawning = (start_processes.__code__, torch.multiprocessing.start_processes.__code__)
    timers: list[threading.Timer] = []

    def send_again() -> None:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def on_interrupt(signum, frame) -> None:
        while frame is not None:
            if frame.f_code in spawning:
                timer = threading.Timer(_HELD_INTERRUPT_RETRY_S, send_again)
                timer.daemon = True
                timers.append(timer)
                timer.start()
                return
            frame = frame.f_back
        timers.clear()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for timer in timers:
            timer.cancel()
        if timers:  # held, and the launch ended before the interrupt was sent again
            raise KeyboardInterrupt


def launch(job: RankJob, stall_s: float = 60.0, time_limit_s: float | None = None) -> dict:
    """Run `job` on mesh.size processes of this machine, started by torch's process context (what its
    launcher uses, with the same records of a rank's failure) and meeting in a FileStore of a private
    folder: no port is opened for them to meet (pardsl/runtime/rendezvous.py). A rank that fails or stops
    making progress for `stall_s` seconds, or a run longer than `time_limit_s`, ends the run with
    RunFailed, naming what happened."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from torch.distributed.elastic.multiprocessing.api import SignalException

    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # a failing rank is reported once, by pardsl
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.mesh.size)))
    ranks = job.mesh.size
    with private_folder("pardsl-run-") as folder:
        job = dataclasses.replace(job, progress_dir=folder)
        # The ranks read the job from a file: a job larger than a pipe's buffer would keep this process
        # writing it while a rank imports torch, and a Ctrl-C then would leave that rank a truncated pickle.
        job_path = os.path.join(folder, "job.pickle")
        with open(job_path, "wb") as file:
            pickle.dump(job, file)
        context = None
        stop, verdict = threading.Event(), []
        watchdog = threading.Thread(target=_watch, daemon=True, args=(
            folder, ranks, stall_s, stop, verdict, lambda: list(context.pids().values()) if context else [],
            time_limit_s))
        watchdog.start()
        # The process context turns the signals it handles into its own exception and leaves its handlers
        # installed. Ctrl-C must stay a KeyboardInterrupt for the caller, and the ranks must end by SIGTERM,
        # quietly, even one still importing torch: SIGINT is left to Python.
        handlers = {number: signal.getsignal(number) for number in _LAUNCHER_SIGNALS}
        handled = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(number.name for number in _LAUNCHER_SIGNALS)
        environment = {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
                       "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
        already_running = set(multiprocessing.active_children())
        try:
            tell(f"starting {ranks} ranks")
            with _ctrl_c_held_while_spawning():
                context = start_processes(
                    "pardsl", _rank_entry, {rank: (job_path,) for rank in range(ranks)},
                    {rank: {**environment, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(ranks)},
                    DefaultLogsSpecs(log_dir=os.path.join(folder, "logs")), start_method="spawn")
            result = context.wait(period=0.1)
        except SignalException as error:
            raise RunFailed(f"pardsl received {error.sigval.name} and ended the ranks") from None
        finally:
            stop.set()
            watchdog.join()
            if context is not None:
                context.close(signal.SIGTERM, timeout=10)
            else:  # a signal while they were being started: the ranks started so far are this process's children
                for process in set(multiprocessing.active_children()) - already_running:
                    process.kill()
                    process.join(timeout=10)
            if handled is None:
                os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
            else:
                os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = handled
            for number, handler in handlers.items():
                signal.signal(number, handler)
        if result.is_failed():
            raise RunFailed(verdict[0] if verdict else describe_failure(result.failures))
    return combine([result.return_values[rank] for rank in sorted(result.return_values)], job)
