"""The pipeline chosen: `pipeline pp : schedule ?, microbatches ?, cut ?` (any of the three).

For each of torch's schedules (GPipe and 1F1B with one stage per rank; Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble and DualPipeV with two) and each micro-batch count (a divisor of the
batch that leaves each micro-batch's rows split as the plan splits them, and that the schedule takes),
the cuts are chosen by a dynamic program over the layer boundaries (Alpa's inter-operator pass, on this
cost model): the stages' estimated times per micro-batch as even as they can be, each rank within the
memory bound with the micro-batches its stage holds at once under the schedule. The option estimated
fastest within the bound is kept (none within it: the one needing least); every option priced is
reported.

The model of a step, per micro-batch stage times t_k (forward and backward of the stage's ops at the
micro-batch's size, and its activations sent on and their gradient received back), w the largest of the
ranks' times per micro-batch (their stages together), W that rank's weight-gradient part of it, p ranks,
v stages a rank:
- GPipe, 1F1B: Σ t_k + (m - 1) · max t_k (the pipeline fills and drains once; 1F1B holds fewer
  micro-batches, not less time);
- Interleaved1F1B and LoopedBFS: m · w + (p - 1) · w / v (the bubble shrinks v times; LoopedBFS runs
  every micro-batch of a stage before the next stage, so it holds them all);
- InterleavedZeroBubble (ZB-H1): m · w + (p - 1) · (w - 2W) / v: each backward is split into the
  gradient of its inputs, which the stage before waits for, and of its weights, which fills the bubble;
- ZBVZeroBubble and DualPipeV (stages r and 2p - 1 - r on rank r): m · w + (p - 1) · max(0, w - 3W) / 2,
  no bubble where forward, input gradient and weight gradient take alike. DualPipeV's overlap of one
  micro-batch's forward with another's backward hides communication this model does not separate, so it
  is priced as ZB-V.
W: an op's backward is shared evenly among its differentiable operands, and the shares of its trained
parameters are weight gradient (a linear layer's backward: half input gradient, half weight gradient).
Collectives along the other axes (tensor parallelism's all-reduces) count in their stage's time, and the
gradient buckets once a step, exposed: each rank its own stages' (their segments' share of the uncut
program's buckets), all ranks at once, the step waiting for the longest. Op and collective times at
another micro-batch size scale with the rows they compute, the per-op overhead does not; layouts along
the other axes are the file's
completion, searched where the file asks (as the compile searches them for the pipeline chosen), and
parameter gathers (ZeRO-3 within a stage) are not priced.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

from pardsl.language.diagnostics import CompileError, Diagnostic
from pardsl.language.syntax import PipelineDecl
from pardsl.planning.cost import (
    Machine,
    collective_hiding,
    collective_seconds,
    default_machine,
    gather_groups,
    gathered_in_passing,
    memory_per_rank,
    op_costs,
    repeated_layer,
    slot_bytes,
    stage_buffer_slots,
)
from pardsl.layouts.oprules import drawn_ops
from pardsl.planning.descent import searched_or_greedy
from pardsl.planning.recipes import completed_recipes
from pardsl.planning.search import wants_search
from pardsl.runtime.schedules import micro_batches_held, rank_of_stage, stage_micro_batches_held

# the schedules searched, with the stages a rank runs under each
SEARCHED_SCHEDULES = (("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2),
                      ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2))
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class PipelineOption:
    """One pipeline priced: schedule, micro-batches, the submodules each later stage starts with, the
    estimated step, and the most memory a rank of the pipeline holds."""

    schedule: str
    stages_per_rank: int
    microbatches: int
    cut_before: tuple[str, ...]
    step_s: float
    memory: int
    within_bound: bool
    # the layouts on the other axes it was priced with: the file's own (completed or searched), or a known
    # recipe's (its name), whichever served this pipeline best
    priced_on: str = ""
    # of step_s: what its busiest rank computes and sends, every micro-batch through its stages (the rest
    # is the schedule's bubble), and the gradient buckets' synchronisation once a step
    busiest_s: float = 0.0
    synchronised_s: float = 0.0

    @property
    def bubble_s(self) -> float:
        """Of step_s, the time the busiest rank waits on the schedule's fill and drain."""
        return max(0.0, self.step_s - self.busiest_s - self.synchronised_s)


