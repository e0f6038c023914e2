"""Pipeline parallelism: the lowered program cut into stages, as one pass over its statements.

`pipeline pp : schedule 1F1B, microbatches 4, cut before model.layers.2` makes the mesh axis `pp` hold
stages instead of shards. What that changes, stage by stage of the compiler:

- before binding, the inputs' batch dim (dim 0, what torch.distributed.pipelining splits) is divided by the
  micro-batch count: the program is traced, typed and lowered for one micro-batch;
- every layout is B on the pipeline axis (a stage's ranks along it hold different ops, not shards), so the
  other axes' layouts, inference and lowering are what they would be without a pipeline;
- the lowered program is cut (`split_program`): each statement goes to the stage of the op it is there for,
  where the ops of the submodule named in a cut, and everything after, start a new stage. A value made in
  one stage and read in a later one crosses every boundary between, as a stage output and the next stage's
  input (point-to-point, sent by torch.distributed.pipelining's stage). Values computed from parameters,
  buffers and constants alone (a transposed or gathered weight, an attention mask or rotary table built
  from positions) are recomputed in each stage that reads them instead: parameters never cross, nor a
  causal mask that would take a receive buffer of [seq, seq] per micro-batch. A parameter read by
  several stages (tied embeddings) is held by each of them, and its gradient summed over their ranks
  once per step (Megatron's embedding all-reduce);
- each stage's gradient buckets and gather groups are its own.

`cut balanced` chooses the cuts among the starts of repeated layers so that the cost model's estimated
stage times are as even as they can be.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pardsl.language.diagnostics import CompileError, Diagnostic, DiagnosticSink
from pardsl.language.syntax import ParFile, PipelineDecl
from pardsl.layouts.algebra import B
from pardsl.layouts.oprules import drawn_ops, is_drawn_whole, op_name
from pardsl.planning.cost import repeated_layer
from pardsl.planning.pipeline_search import balanced_cuts
from pardsl.program.ir import OutputSlot, Statement, TensorSlot, made_from_constants
from pardsl.runtime.schedules import SCHEDULES, micro_batches_held, schedule_class, stages_of_rank


def _canonical_schedule(name: str) -> str | None:
    return next((known for known in SCHEDULES if known.lower() == name.lower()), None)


def check_pipeline(par: ParFile) -> PipelineDecl:
    """What the `pipeline` statement says on its own and with the mesh and inputs; raises CompileError.
    Returns the statement with the schedule's canonical name."""
    pipeline = par.pipeline
    sink = DiagnosticSink(par.source)
    axes = {axis.name: axis for axis in par.mesh.axes}
    if pipeline.axis not in axes:
        sink.error("E070", f"the pipeline axis `{pipeline.axis}` is not a mesh axis", pipeline.axis_span,
                   f"the mesh has {', '.join(axes)}: add `{pipeline.axis} = 2` to it")
    schedule = _canonical_schedule(pipeline.schedule)
    if schedule is None:
        sink.error("E071", f"unknown pipeline schedule `{pipeline.schedule}`", pipeline.schedule_span,
                   f"torch.distributed.pipelining's schedules: {', '.join(SCHEDULES)}")
    else:
        takes = SCHEDULES[schedule][1]
        if takes is not None and pipeline.stages_per_rank != takes:
            sink.error("E075", f"{schedule} runs {takes} stage{'s' if takes > 1 else ''} per rank, not "
                       f"{pipeline.stages_per_rank}", pipeline.stages_per_rank_span or pipeline.schedule_span,
                       "Interleaved1F1B, LoopedBFS and InterleavedZeroBubble take several (`stages per rank 2`)"
                       if takes == 1 else f"write `stages per rank {takes}`")
    if pipeline.stages_per_rank < 1:
        sink.error("E075", "a rank needs at least one stage", pipeline.stages_per_rank_span, "write `stages per rank 1`")
    if pipeline.microbatches < 1:
        sink.error("E074", "the pipeline needs at least one micro-batch", pipeline.microbatches_span,
                   "write `microbatches 4` (at least the number of stages keeps every rank busy)")
    elif pipeline.axis in axes:
        stages = axes[pipeline.axis].size * pipeline.stages_per_rank
        if schedule == "1F1B" and pipeline.microbatches < stages and not pipeline.searched & {"schedule", "microbatches"}:
            sink.error("E074", f"1F1B runs at least as many micro-batches as stages: {pipeline.microbatches} for "
                       f"{stages} stages", pipeline.microbatches_span, f"write `microbatches {stages}` or more, "
                       "or `schedule GPipe`")
        if pipeline.cuts and len(pipeline.cuts) + 1 != stages:
            sink.error("E075", f"{len(pipeline.cuts)} cut{'s' if len(pipeline.cuts) != 1 else ''} make "
                       f"{len(pipeline.cuts) + 1} stages; {pipeline.axis} = {axes[pipeline.axis].size} with "
                       f"{pipeline.stages_per_rank} stage(s) per rank runs {stages}", pipeline.cut_span,
                       f"name {stages - 1} submodule(s) to cut before, or write `cut balanced`")
        for decl in par.inputs:
            if not decl.shape:
                sink.error("E074", f"input `{decl.name}` has no batch dim to split into micro-batches",
                           decl.span, "a pipelined model's inputs split along dim 0")
            elif decl.shape[0] % pipeline.microbatches:
                sink.error("E074", f"input `{decl.name}`: a batch of {decl.shape[0]} does not split into "
                           f"{pipeline.microbatches} micro-batches", decl.dim_spans[0] if decl.dim_spans else decl.span,
                           f"use a batch that is a multiple of {pipeline.microbatches}")
            for name, span in zip(decl.dim_names, decl.dim_spans):
                if name is not None:
                    sink.error("E078", f"named dim `{name}` in a pipelined plan: stages exchange activations "
                               "of fixed shapes", span, "give the dim a fixed size")
    sink.raise_if_any()
    return dataclasses.replace(pipeline, schedule=schedule)


