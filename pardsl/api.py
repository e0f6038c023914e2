"""The public API: train with a compiled plan from one's own script, under torchrun.

    plan = pardsl.load("plan.par")            # parse, export (on the meta device), infer, lower; cached
    model = plan.module(checkpoint="ckpt/")   # this rank's shards only
    out = model(**plan.shard_inputs(input_ids=batch, labels=batch))

`Plan` wraps what the compiler produced for one `.par` file; `ParallelModule` is the generated SPMD
module behind the serial model's own call signature and output structure. The process group is the
script's: pardsl uses the default one, whose world size must be the mesh's.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from pardsl.compiler import Compiled, compile_par
from pardsl.language.syntax import parse
from pardsl.layouts.algebra import B, Layout
from pardsl.model.deferred_init import InitialValues, record
from pardsl.model.loading import build_model, full_state, import_paths, load_factory, par_import_paths
from pardsl.planning.cost import DEFAULT_BUCKET_MB, Machine, default_machine, machine_named
from pardsl.planning.solver import LogMismatch, SolutionLog
from pardsl.program.codegen import cannot_compile, load_module
from pardsl.runtime.collectives import all_gather_json
from pardsl.runtime.pieces import check_backend, collectives_in_graphs as in_graphs_by_default, compile_pieces
from pardsl.runtime.checkpoint import load_model_state
from pardsl.runtime.core import Runtime
from pardsl.runtime.schedule import Pipeline, loss_output

# per file content, working directory, options and cost model: the compiled plan, its search's answers
# (SolutionLog) and the cost model's figures (cost.Machine) it was searched with
_CACHE: dict[tuple[str, str, str, float, str], tuple[Compiled, list, Machine]] = {}


def load(path: str, bucket_mb: float = DEFAULT_BUCKET_MB, machine: str | Machine | None = None,
         compile: bool = False, collectives_in_graphs: bool | None = None,
         compile_backend: str = "inductor") -> "Plan":
    """Compile a `.par` file into a Plan. Compiles once per process for the same file content, working
    directory and options; a mistake in the file raises `CompileError` (its `render()` points into the file).

    Under an initialised process group of more than one rank, `load` is collective (every rank calls it):
    the ranks compile at once, and any rank whose layout search answered differently from rank 0's (an
    integer program stopped by its time limit finds less on a slower rank; a machine calibrated apart from
    rank 0's rates plans otherwise) compiles again on rank 0's answers and cost figures, so that every
    rank runs rank 0's plan.

    `bucket_mb`: parameter gradients are synchronised during backward in buckets of this size (MiB), each
    issued as soon as its last gradient is ready (DDP's default, 25).

    `compile`: regional compilation: each run of the forward's ATen ops between the runtime's calls is a
    function compiled by `torch.compile`, one per distinct run, shared by every repeated layer that runs the
    same code (torchtitan compiles each transformer block); fused norms and a recomputed region's statements
    stay eager. In a pipeline, the stages share the pieces of their layers.

    `collectives_in_graphs`: the compiled pieces take in the conversions between them, as functional
    collectives the compiler schedules with the computation (default: where the process group is NCCL;
    on gloo the runtime's own CPU transports are faster, and the collectives run between the pieces).
    `compile_backend`: torch.compile's backend for the pieces ("aot_eager": the same graphs, their ATen ops
    run as they are, without generated kernels).

    `machine`: what a searched plan is searched for: a preset's name (`"h100-nvlink-ib"`), a machine file
    (`pardsl calibrate` writes one) or a `Machine`; default: this machine's calibration, else its
    backend's defaults.

    Where some rank cannot read or compile the file (missing on one machine, a stale copy with a mistake),
    that rank raises its own error and every other rank a RuntimeError naming it, instead of waiting for
    it at the next collective until the process group's timeout."""
    grouped = dist.is_initialized() and dist.get_world_size() > 1
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        machine = machine if isinstance(machine, Machine) else \
            default_machine() if machine is None else machine_named(machine, default_machine().backend)
        key = (os.path.abspath(path), os.getcwd(), hashlib.sha256(text.encode()).hexdigest(), float(bucket_mb),
               repr(machine))
        if key not in _CACHE:
            with SolutionLog() as log:
                compiled = compile_par(parse(text, path), bucket_mb, machine)
            _CACHE[key] = (compiled, log.entries, machine)
    except Exception as error:
        if grouped:
            _raise_on_every_rank(f"rank {dist.get_rank()} cannot compile {path} ({type(error).__name__})", error)
        raise
    if grouped:
        _raise_on_every_rank(None)
        _CACHE[key] = _as_rank_0_compiled(_CACHE[key], text, path, bucket_mb)
    if collectives_in_graphs is None:
        collectives_in_graphs = in_graphs_by_default(dist.get_backend() if dist.is_initialized() else "gloo")
    return Plan(_CACHE[key][0], compile=compile, collectives_in_graphs=collectives_in_graphs,
                compile_backend=compile_backend)


def _raise_on_every_rank(failure: str | None, error: Exception | None = None) -> None:
    """Collective: each rank's failure (None where it has none), gathered; where any rank has one, this
    rank raises `error`, its own, or else a RuntimeError naming the ranks that failed."""
    failures = all_gather_json(failure)
    if not any(failures):
        return
    if error is not None:
        raise error
    raise RuntimeError("; ".join(f for f in failures if f) + ": give every rank the same file, torch and "
                       f"model code (this is rank {dist.get_rank()})")


def _as_rank_0_compiled(mine: tuple[Compiled, list, Machine], text: str, path: str,
                        bucket_mb: float) -> tuple[Compiled, list, Machine]:
    """Rank 0's search answers and cost figures, sent to every rank; a rank whose own differ compiles
    again on rank 0's (answers replayed, HiGHS is not run; plans rated with rank 0's figures where the
    compile compares them), which gives rank 0's plan where the file, torch and model code agree. Where
    they do not, the replay asks for programs rank 0's compile did not: every rank raises, naming the
    ranks."""
    _, answers, machine = mine
    sent = [(answers, machine) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    result, failure = mine, None
    if sent[0] != (answers, machine):
        answers, machine = sent[0]
        try:
            with SolutionLog(answers):
                result = compile_par(parse(text, path), bucket_mb, machine), answers, machine
        except LogMismatch as mismatch:
            failure = f"rank {dist.get_rank()} cannot compile {path} as rank 0 did ({mismatch})"
    _raise_on_every_rank(failure)
    return result


def default_device() -> torch.device:
    """The CUDA device of this rank where the process group runs NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Plan:
    """A compiled `.par` file: the layouts, the generated module, and what runs it on this rank."""

    def __init__(self, compiled: Compiled, compile: bool = False, collectives_in_graphs: bool = False,
                 compile_backend: str = "inductor"):
        self.compiled = compiled
        self.mesh = compiled.program.mesh
        if compile and (unknown := check_backend(compile_backend)):
            raise ValueError(unknown)
        refused = cannot_compile(compiled.programs) if compile else None
        if refused:
            raise NotImplementedError(refused)
        if compile:
            self._generated = compile_pieces(load_module(compiled.source_with_pieces(collectives_in_graphs)),
                                             compile_backend)
        else:
            self._generated = load_module(compiled.source)
        self._runtimes: dict[torch.device, object] = {}
        bound = compiled.bound
        self.input_names = [slot.name for slot in compiled.program.inputs]
        self.input_layouts = {slot.name: slot.layout for slot in compiled.program.inputs}
        self.signature: inspect.Signature = bound.signature
        self.out_spec = bound.exported.call_spec.out_spec

    def runtime(self, device: torch.device | str | None = None):
        device = torch.device(device) if device is not None else default_device()
        if device not in self._runtimes:
            self._runtimes[device] = Runtime(self.mesh, device)
            if self.mesh.size > 1:
                self._agree_across_ranks(device)
        return self._runtimes[device]

    def _agree_across_ranks(self, device: torch.device) -> None:
        """Every rank compiles the file itself; their modules must be the same one, or the ranks would
        issue different collectives and hang or compute nonsense. Files that differ between machines,
        different versions of torch or of the model's code would do that, and so would a search stopped by
        its time limit at different points on ranks of different speed where `load` ran before the
        process group was initialised (after, `load` gives every rank rank 0's plan): one all-gather of
        a digest of the generated module finds it before the first step."""
        # the file's path is in the module's header, and may differ between machines that agree on the rest
        path = self.compiled.par.source.path
        source = self.compiled.source.replace(path, "FILE.par") if path else self.compiled.source
        digest = hashlib.sha256(source.encode()).digest()
        mine = torch.tensor([int.from_bytes(digest[:7], "big")], dtype=torch.int64, device=device)
        everyone = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
        dist.all_gather_single(everyone, mine)
        digests = everyone.tolist()
        if len(set(digests)) > 1:
            groups: dict[int, list[int]] = {}
            for rank, value in enumerate(digests):
                groups.setdefault(value, []).append(rank)
            described = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {value:014x}"
                                  for value, ranks in groups.items())
            raise RuntimeError(f"the ranks compiled {self.compiled.par.source.path} into different modules "
                               f"({described}; this is rank {dist.get_rank()}, {digests[dist.get_rank()]:014x}): "
                               "give every rank the same file, torch and model code; a layout search that "
                               "stopped at its time limit on some programs (slow ranks find less by then) is "
                               "the other cause: call pardsl.load after init_process_group, which gives "
                               "every rank rank 0's plan")

    # -- the model -------------------------------------------------------------------------------------

    @property
    def pipelined(self) -> bool:
        """Whether the plan has a `pipeline` statement: `plan.module()` is then a PipelineModule."""
        return self.compiled.pipeline is not None

    def module(self, checkpoint: str | None = None, device: torch.device | str | None = None, loss_fn=None,
               strict: bool = True, verify: bool = True, allow_shared_folder: bool = False):
        """This rank's shards of the model, as a module that takes the serial model's arguments.

        With a checkpoint (a pardsl checkpoint folder, a `model.safetensors` file, or a Hugging Face folder
        with `model.safetensors.index.json`), each rank reads only its own slices of each tensor. Without
        one, the parameters are the values the model's factory gives under the current torch seed, as the
        serial model's would be (so set the same seed on every rank): the factory runs on the meta device
        and each parameter is made from what it did, one at a time, this rank keeping its shard.
        A pardsl checkpoint is checked whole before any of it is read, and must be of this plan's model;
        `strict=False` loads one saved from another model (a deliberate transfer), names matched as for a
        Hugging Face checkpoint. Each file of a pardsl checkpoint is checked against the sha256 its index
        gives before it is read (`verify=False`: not); a checkpoint in a folder that other users could write
        is refused unless `allow_shared_folder=True`.

        A pipelined plan gives a `PipelineModule`: this rank's stages, trained by `model.step(...)`. Its loss
        is the model's own (a scalar it returns, such as a Hugging Face model's `loss`), or
        `loss_fn(output, target)` of the model's output on one micro-batch (its structure, with local
        tensors) and the micro-batch's part of the `target` given to `step`.
        """
        rt = self.runtime(device)
        if self.pipelined:
            generated = self._generated
            stages = {index: generated.STAGES[index](rt) for index in Pipeline.of_rank(generated, rt)}
            self._load(rt, [(stage, stage.PARAMETERS, stage.BUFFERS) for _, stage in sorted(stages.items())],
                       checkpoint, strict, verify=verify, allow_shared_folder=allow_shared_folder)
            return PipelineModule(self, Pipeline(generated, rt, stages, self._pipeline_loss(loss_fn)))
        spmd = self._generated.CompiledModule(rt)
        self._load(rt, [(spmd, self._generated.PARAMETERS, self._generated.BUFFERS)], checkpoint, strict,
                   verify=verify, allow_shared_folder=allow_shared_folder)
        return ParallelModule(self, spmd)

    def _load(self, rt, parts, checkpoint: str | None, strict: bool, verify: bool = True,
              allow_shared_folder: bool = False) -> None:
        """Fill each generated module of `parts` (module, its parameters' table, its buffers' table) with
        this rank's shards: from the checkpoint, else the factory's values."""
        if checkpoint is None:
            full = self._full_state()
            for module, _, _ in parts:
                module.load_full_state_dict(full)
            del full
            return
        with torch.no_grad():
            for module, _, buffers in parts:
                for name, (attr, layout, _) in buffers.items():
                    getattr(module, attr).copy_(rt.shard(self.compiled.bound.buffer_values[name], layout))
        load_model_state(parts, self, checkpoint, strict=strict, verify=verify,
                         allow_shared_folder=allow_shared_folder)

    def _full_state(self):
        """Every parameter and buffer of the serial model by name, its values the factory's under the current
        seed: each parameter made when asked for from a record of the factory run on the meta device
        (pardsl/model/deferred_init.py), so a rank holds one whole tensor at a time. A factory that needs
        values while it builds cannot run there: the serial model is built whole instead."""
        par, bound = self.compiled.par, self.compiled.bound
        seed = torch.get_rng_state()
        with import_paths(*par_import_paths(par.source.path, par.model.module)):
            factory = load_factory(par.model, par.source.path)
            try:
                return InitialValues(record(lambda: factory(**dict(par.model.kwargs))), bound.buffer_values)
            except Exception:  # the factory's own code, on meta tensors: a `.item()`, a data-dependent branch
                torch.set_rng_state(seed)
                serial = build_model(par.model, par.source.path)
        full = full_state(serial)
        full.update((name, t) for name, t in bound.buffer_values.items() if name not in full)
        return full

    def _pipeline_loss(self, loss_fn):
        """torch's schedule calls loss(stage output, target micro-batch) on the last stage."""
        if loss_fn is not None:
            return lambda output, target: loss_fn(pytree.tree_unflatten(list(output), self.out_spec), target)
        index = loss_output(self._generated.STAGES[-1].OUTPUTS)
        if index is None:
            raise TypeError(f"{self.compiled.par.model.text} returns no single scalar loss: pass "
                            "`loss_fn(output, target)` to `plan.module()` and the target to `step`")
        return lambda output, target: output[index]

    # -- inputs ----------------------------------------------------------------------------------------

    def _bind_arguments(self, args, kwargs) -> dict[str, object]:
        try:
            bound = self.signature.bind_partial(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self.compiled.par.model.text}: {error}") from None
        # what a forward taking **kwargs passes on (an input declared outside its own arguments) by name
        arguments = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            else:
                arguments[name] = value
        missing = [name for name in self.input_names if name not in arguments]
        if missing:
            raise TypeError(f"missing input(s) {', '.join(missing)}: the .par file declares "
                            f"{', '.join(self.input_names)}")
        undeclared = [name for name in arguments if name not in self.input_layouts]
        if undeclared:
            raise TypeError(f"argument(s) {', '.join(undeclared)} are not declared as `input` in "
                            f"{self.compiled.par.source.path}; the model was traced with their defaults")
        return arguments

    def shard_inputs(self, *args, local_batch: bool = False, device=None, **kwargs) -> dict[str, torch.Tensor]:
        """This rank's pieces of full inputs given by position or by forward() argument name, by name:
        call the model with `model(**plan.shard_inputs(...))`.

        `local_batch=True`: the inputs are already this rank's part of the batch (a sampler over
        `plan.data_parallel`), so only the splits over the other mesh axes are taken.
        """
        rt = self.runtime(device)
        arguments = self._bind_arguments(args, kwargs)
        local = {}
        for name in self.input_names:
            value = arguments[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"input `{name}` must be a tensor, not {type(value).__name__}")
            layout = self.input_layouts[name]
            self._check_sizes(name, value, layout, local_batch)
            if local_batch:
                layout = Layout(tuple(B if axis in self.data_parallel_axes else p
                                      for axis, p in enumerate(layout.placements)))
            if self.pipelined:
                local[name] = rt.shard_micro_batched(value.to(rt.device), layout, self.compiled.pipeline.microbatches)
            else:
                local[name] = rt.shard(value.to(rt.device), layout)
        return local

    def _check_sizes(self, name: str, value: torch.Tensor, layout: Layout, local_batch: bool) -> None:
        decl = next(d for d in self.compiled.par.inputs if d.name == name)
        if value.dim() != len(decl.shape):
            raise ValueError(f"input `{name}` has {value.dim()} dims; the .par file declares {len(decl.shape)}")
        for dim, (size, declared, dim_name) in enumerate(zip(value.shape, decl.shape, decl.dim_names)):
            axes = [a for a in layout.axes_splitting(dim) if not (local_batch and a in self.data_parallel_axes)]
            expected = declared // self.data_parallel[1] if local_batch and dim == 0 else declared
            if dim_name is None and size != expected:
                raise ValueError(f"input `{name}` has size {size} in dim {dim}, which the .par file fixes at "
                                 f"{expected}; name the dim (`{name} : ...[n={declared}, ...]`) to let it vary")
            ways = math.prod(self.mesh.axis_sizes[a] for a in axes) * (layout.units_of(dim) if axes else 1)
            if size % ways:
                over = " × ".join(f"{self.mesh.axis_names[a]} = {self.mesh.axis_sizes[a]}" for a in axes)
                raise ValueError(f"input `{name}`: dim {dim}" + (f" (`{dim_name}`)" if dim_name else "") +
                                 f" has size {size}, which the mesh cannot split over {over}: "
                                 f"it needs a multiple of {ways}")

    @property
    def data_parallel_axes(self) -> tuple[int, ...]:
        """Mesh axes that split the batch (dim 0) of the inputs."""
        return tuple(axis for axis in range(self.mesh.ndim)
                     if any(layout.placements[axis].is_split and layout.placements[axis].dim == 0
                            for layout in self.input_layouts.values()))

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this rank's part of the batch, for a `DistributedSampler(num_replicas=size, rank=rank)`."""
        rt = self.runtime()
        rank, size = 0, 1
        for axis in self.data_parallel_axes:
            name = self.mesh.axis_names[axis]
            rank, size = rank * rt.size[name] + rt.coordinate[name], size * rt.size[name]
        return rank, size

    @property
    def parameter_layouts(self) -> dict[str, tuple[str, tuple[str, ...], tuple[int, ...]]]:
        """State-dict name → (attribute of the generated module, layout per mesh axis, global shape); in a
        pipelined plan, of the first stage that holds it."""
        return self._tables("PARAMETERS")

    @property
    def buffer_layouts(self) -> dict[str, tuple[str, tuple[str, ...], tuple[int, ...]]]:
        return self._tables("BUFFERS")

    def _tables(self, kind: str) -> dict:
        merged = {}
        for holder in (self._generated.STAGES if self.pipelined else [self._generated]):
            for name, entry in getattr(holder, kind).items():
                merged.setdefault(name, entry)
        return merged


class ParallelModule(torch.nn.Module):
    """One rank's part of the model: the generated SPMD module behind the serial model's signature.

    `model(...)` takes the local inputs `plan.shard_inputs` gives (by position or name) and returns what the
    serial model returns (a `ModelOutput`, a dict, a tuple, a tensor), each tensor this rank's local value
    in its output layout: the whole value where the layout is B, its shard where it is S.
    """

    def __init__(self, plan: Plan, spmd: torch.nn.Module):
        super().__init__()
        self.plan = plan
        self.spmd = spmd

    @property
    def rt(self):
        return self.spmd.rt

    def forward(self, *args, **kwargs):
        arguments = self.plan._bind_arguments(args, kwargs)
        flat = self.spmd(*(arguments[name] for name in self.plan.input_names))
        return pytree.tree_unflatten(list(flat), self.plan.out_spec)

    def named_shards(self):
        """(state-dict name, local parameter, layout key) for every parameter, tied ones under one name."""
        for name, (attr, layout, _) in self.plan.parameter_layouts.items():
            yield name, getattr(self.spmd, attr), layout

    def parts(self) -> list[tuple[int | None, torch.nn.Module, dict, dict]]:
        """What this rank holds, as (pipeline stage, generated module, its parameters' table, its buffers'
        table): here the one module, of no stage."""
        return [(None, self.spmd, self.plan.parameter_layouts, self.plan.buffer_layouts)]

    def copies(self, name: str, layout: tuple[str, ...]) -> int:
        """How many ranks hold the same piece of a parameter as this rank: the axes where it is B."""
        mesh = self.rt.mesh
        return math.prod(mesh.axis_sizes[a] for a, p in enumerate(Layout.from_key(layout).placements) if not p.is_split)


class PipelineModule(torch.nn.Module):
    """This rank's stages of a pipelined plan. `model.step(...)` runs one training step's forwards and
    backwards over the whole batch, split into the plan's micro-batches and ordered by its schedule
    (torch.distributed.pipelining): the gradients are then in `.grad`, summed over micro-batches the way
    the serial model's are over the batch (each micro-batch's mean loss, averaged), for an optimizer over
    `model.parameters()`.
    """

    def __init__(self, plan: Plan, pipeline):
        super().__init__()
        self.plan = plan
        self.pipeline = pipeline
        self.stages = torch.nn.ModuleList([pipeline.modules[i] for i in sorted(pipeline.modules)])

    @property
    def rt(self):
        return self.pipeline.rt

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline.is_first

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage: `step` returns the loss there."""
        return self.pipeline.is_last

    def forward(self, *args, **kwargs):
        raise TypeError("a pipelined plan runs forward and backward together, one micro-batch after another: "
                        "call `model.step(**plan.shard_inputs(...))`")

    def step(self, *args, target: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
        """Forward and backward of every micro-batch. `args`/`kwargs`: this rank's inputs as
        `plan.shard_inputs` gives them (every rank passes them; the first stage reads them). `target`: the
        loss function's, split into micro-batches along dim 0. Returns the step's loss (the mean of the
        micro-batches' losses) on the last stage's ranks, None on the others."""
        arguments = self.plan._bind_arguments(args, kwargs)
        losses, _ = self.pipeline.step([arguments[name] for name in self.plan.input_names], target)
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()

    def named_shards(self):
        """(state-dict name, local parameter, layout key) of every stage this rank runs: a parameter two of
        its stages hold (tied weights) once per stage."""
        for stage in self.stages:
            for name, (attr, layout, _) in stage.PARAMETERS.items():
                yield name, getattr(stage, attr), layout

    def parts(self) -> list[tuple[int | None, torch.nn.Module, dict, dict]]:
        """What this rank holds, as (pipeline stage, generated module, its parameters' table, its buffers'
        table): one per stage it runs."""
        return [(index, module, module.PARAMETERS, module.BUFFERS)
                for index, module in sorted(self.pipeline.modules.items())]

    def copies(self, name: str, layout: tuple[str, ...]) -> int:
        """How many (rank, stage) pairs hold the same piece of a parameter: the axes where it is B, other
        than the pipeline axis, times the stages that hold it."""
        mesh = self.rt.mesh
        axis = mesh.axis_names.index(self.pipeline.axis)
        holders = dict(self.pipeline.shared).get(name, (0,))
        return len(holders) * math.prod(mesh.axis_sizes[a] for a, p in enumerate(Layout.from_key(layout).placements)
                                        if not p.is_split and a != axis)


def clip_grad_norm_(model: ParallelModule | PipelineModule, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of a ParallelModule's (or PipelineModule's) shards so that their global norm
    (the serial model's gradient norm) is at most `max_norm`; returns that global norm.

    Each rank sums its shards' |g|^p, each divided by the number of ranks holding the same copy
    (`model.copies`: the sizes of the axes where the parameter is B; a pipeline's stages hold different
    parameters), so one all-reduce over the world gives the global sum.
    """
    norm_type = float(norm_type)
    grads, total = [], None
    for name, parameter, layout in model.named_shards():
        if parameter.grad is None:
            continue
        grads.append(parameter.grad)
        replicas = model.copies(name, layout)
        local = parameter.grad.detach().float()
        if norm_type == math.inf:
            part = local.abs().max()
        else:
            part = local.abs().pow(norm_type).sum() / replicas
        total = part if total is None else (torch.maximum(total, part) if norm_type == math.inf else total + part)
    if total is None:
        return torch.tensor(0.0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM)
    norm = total if norm_type == math.inf else total.pow(1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))
    return norm


__all__ = ["Plan", "ParallelModule", "PipelineModule", "load", "clip_grad_norm_"]