@dataclass(frozen=True)
class SegmentMemory:
    """What each segment holds on its rank, as cost.memory_per_rank counts a stage's program: the plan
    lowered cut at every layer boundary, the compile's passes applied (recomputation, precision), so
    that a stage of segments i to j is priced as the stage compiled there is. Activations are one
    micro-batch's at the traced size: `kept` what each segment keeps for backward, `region` the largest
    recomputed region it makes again (backward makes one region's at a time: a rank adds its stages' largest once);
    `received` and `returned` the bytes of torch's stage buffers a stage starting (ending) there keeps
    per micro-batch (cost.stage_buffer_slots)."""

    states: tuple[int, ...]  # parameters, gradients, optimizer state, compute-dtype copies
    groups: tuple[tuple[tuple[int, bool], ...], ...]  # its gather groups (cost.gather_groups)
    copies: tuple[int, ...]  # parameters converted where used outside a group, kept for backward
    kept: tuple[int, ...]
    region: tuple[int, ...]
    received: tuple[int, ...]
    returned: tuple[int, ...]
    inputs_kept: tuple[int, ...]  # of what a segment receives, what it keeps for backward
    # what it keeps of what it makes from constants alone (a mask, rotary tables), by name: every segment
    # makes its own, a stage of several makes each once
    constants: tuple[tuple[tuple[str, int], ...], ...]
    sent_only: tuple[int, ...]  # of `kept`, what it holds only as what it sends on: not held in a stage it ends
    # of those, what it makes once for every micro-batch (pardsl/passes/shared_constants.py): held once
    shared: tuple[tuple[tuple[str, int], ...], ...]


@dataclass(frozen=True)
class _Segments:
    """The program between consecutive layer boundaries: its ops' time at the traced micro-batch size
    (the part that scales with rows, and the per-op overhead that does not), its parameters' and
    the bytes it sends on to the next segment, and each op's segment."""

    names: tuple[str, ...]  # the submodule each segment after the first starts with
    scaled_s: tuple[float, ...]
    fixed_s: tuple[float, ...]
    weight_s: tuple[float, ...]  # the weight-gradient part of scaled_s
    sent_bytes: tuple[int, ...]
    segment_of: dict


class StageLowering(NamedTuple):
    """How the compile lowers a plan, handed to the pipeline search by the compiler (planning comes before
    the program, so it does not reach for lowering itself): `whole(typed)` the uncut program; `staged(typed)`
    a function of (stage_of, count) giving the stage programs through the passes after lowering, as the
    pipeline compiled from them has them."""

    whole: Callable
    staged: Callable


def choose_pipeline(typed, program, decl: PipelineDecl, machine: Machine, limit: int | None,
                    traced_microbatches: int, optimizer: str = "adamw", price_memory: bool = True,
                    lowering: StageLowering | None = None,
                    other_layouts: bool = True) -> tuple[PipelineDecl, tuple[PipelineOption, ...]]:
    """The pipeline the file leaves to the compiler (see the module's docstring): the statement with its
    `?` options decided, and every option priced, the chosen one first. `typed`: the plan traced at
    `traced_microbatches` micro-batches, `program` its lowered program (uncut), whose collectives along
    the other axes count in their stage's time, and its gradient buckets once a step. Each option's memory
    is the most a rank holds by cost.pipeline_rank_memory's count, on the plan's own stage programs
    (segment_memory): the model `explain` and the compile's check against the bound use. `price_memory`
    off: the step alone (pipelined_step_seconds); on, it needs the compile's `lowering`. `other_layouts`
    off: priced on `typed` alone, where the file would have layouts searched and recipes weighed too."""
    assert lowering is not None or not price_memory, "pricing memory needs the compile's lowering"
    bound = typed.bound
    axis = bound.mesh.axis_index(decl.axis)
    candidates = [("", typed, program)]
    if price_memory and other_layouts and wants_search(bound) and \
            any(size > 1 for other, size in enumerate(bound.mesh.axis_sizes) if other != axis):
        candidates = [("", *_searched_layouts(typed, decl, machine, limit, traced_microbatches, lowering)),
                      *_recipe_layouts(bound, axis, machine, lowering, limit)]
    options: dict[tuple, PipelineOption] = {}
    for index, (recipe, typed, program) in enumerate(candidates):
        try:
            priced = _options(typed, program, decl, machine, limit, traced_microbatches, optimizer, price_memory,
                              lowering)
        except CompileError:
            if index == 0:  # the file's own: what it says is the user's to fix
                raise
            continue  # a recipe's layouts no pipeline of the file takes
        for option in (dataclasses.replace(option, priced_on=recipe) for option in priced):
            # each pipeline priced with the layouts that serve it best
            key = (option.schedule, option.stages_per_rank, option.microbatches)
            if key not in options or _rank(option) < _rank(options[key]):
                options[key] = option
    ranked = sorted(options.values(), key=_rank)
    return pipeline_written_as(decl, ranked[0]), tuple(ranked)


def pipeline_written_as(decl: PipelineDecl, option: PipelineOption) -> PipelineDecl:
    """The pipeline statement with the option's schedule, micro-batches and cuts written in place of `?`."""
    return dataclasses.replace(
        decl, schedule=option.schedule, stages_per_rank=option.stages_per_rank, microbatches=option.microbatches,
        cuts=tuple((name, decl.cut_span) for name in option.cut_before), searched=frozenset())