def micro_batched(par: ParFile) -> ParFile:
    """The file as one micro-batch sees it: every input's dim 0 divided by the micro-batch count."""
    m = par.pipeline.microbatches
    inputs = tuple(dataclasses.replace(decl, shape=(decl.shape[0] // m, *decl.shape[1:])) for decl in par.inputs)
    return dataclasses.replace(par, inputs=inputs)


def check_layouts(bound, pipeline: PipelineDecl) -> None:
    """A layout written with a split or partial sum on the pipeline axis is E076: the axis holds stages.
    Dropout in training is E078: serial draws one mask for the whole batch, micro-batches one each, in the
    schedule's order."""
    sink = DiagnosticSink(bound.par.source)
    draws = [node for node in bound.graph.nodes if node.op == "call_function" and _draws(node)]
    if draws:
        where = bound.module_paths.get(draws[0].name) or "the model's own forward()"
        what = (f"dropout with p = {draws[0].args[1]}" if draws[0].target is torch.ops.aten.dropout.default
                else f"a random draw (`{op_name(draws[0])}`)")
        sink.error("E078", f"{what} in a pipelined plan (in {where})",
                   bound.par.model.span, "micro-batches cannot draw the values serial draws for the whole batch: "
                   "set the model's dropout (and stochastic depth) to 0, or leave the pipeline out")
    axis = bound.mesh.axis_index(pipeline.axis)
    for pin in bound.pins.values():
        if pin.layout.placements[axis] != B:
            sink.error("E076", f"`{pin.entry.target}` is {pin.layout.placements[axis]} on the pipeline axis "
                       f"`{pipeline.axis}`", pin.entry.layout.span,
                       f"the ranks along {pipeline.axis} hold different stages, not shards: write B there")
    sink.raise_if_any()


def _draws(node: torch.fx.Node) -> bool:
    """Whether the op draws random values: dropout in training with p > 0, a random op computed whole
    (stochastic depth's `rand`)."""
    if node.target is torch.ops.aten.dropout.default:
        return node.args[1] != 0 and (len(node.args) < 3 or bool(node.args[2]))
    return is_drawn_whole(node)


def check_unsplit(typed, pipeline: PipelineDecl) -> None:
    """What inference completed is B on the pipeline axis too: a split there would make ranks running
    different stages meet in a collective."""
    axis = typed.mesh.axis_index(pipeline.axis)
    layouts = [(name, node.op_layout) for name, node in typed.nodes.items()] + \
        list(typed.placeholder_layouts.items())
    split = [name for name, layout in layouts if layout.placements[axis] != B]
    if split:
        raise CompileError([Diagnostic(
            "E076", f"inference split `{split[0]}` (and {len(split) - 1} more) on the pipeline axis "
            f"`{pipeline.axis}`", pipeline.axis_span, ("write B on that axis for the tensors it reads",))],
            typed.bound.par.source)


# -- where the stages start ------------------------------------------------------------------------


def _inside(path: str | None, module: str) -> bool:
    return bool(path) and (path == module or path.startswith(module + "."))


def stage_of_nodes(typed, pipeline: PipelineDecl, machine=None) -> tuple[dict[str, int], list[str]]:
    """Each op's stage, and the submodule each stage after the first starts with. Cuts the file names must
    be submodules the forward calls, in the order it calls them; `cut balanced` chooses them."""
    bound = typed.bound
    order = list(typed.nodes)
    paths = bound.module_paths
    stages = bound.mesh.axis_sizes[bound.mesh.axis_index(pipeline.axis)] * pipeline.stages_per_rank
    if pipeline.balanced:
        starts, names = balanced_cuts(typed, stages, machine)
    else:
        sink = DiagnosticSink(bound.par.source)
        starts, names = [], []
        for module, span in pipeline.cuts:
            first = next((i for i, name in enumerate(order) if _inside(paths.get(name), module)), None)
            if first is None:
                known = sorted({layer for layer in (repeated_layer(paths.get(n)) for n in order) if layer})
                sink.error("E072", f"`{module}` names no submodule the model's forward calls", span,
                           "cut before one of " + ", ".join(known[:6]) + (" ..." if len(known) > 6 else "")
                           if known else "name a submodule (model.layers.2)")
            elif first == 0:
                sink.error("E073", f"a cut before `{module}` leaves the first stage empty: it is where the "
                           "forward starts", span, "cut before a later submodule")
            elif starts and first <= starts[-1]:
                sink.error("E073", f"`{module}` runs before `{names[-1]}`: cuts go in the order the forward "
                           "runs them", span, f"write `{module}` before `{names[-1]}`")
            else:
                starts.append(first)
                names.append(module)
        sink.raise_if_any()
    stage_of, stage = {}, 0
    for index, name in enumerate(order):
        while stage < len(starts) and index >= starts[stage]:
            stage += 1
        stage_of[name] = stage
    return stage_of, names


# -- the cut --------------------------------------------------------------------------------------


class Stage(NamedTuple):
    """One stage's part of the program, before its buckets and gather groups are formed: what
    `lowering.lower_in_stages` finishes into a stage's program."""

    statements: list[Statement]
    parameters: list[TensorSlot]
    buffers: list[TensorSlot]
    inputs: list[TensorSlot]  # the model's inputs (stage 0), else the values the stage before sends
    outputs: list[OutputSlot]  # the values it sends on, or the model's outputs (the last stage)


@dataclass(frozen=True)
class PipelinePlan:
    """What the pipeline pass decided, beside the stages' programs."""

    axis: str
    schedule: str
    microbatches: int
    stages_per_rank: int
    cut_before: tuple[str, ...]  # the submodule each stage after the first starts with
    shared_parameters: tuple[tuple[str, tuple[int, ...]], ...]  # (state-dict name, the stages that hold it)
    output_meta: tuple[tuple[str, bool], ...]  # the model's outputs: (dtype, whether it has a gradient)


def split_program(typed, stage_of: dict[str, int], stages: int, statements: list[Statement],
                  parameters: list[TensorSlot], buffers: list[TensorSlot], inputs: list[TensorSlot],
                  outputs: list[OutputSlot]) -> list[Stage]:
    """The program's statements cut into `stages` programs (see the module's docstring)."""
    mesh = typed.mesh
    definer: dict[str, int] = {}
    for index, statement in enumerate(statements):
        for target in statement.targets:
            definer[target] = index
    reads = [[v for v in statement.instruction.reads() if not v.startswith("self.")] for statement in statements]
    # statements computed from parameters, buffers and constants alone (a gathered weight; an attention
    # mask or rotary table built from positions): made again in each stage that reads them, not sent,
    # which would keep a receive buffer per micro-batch (a causal mask's is [seq, seq]); a random draw is
    # made once
    from_parameters = made_from_constants(statements, drawn_ops(typed.bound.graph))
    stage_of_statement: list[int] = []
    for index, statement in enumerate(statements):
        if statement.node in stage_of:
            stage_of_statement.append(stage_of[statement.node])
        else:  # not there for an op: where the values it reads are made
            stage_of_statement.append(max((stage_of_statement[definer[v]] for v in reads[index] if v in definer),
                                          default=0))
    members: list[list[int]] = [[] for _ in range(stages)]
    for index, stage in enumerate(stage_of_statement):
        if index not in from_parameters:
            members[stage].append(index)
    output_vars = [slot.var for slot in outputs]
    for stage in range(stages):  # a value made from parameters alone is made again where it is read
        chosen = set(members[stage])
        pending = [v for i in members[stage] for v in reads[i]] + (output_vars if stage == stages - 1 else [])
        while pending:
            var = pending.pop()
            index = definer.get(var)
            if index is not None and index in from_parameters and index not in chosen:
                chosen.add(index)
                pending.extend(reads[index])
        members[stage] = sorted(chosen)
    defined_in = {}
    for stage, indices in enumerate(members):
        for index in indices:
            for target in statements[index].targets:
                defined_in.setdefault(target, stage)
    read_in: dict[str, set[int]] = {}
    for stage, indices in enumerate(members):
        for index in indices:
            for var in reads[index]:
                read_in.setdefault(var, set()).add(stage)
    for var in output_vars:
        read_in.setdefault(var, set()).add(stages - 1)
    input_vars = [slot.var for slot in inputs]
    order = input_vars + [t for index, statement in enumerate(statements) if index not in from_parameters
                          for t in statement.targets]
    crossing: list[list[str]] = [[]]  # crossing[s]: what stage s receives (s >= 1)
    for stage in range(1, stages):
        crossing.append([v for v in dict.fromkeys(order)
                         if defined_in.get(v, -1) < stage and any(s >= stage for s in read_in.get(v, ()))])
    input_slots = {slot.var: slot for slot in inputs}
    result = []
    for stage in range(stages):
        body = [statements[i] for i in members[stage]]
        used = {v.removeprefix("self.") for statement in body for v in statement.instruction.reads()
                if v.startswith("self.")}
        if stage == stages - 1:
            used |= {slot.var.removeprefix("self.") for slot in outputs}
        stage_inputs = inputs if stage == 0 else [_slot(v, statements, definer, input_slots, typed, mesh)
                                                  for v in crossing[stage]]
        stage_outputs = outputs if stage == stages - 1 else [
            OutputSlot(slot.var, slot.var, slot.shape, slot.local_shape, slot.layout)
            for slot in (_slot(v, statements, definer, input_slots, typed, mesh) for v in crossing[stage + 1])]
        result.append(Stage(body, [p for p in parameters if p.var in used], [b for b in buffers if b.var in used],
                            list(stage_inputs), stage_outputs))
    return result


def _slot(var: str, statements, definer, input_slots, typed, mesh) -> TensorSlot:
    """A value crossing a stage boundary, as the receiving stage's input: its layout, shapes and dtype, and
    whether a gradient comes back for it."""
    if var in input_slots:
        return input_slots[var]
    statement = statements[definer[var]]
    layout = statement.layouts[statement.targets.index(var)]
    origin = var if var in typed.bound.tensors else statement.node
    info = typed.info(origin)
    return TensorSlot(var, var, "activation", info.shape, layout.local_shape(info.shape, mesh), str(info.dtype),
                      layout, origin in typed.requires_grad)


def shared_parameters(stages) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Parameters held by more than one of the stages' programs (tied weights), with those stages."""
    holders: dict[str, list[int]] = {}
    for index, stage in enumerate(stages):
        for parameter in stage.parameters:
            if parameter.requires_grad:
                holders.setdefault(parameter.name, []).append(index)
    return tuple((name, tuple(held)) for name, held in holders.items() if len(held) > 1)


__all__ = ["SCHEDULES", "PipelinePlan", "Stage", "check_pipeline", "check_layouts", "check_unsplit", "micro_batched",
           "split_program", "stage_of_nodes", "shared_parameters", "stages_of_rank", "schedule_class",
           "micro_batches_held"]