def balanced_cuts(typed, stages: int, machine) -> tuple[list[int], list[str]]:
    """`cut balanced`: cuts at layer starts that minimise the largest stage's estimated compute (the cost
    model's per op; forward and backward scale alike), a small dynamic program over the layer boundaries.
    The op indices of the cuts (into the typed graph's nodes) and the layers they start."""
    bound = typed.bound
    order = list(typed.nodes)
    seconds = [op.forward_s for op in op_costs(typed, machine or default_machine())]
    candidates, seen = [], set()
    for index, name in enumerate(order):
        unit = repeated_layer(bound.module_paths.get(name))
        if unit and unit not in seen:
            seen.add(unit)
            if index > 0:
                candidates.append((index, unit))
    if len(candidates) < stages - 1:
        pipeline = bound.par.pipeline
        raise CompileError([Diagnostic(
            "E075", f"`cut balanced` finds {len(candidates)} layer boundaries for {stages} stages",
            pipeline.cut_span, (f"the model has {len(seen)} repeated layers; use fewer stages or name the cuts",))],
            bound.par.source)
    prefix = [0.0, *itertools.accumulate(seconds)]
    points = [0] + [index for index, _ in candidates] + [len(order)]

    def span_seconds(i: int, j: int) -> float:  # from point i up to point j
        return prefix[points[j]] - prefix[points[i]]

    last = len(points) - 1
    best = {(0, i): (span_seconds(0, i), []) for i in range(1, last + 1)}  # (stages used - 1, end point)
    for k in range(1, stages):
        for j in range(k + 1, last + 1):
            options = [(max(best[(k - 1, i)][0], span_seconds(i, j)), best[(k - 1, i)][1] + [i])
                       for i in range(k, j) if (k - 1, i) in best]
            if options:
                best[(k, j)] = min(options, key=lambda option: option[0])
    _, chosen = best[(stages - 1, last)]
    return [points[i] for i in chosen], [candidates[i - 1][1] for i in chosen]


def _rank(option: PipelineOption) -> tuple:
    """Within the bound before over it; within it the fastest, over it the one that holds least."""
    return _ranking(option.step_s, option.memory, option.within_bound)


def _ranking(step_s: float, memory: int, within_bound: bool) -> tuple:
    return (not within_bound, step_s if within_bound else memory)


def _recipe_layouts(bound, axis: int, machine: Machine, lowering: "StageLowering", limit: int | None) -> list[tuple]:
    """The known recipes on the axes beside the pipeline's (recipes.py), each named, completed and lowered whole:
    the search decides the layouts for the whole model before it is cut into stages, and a pipeline priced
    on its plan alone can be chosen for layouts the compile then leaves (torchtitan's 405B file with its
    layouts and pipeline left to the compiler: Interleaved 1F1B over 8 micro-batches, 101.6 GiB a rank
    against a bound of 22.9). A recipe the model's ops cannot take is left out."""
    found = []
    for name, typed in completed_recipes(bound, machine, (axis,), limit, bound.mesh.axis_sizes[axis]):
        try:
            found.append((name, typed, lowering.whole(typed)))
        except Exception:  # noqa: BLE001 - see above
            continue
    return found


def _options(typed, program, decl: PipelineDecl, machine: Machine, limit: int | None, traced_microbatches: int,
             optimizer: str, price_memory: bool, lowering: "StageLowering | None") -> list[PipelineOption]:
    """Every pipeline the statement leaves open, priced on the plan `typed` (lowered: `program`)."""
    bound = typed.bound
    axis = bound.mesh.axis_index(decl.axis)
    ranks = bound.mesh.axis_sizes[axis]
    written_cuts = () if "cut" in decl.searched or decl.balanced else tuple(module for module, _ in decl.cuts)
    segments = _segments(typed, program, machine, written_cuts)
    held_bytes = segment_memory(typed, segments, lowering.staged(typed), optimizer) if price_memory else None
    synchronised = _synchronised_seconds(typed, program, machine, segments)
    schedules = SEARCHED_SCHEDULES if "schedule" in decl.searched else ((decl.schedule, decl.stages_per_rank),)
    batch = bound.par.inputs[0].shape[0] * traced_microbatches if bound.par.inputs else traced_microbatches
    counts = _microbatch_counts(typed, batch) if "microbatches" in decl.searched else [decl.microbatches]
    written = None if "cut" in decl.searched or decl.balanced else _written_cut(segments, decl)
    # a cut searched where the statement names cuts too (the option a compile was written with): those are
    # priced beside the program's, so the cut chosen again is never rated slower than the one it replaces;
    # and `cut balanced`'s, which a recipe writes: the stage-by-stage program can pass it over where a rank
    # has several stages
    also = _written_cut(segments, decl) if "cut" in decl.searched and decl.cuts else None
    balanced: dict[int, list[int] | None] = {}  # per stage count
    if written is None and decl.cuts and "cut" not in decl.searched:
        module, span = next((module, span) for module, span in decl.cuts if module not in segments.names)
        raise CompileError([Diagnostic(
            "E072", f"`{module}` is not where a repeated layer starts: the pipeline search prices cuts there",
            span, ("cut before one of " + ", ".join(segments.names[:6]) + (" ..." if len(segments.names) > 6 else ""),
                   "or write `cut ?`"))], bound.par.source)
    options = []
    for schedule, per_rank in schedules:
        stages = ranks * per_rank
        if stages > len(segments.scaled_s):
            continue
        for m in counts:
            if not _takes(schedule, m, ranks, stages):
                continue
            rows = traced_microbatches / m  # a micro-batch's rows against the traced one's
            times = [scaled * rows + fixed for scaled, fixed in zip(segments.scaled_s, segments.fixed_s)]
            weights = [weight * rows for weight in segments.weight_s]
            # a stage's activations to the next, one point-to-point send (its gradient back alike)
            sends = [machine.collective_seconds("send", int(b * rows), 2) if b else 0.0 for b in segments.sent_bytes]
            held = _Held(held_bytes, rows, schedule, m, ranks, stages) if held_bytes is not None else None
            if written is not None:
                found = (written, *_priced(times, weights, sends, held, written, ranks, per_rank, schedule, m,
                                           synchronised)) if len(written) - 1 == stages else None
            else:
                if stages not in balanced:
                    balanced[stages] = _balanced_cut(typed, segments, stages, machine)
                found = _fastest_cut(times, weights, sends, held, stages, ranks, per_rank, schedule, m, limit,
                                     [also, balanced[stages]], synchronised)
            if found is None:
                continue
            cut, step, memory, busiest, synchronising = found
            options.append(PipelineOption(schedule, per_rank, m, tuple(segments.names[i - 1] for i in cut[1:-1]),
                                          step, memory, limit is None or memory <= limit,
                                          busiest_s=busiest, synchronised_s=synchronising))
    if not options:
        raise CompileError([Diagnostic(
            "E075", f"no pipeline of {ranks} ranks fits the model: cut where its repeated layers start, it makes "
            f"at most {len(segments.scaled_s)} stages", decl.span,
            ("use fewer pipeline ranks, or a schedule with fewer stages per rank",))], bound.par.source)
    return options


def _segments(typed, program, machine: Machine, written_cuts: tuple[str, ...] = ()) -> _Segments:
    """Segments between repeated layers, and also before each module a file's own cut names (an MLP's
    `cut before fc2`, where no layer repeats)."""
    bound, mesh = typed.bound, typed.mesh
    order = list(typed.nodes)
    starts, names, seen = [0], [], set()
    for index, name in enumerate(order):
        path = bound.module_paths.get(name) or ""
        unit = repeated_layer(path) or next(
            (cut for cut in written_cuts if path == cut or path.startswith(cut + ".")), "")
        if unit and unit not in seen:
            seen.add(unit)
            if index > 0:
                starts.append(index)
                names.append(unit)
    segment_of = {}
    for k, (start, end) in enumerate(zip(starts, starts[1:] + [len(order)])):
        for name in order[start:end]:
            segment_of[name] = k
    count = len(starts)
    scaled, fixed, weight = [0.0] * count, [0.0] * count, [0.0] * count
    overhead = machine.op_overhead_s * machine.slowdown(mesh.size)
    ops = op_costs(typed, machine, machine.slowdown(mesh.size))
    for op in ops:
        k = segment_of[op.node]
        both = op.forward_s + op.backward_s
        per_op = overhead * (both / op.forward_s) if op.forward_s else 0.0
        fixed[k] += per_op
        scaled[k] += max(0.0, both - per_op)
        weight[k] += _weight_gradient_share(typed, op.node) * op.backward_s * max(0.0, both - per_op) / both \
            if both else 0.0
    # the other axes' collectives, on the stage's critical path less what hides as the estimate has it
    forward_s, asked = {op.node: op.forward_s for op in ops}, bound.par.substitution("collective_matmul") == "on"
    for statement in program.statements:
        if statement.node in segment_of:
            for c in statement.collectives:
                seconds, chunked, beside_step = collective_hiding(machine, mesh, c, forward_s, statement.node, asked)
                scaled[segment_of[statement.node]] += seconds - chunked - beside_step
    sent = [0] * count

    def local_bytes(name: str, layout) -> int:
        info = typed.info(name)
        return math.prod(layout.local_shape(info.shape, mesh)) * info.dtype.itemsize

    for k, end in enumerate(starts[1:]):  # what the segment's last op makes crosses to the next
        last = order[end - 1]
        sent[k] = local_bytes(last, typed.nodes[last].op_layout)
    return _Segments(tuple(names), tuple(scaled), tuple(fixed), tuple(weight), tuple(sent), segment_of)


def _synchronised_seconds(typed, program, machine: Machine, segments: _Segments) -> list[float]:
    """Per segment, the seconds of the gradient buckets' collectives for its parameters (a bucket's shared
    among its members by their elements), a parameter in the segment of the first op that reads it. The
    uncut program's buckets hold every parameter; a pipeline rank synchronises its own stages' alone."""
    bound, mesh = typed.bound, typed.mesh
    placeholder_of = {name: placeholder for placeholder, name in bound.parameters.items()}
    slots = {slot.var: slot for slot in program.parameters}
    nodes = {node.name: node for node in bound.graph.nodes}

    def segment(var: str) -> int:
        node = nodes.get(placeholder_of.get(slots[var].name, "")) if var in slots else None
        readers = [user.name for user in node.users if user.name in segments.segment_of] if node else []
        return segments.segment_of[readers[0]] if readers else 0

    seconds = [0.0] * len(segments.scaled_s)
    for bucket in program.buckets:
        total = sum(collective_seconds(machine, mesh, c) for c in bucket.collectives)
        members = [(segment(var), math.prod(slots[var].local_shape) if var in slots else 1)
                   for var, _, _ in bucket.members]
        elements = sum(count for _, count in members) or 1
        for k, count in members:
            seconds[k] += total * count / elements
    return seconds


def _searched_layouts(typed, decl: PipelineDecl, machine: Machine, limit: int | None, traced_microbatches: int,
                      lowering: "StageLowering"):
    """The plan whose pipeline is priced, where the file leaves layouts of the other axes to the search:
    searched as the compile searches them for the pipeline chosen (compiler._compile_pipelined), one
    micro-batch's step with the pipeline axis kept B and the whole model held to `ranks` times the bound,
    its activations counted as many times as the first rank holds them (under the written schedule, 1F1B
    where the schedule is the search's). Priced on the greedy completion instead, a file with no layouts
    had its options timed without tensor parallelism, and the compile then searched layouts for a
    pipeline chosen for others (GPT-3 175B's searched file: 192 micro-batches written, 16 chosen, 2.8
    times the recipe's step)."""
    mesh = typed.mesh
    axis = mesh.axis_index(decl.axis)
    ranks = mesh.axis_sizes[axis]
    schedule = "1F1B" if "schedule" in decl.searched else decl.schedule
    microbatches = traced_microbatches if "microbatches" in decl.searched else decl.microbatches
    per_rank = 1 if "schedule" in decl.searched else decl.stages_per_rank
    held = micro_batches_held(schedule, microbatches, ranks, 0, per_rank)
    return searched_or_greedy(typed.bound, machine, lambda plan, _: lowering.whole(plan), {},
                              kept=(axis,), limit=None if limit is None else limit * ranks, activation_weight=held)


def segment_memory(typed, segments: _Segments, staged, optimizer: str = "adamw") -> SegmentMemory:
    """The segments' memory (SegmentMemory), from `staged(stage_of, count)`: the plan's programs cut so,
    with the compile's passes, as the pipeline compiled from it has them."""
    programs = staged(segments.segment_of, len(segments.scaled_s))
    states, groups, copies, kept, region, received, returned, inputs_kept, constants, sent_only, shared = \
        [], [], [], [], [], [], [], [], [], [], []
    # what keeps each value for backward: the segments of the ops that keep it as they read it
    saved, drawn = typed.bound.kept, drawn_ops(typed.bound.graph)
    keeping: dict[str, set[int]] = {}
    for op, operand in saved.reads:
        keeping.setdefault(saved.owner.get(operand, operand), set()).add(segments.segment_of.get(op, -1))
    for k, program in enumerate(programs):
        memory = memory_per_rank(program, optimizer)
        states.append(memory["parameters"] + memory["gradients"] + memory["optimizer_state"] + memory["compute_copies"])
        groups.append(tuple(gather_groups(program)))
        copies.append(program.memory()["parameter_copies_per_rank"])
        regions: dict[str, int] = {}
        held = 0
        made_here = program.made_from_constants(drawn)
        sent = {slot.var for slot in program.outputs}
        constant: dict[str, int] = {}
        shared_here: dict[str, int] = {}
        only_sent = 0  # held only as what the segment sends on: in a stage it ends, not held
        for name, size, _, made_again in program.held_for_backward():
            if made_again:
                regions[made_again] = regions.get(made_again, 0) + size
            elif program.values.get(name, {}).get("shared_by_micro_batches"):
                shared_here[name] = size
            elif name in made_here:
                constant[name] = size
            else:
                held += size
                storage = saved.owner.get(name, name)
                if name in sent and k not in keeping.get(storage, ()) and storage not in saved.by_itself and \
                        not program.values.get(name, {}).get("held_here"):
                    only_sent += size
        kept.append(held)
        sent_only.append(only_sent)
        constants.append(tuple(sorted(constant.items())))
        shared.append(tuple(sorted(shared_here.items())))
        region.append(max(regions.values(), default=0))
        into, back = stage_buffer_slots(programs, k)
        received.append(sum(slot_bytes(slot.local_shape, slot.dtype) for slot in into))
        returned.append(sum(slot_bytes(slot.local_shape, slot.dtype) for slot in back))
        # of what it receives, what the segment keeps: an argument of a recomputed region, or what one of
        # its ops keeps (or a fused op, in place of a copy autograd would keep); held where a stage that
        # starts before it runs it too (a stage's input is a buffer).
        # Not a copy the segment before makes locally of another value it sends (the embedding's output as
        # partial sums): in a stage that runs both, the region reading it makes it again from that value
        regions_read = {name for statement in program.statements if statement.instruction.kind == "recompute"
                        for name in statement.instruction.reads()}
        remade = _local_copies(programs[k - 1], {slot.var for slot in into}) if k > 0 else set()
        inputs_kept.append(sum(slot_bytes(slot.local_shape, slot.dtype) for slot in into
                               if slot.var in regions_read and slot.var not in remade
                               or k in keeping.get(saved.owner.get(slot.var, slot.var), ())
                               or slot.var in program.inputs_kept))
    return SegmentMemory(tuple(states), tuple(groups), tuple(copies), tuple(kept), tuple(region), tuple(received),
                         tuple(returned), tuple(inputs_kept), tuple(constants), tuple(sent_only), tuple(shared))


def _local_copies(program, sent: set[str]) -> set[str]:
    """What `program` sends of `sent` that it makes by a conversion with no collective from another value
    it sends."""
    return {target for statement in program.statements
            if statement.instruction.kind == "convert" and not statement.collectives
            and any(read in sent for read in statement.instruction.reads())
            for target in statement.targets if target in sent}


def _weight_gradient_share(typed, name: str) -> float:
    """The part of an op's backward that computes its trained parameters' gradients: its backward shared
    evenly among its differentiable operands."""
    bound = typed.bound
    floating = [operand for operand in typed.nodes[name].operands if typed.info(operand).dtype.is_floating_point]
    trained = [operand for operand in floating
               if operand in bound.parameters and bound.parameters[operand] not in bound.frozen]
    return len(trained) / len(floating) if floating else 0.0


def _takes(schedule: str, m: int, ranks: int, stages: int) -> bool:
    """Whether torch's schedule runs m micro-batches over these stages (and, for the zero-bubble ones,
    enough of them to fill the bubble the model assumes filled)."""
    if schedule == "1F1B":
        return m >= stages
    if schedule in V_SHAPED:
        return m >= stages  # ZB-V has empty slots below 2p - 1; DualPipeV refuses fewer than its stages
    if stages > ranks:  # the looped schedules run rounds of p micro-batches
        return m % ranks == 0
    return True


def _microbatch_counts(typed, batch: int) -> list[int]:
    """Divisors of the batch that leave every input's micro-batch splittable as the plan splits dim 0."""
    mesh = typed.mesh
    split = max([typed.placeholder_layouts[name].split_factor(0, mesh) for name in typed.bound.inputs
                 if name in typed.placeholder_layouts] or [1])
    return [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % split == 0]


def _written_cut(segments: _Segments, decl: PipelineDecl) -> list[int] | None:
    """The file's own cuts as segment boundaries (None where one is not a layer boundary)."""
    points = [0]
    for module, _ in decl.cuts:
        if module not in segments.names:
            return None
        points.append(segments.names.index(module) + 1)
    return points + [len(segments.scaled_s)]


def _balanced_cut(typed, segments: _Segments, stages: int, machine: Machine) -> list[int] | None:
    """`cut balanced`'s cut (balanced_cuts) as segment boundaries, where its cuts are segments' starts."""
    try:
        _, names = balanced_cuts(typed, stages, machine)
    except CompileError:
        return None
    if any(name not in segments.names for name in names):
        return None
    return [0, *(segments.names.index(name) + 1 for name in names), len(segments.scaled_s)]


def _cut(times, sends, held: "_Held | None", stages: int, ranks: int, limit: int | None,
         schedule: str = "1F1B", by_rank: bool = False) -> list[int] | None:
    """Stage boundaries (segment indices, 0 and the end included) whose largest stage time is least (`by_rank`:
    whose busiest rank, its stages' times together, is least), each rank within the memory bound: a
    dynamic program over the segments, stage k on the rank its schedule places it on. With several stages
    a rank, a stage is checked with the rank's stages before it on the path that reaches it (the program
    keeps one path a boundary, so a cut it passes over may have fit or been faster).
    Where no cut fits, the one whose fullest rank holds least (then the fastest), which the caller prices
    over the bound: the pipeline is still one to weigh (on other layouts it may fit), not one the model
    cannot be cut into, and an option over the bound is ranked by what it holds (_rank)."""
    if limit is None or held is None:
        return _best_cut(times, sends, stages, ranks, schedule, None, fastest=True, by_rank=by_rank)
    return _best_cut(times, sends, stages, ranks, schedule, held, fastest=True, limit=limit, by_rank=by_rank) or \
        _best_cut(times, sends, stages, ranks, schedule, held, fastest=False, by_rank=by_rank)


def _fastest_cut(times, weights, sends, held: "_Held | None", stages: int, ranks: int, per_rank: int,
                 schedule: str, m: int, limit: int | None,
                 also: list[list[int] | None] = (),
                 synchronised: list[float] | None = None) -> tuple[list[int], float, int, float, float] | None:
    """The cut, its step, what its fullest rank holds, its busiest rank's work and its gradients'
    synchronisation (_priced): of _cut's cuts (and those `also` has), the one priced
    fastest within the bound (none within it: the one holding least). With several stages a rank the step
    follows the busiest rank's stages together, which the stage-by-stage cut can leave uneven (two long
    stages on one rank where only the slowest stage counts): the cut evening the ranks is priced beside it."""
    cuts = [_cut(times, sends, held, stages, ranks, limit, schedule, by_rank)
            for by_rank in ((False, True) if stages > ranks else (False,))] + list(also)
    priced = [(cut, *_priced(times, weights, sends, held, cut, ranks, per_rank, schedule, m, synchronised))
              for cut in cuts if cut is not None and len(cut) - 1 == stages]
    if not priced:
        return None
    return min(priced, key=lambda each: _ranking(each[1], each[2], limit is None or each[2] <= limit))


def _best_cut(times, sends, stages: int, ranks: int, schedule: str, held: "_Held | None", fastest: bool,
              limit: int | None = None, by_rank: bool = False) -> list[int] | None:
    """_cut's dynamic program. `fastest`: the cut whose largest stage time is least (`by_rank`: whose
    busiest rank's stages together take least), then the least total, None where no cut keeps every rank
    within `limit`; else the cut whose fullest rank holds least, then the fastest. `held` None: memory
    not weighed."""
    prefix = [0.0, *itertools.accumulate(times)]
    rank_of = [rank_of_stage(k, ranks, schedule) for k in range(stages)]
    together = held is not None and stages > ranks  # a rank's stages held together, checked on the path
    # best[k][j], for the first k stages ending at segment j: (score, where stage k - 1 starts, and per rank
    # what the path's stages hold across micro-batches and the largest region they make again, and their
    # times). A score: (largest stage time, or busiest rank's, total time), led by the fullest rank so far
    # where the cut is the least-memory one. The path is read back from the end, so no step copies it.
    nothing = (0,) * ranks
    best: list[dict[int, tuple]] = [{0: ((0.0, 0.0) if fastest else (0, 0.0, 0.0), 0, nothing, nothing,
                                         (0.0,) * ranks)}]
    for k in range(stages):
        rank, row = rank_of[k], {}
        for j in range(k + 1, len(times) - (stages - k - 1) + 1):
            chosen = None
            for i, (score, _, memory, again, work) in best[k].items():
                if i >= j:
                    continue
                seconds = _stage_seconds(prefix, sends, i, j)
                work = (*work[:rank], work[rank] + seconds, *work[rank + 1:])
                slowest = work[rank] if by_rank else seconds
                holds = 0
                if together:
                    memory = (*memory[:rank], memory[rank] + held.across(k, i, j), *memory[rank + 1:])
                    again = (*again[:rank], max(again[rank], held.made_again(i, j)), *again[rank + 1:])
                    holds = memory[rank] + again[rank]
                elif held is not None:
                    holds = held.stage(k, i, j)
                if fastest:
                    if limit is not None and holds > limit:
                        continue
                    candidate = (max(score[0], slowest), score[1] + seconds)
                else:
                    candidate = (max(score[0], holds), max(score[1], slowest), score[2] + seconds)
                if chosen is None or candidate < chosen[0]:
                    chosen = (candidate, i, memory, again, work)
            if chosen is not None:
                row[j] = chosen
        best.append(row)
    if len(times) not in best[stages]:
        return None
    cut = [len(times)]
    for k in range(stages, 0, -1):
        cut.append(best[k][cut[-1]][1])
    return cut[::-1]


def _rank_memory(held: "_Held", cut: list[int], ranks: int, schedule: str) -> int:
    """The most a rank holds with stages cut at `cut`: its stages' across micro-batches, and one region
    made again at a time."""
    memory, made_again = [0] * ranks, [0] * ranks
    for k, (i, j) in enumerate(zip(cut, cut[1:])):
        rank = rank_of_stage(k, ranks, schedule)
        memory[rank] += held.across(k, i, j)
        made_again[rank] = max(made_again[rank], held.made_again(i, j))
    return max(m + again for m, again in zip(memory, made_again))


def _stage_seconds(prefix: list[float], sends: list[float], i: int, j: int) -> float:
    """A stage of segments i to j (`prefix`: the segments' times summed up to each), per micro-batch: their
    ops and collectives, and the sends at its ends."""
    return prefix[j] - prefix[i] + (sends[j - 1] if j < len(prefix) - 1 else 0.0) + (sends[i - 1] if i > 0 else 0.0)


class _Held:
    """What stages hold on their ranks under one option (cost.pipeline_rank_memory's count, on the
    segments): a stage's parameters with their state and gathered groups, its activations for the
    micro-batches its schedule keeps in flight on its rank, and a stage buffer per micro-batch for what
    it receives and for the gradient of what it sends. `rows`: a micro-batch's rows against the traced one's."""

    def __init__(self, memory: SegmentMemory, rows: float, schedule: str, m: int, ranks: int, stages: int):
        self.memory, self.rows, self.schedule, self.m, self.ranks, self.stages = memory, rows, schedule, m, ranks, stages
        # per stage, once: the cut's dynamic program asks for every stage at every pair of boundaries
        self.in_flight, self._across, self._made_again = {}, {}, {}
        for rank in range(ranks):
            self.in_flight.update(stage_micro_batches_held(schedule, m, ranks, rank, stages // ranks))

    def stage(self, k: int, i: int, j: int) -> int:
        """What stage k of segments i to j holds, alone on its rank."""
        return self.across(k, i, j) + self.made_again(i, j)

    def across(self, k: int, i: int, j: int) -> int:
        """held_across_micro_batches, kept: the cut's dynamic program asks for each many times, and it
        depends on k only through what k keeps in flight and whether it receives and sends."""
        key = (self.in_flight[k], k > 0, k < self.stages - 1, i, j)
        if key not in self._across:
            self._across[key] = self.held_across_micro_batches(k, i, j)
        return self._across[key]

    def held_across_micro_batches(self, k: int, i: int, j: int) -> int:
        """The stage's states, gathered groups and buffers, and what it keeps of each micro-batch in flight."""
        memory, rows = self.memory, self.rows
        in_flight = self.in_flight[k]
        # inside a stage, what one segment sends the next is an activation the stage holds where the next
        # keeps it: a recomputed layer's input, kept for its region, or an operand its ops keep
        made_per_micro_batch = dict(item for segment in range(i, j) for item in memory.constants[segment])
        activations = rows * (sum(memory.kept[i:j]) - sum(memory.sent_only[i:j - 1]) + sum(memory.inputs_kept[i + 1:j])
                              + sum(made_per_micro_batch.values()))
        # what the stage makes from constants once, every micro-batch in flight reading the same copy
        shared = rows * sum(dict(item for segment in range(i, j) for item in memory.shared[segment]).values())
        # the stage's gather groups in order, counted as memory_per_rank counts a stage's
        groups = [group for segment in range(i, j) for group in memory.groups[segment]]
        neighbours, passing = gathered_in_passing(groups)
        gathered = neighbours + sum(size for index, (size, _) in enumerate(groups) if index not in passing) + \
            sum(memory.copies[i:j])
        buffers = self.m * rows * ((memory.received[i] if k > 0 else 0) + (memory.returned[j - 1] if k < self.stages - 1 else 0))
        return int(sum(memory.states[i:j]) + gathered + in_flight * activations + shared + buffers)

    def made_again(self, i: int, j: int) -> int:
        """The largest recomputed region of segments i to j: a rank runs one micro-batch's backward at a
        time, so it makes one region's activations again at once, whatever it holds in flight."""
        if (i, j) not in self._made_again:
            self._made_again[i, j] = int(self.rows * max(self.memory.region[i:j]))
        return self._made_again[i, j]


def _priced(times, weights, sends, held: _Held | None, cut: list[int], ranks: int, per_rank: int,
            schedule: str, m: int, synchronised: list[float] | None = None) -> tuple[float, int, float, float]:
    """The step's estimate, the most memory a rank holds, the busiest rank's work (m · w: the step without
    the bubble), and the gradients' synchronisation once a step, for stages cut at `cut` (the module's
    docstring gives the model). `synchronised`: each segment's gradient buckets' seconds; a rank
    synchronises its own stages' gradients, all ranks at once, and the step waits for the longest."""
    prefix = [0.0, *itertools.accumulate(times)]
    stage_times = [_stage_seconds(prefix, sends, i, j) for i, j in zip(cut, cut[1:])]
    stage_weights = [sum(weights[i:j]) for i, j in zip(cut, cut[1:])]
    work, weight = [0.0] * ranks, [0.0] * ranks
    for k, (i, j) in enumerate(zip(cut, cut[1:])):
        rank = rank_of_stage(k, ranks, schedule)
        work[rank] += stage_times[k]
        weight[rank] += stage_weights[k]
    slowest = max(range(ranks), key=lambda r: work[r])
    w, w_weight = work[slowest], weight[slowest]
    if per_rank == 1:
        step = sum(stage_times) + (m - 1) * max(stage_times)
    elif schedule == "InterleavedZeroBubble":
        step = m * w + (ranks - 1) * max(0.0, w - 2 * w_weight) / per_rank
    elif schedule in V_SHAPED:
        step = m * w + (ranks - 1) * max(0.0, w - 3 * w_weight) / per_rank
    else:
        step = m * w + (ranks - 1) * w / per_rank
    synchronising = [0.0] * ranks
    for k, (i, j) in enumerate(zip(cut, cut[1:])):
        synchronising[rank_of_stage(k, ranks, schedule)] += sum(synchronised[i:j]) if synchronised else 0.0
    return step + max(synchronising), _rank_memory(held, cut, ranks, schedule) if held is not None else 0, m * w, \
        max(synchronising)


def pipelined_step_seconds(compiled, machine: Machine) -> float:
    """A compiled pipelined plan's step as this model prices it (its stages' times per micro-batch and the
    schedule's bubble), with the layouts the plan has on its other axes."""
    return pipelined_step(compiled, machine).step_s


def pipelined_step(compiled, machine: Machine) -> PipelineOption:
    """A compiled pipelined plan priced as pipelined_step_seconds prices it, with its step's parts."""
    plan, written = compiled.pipeline, compiled.par.pipeline
    decl = dataclasses.replace(written, schedule=plan.schedule, microbatches=plan.microbatches,
                               stages_per_rank=plan.stages_per_rank, searched=frozenset(),
                               cuts=tuple((name, written.cut_span) for name in plan.cut_before))
    _, (option,) = choose_pipeline(compiled.typed, compiled.program, decl, machine, None, plan.microbatches,
                                   price_memory=False)
    return option
