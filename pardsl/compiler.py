"""The pipeline, one direction: text → syntax tree → bound plan → typed graph → lowered program → code.

Each stage is a function of the previous stage's result (syntax.parse, binding.bind, inference.infer,
lowering.lower, codegen.render); this module only chains them and writes what `pardsl compile` emits.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import itertools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from pardsl import __version__
from pardsl.language.diagnostics import CompileError, Diagnostic
from pardsl.language.files import write_atomically
from pardsl.language.progress import timed, working_on
from pardsl.language.syntax import ParFile, parse, parse_file
from pardsl.layouts.oprules import drawn_ops
from pardsl.model.binding import BoundPlan, bind, bound_on_mesh
from pardsl.passes import pipeline as pp
from pardsl.passes.collective_matmul import chunked_collective_matmuls
from pardsl.passes.early_count import start_counts_early
from pardsl.passes.fused_norms import fuse_rms_norms
from pardsl.passes.narrow_conversions import convert_before_widening_casts
from pardsl.passes.fused_rotary import fuse_rotary_embeddings
from pardsl.passes.fused_swiglu import fuse_swiglus
from pardsl.passes.liveness import release_dead_values
from pardsl.passes.offload import offload_to_host
from pardsl.passes.precision import apply_precision
from pardsl.passes.recompute import (
    activations_recomputing_all,
    recompute_layers,
    recomputed_stages_within,
    recomputed_within,
)
from pardsl.passes.regather import regather_split_inputs
from pardsl.passes.reshard import reshard_after_forward
from pardsl.passes.shared_constants import share_constants_between_micro_batches
from pardsl.planning.cost import (
    DEFAULT_BUCKET_MB,
    default_machine,
    estimate,
    memory_per_rank,
    pipelined_memory_per_rank,
)
from pardsl.planning.inference import TypedGraph, infer
from pardsl.planning import descent
from pardsl.planning.descent import CompletedPlan, layouts_of, searched_or_greedy
from pardsl.planning.pipeline_search import (StageLowering, choose_pipeline, pipeline_written_as, pipelined_step,
                                             pipelined_step_seconds)
from pardsl.planning.recipes import completed_recipes
from pardsl.planning.search import memory_limit, splits_the_sequence, wants_search
from pardsl.program.codegen import render, render_pipeline
from pardsl.program.ir import LoweredProgram, format_bytes, named_layout
from pardsl.program.lowering import lower, lower_in_stages

MODULE_FILE = "pardsl_module.py"
PLAN_FILE = "plan.json"


@dataclass
class Compiled:
    par: ParFile
    bound: BoundPlan
    typed: TypedGraph
    program: LoweredProgram
    source: str  # the generated module
    seconds: dict[str, float]  # per stage: build, export, bind, infer, lower, codegen
    memory_bound: int | None = None  # bytes per rank, from `memory <= …`
    pipeline: object = None  # pardsl.pipeline.PipelinePlan where the file has a `pipeline` statement
    stages: tuple = ()  # then each stage's LoweredProgram; `program` is the uncut one (one micro-batch)
    mesh_shapes: tuple["MeshShape", ...] = ()  # a searched mesh: every shape priced, the chosen one first
    pipeline_options: tuple = ()  # a searched pipeline: every option priced (PipelineOption), the chosen first
    recipe: str = ""  # a pipelined plan whose layouts are a known recipe's, weighed against the search's: its name

    @property
    def programs(self) -> tuple[LoweredProgram, ...]:
        """What runs: the program, or a pipeline's stages."""
        return self.stages if self.pipeline is not None else (self.program,)

    def source_with_pieces(self, collectives: bool = False) -> str:
        """The generated module with the forward's runs of ATen ops as functions for torch.compile (compiled
        layers: pardsl.load(..., compile=True)); `collectives`: with the conversions between them inside, as
        functional collectives."""
        if self.pipeline is not None:
            return render_pipeline(list(self.stages), self.pipeline, pieces=True, collectives=collectives)
        return render(self.program, pieces=True, collectives=collectives)

    @property
    def seconds_after_export(self) -> float:
        return sum(v for k, v in self.seconds.items() if k not in ("build", "export"))


def compile_par(par: ParFile, bucket_mb: float = DEFAULT_BUCKET_MB, machine=None) -> Compiled:
    """`machine`: the cost model's figures the layout search minimises (default: this machine's
    calibration file for its backend, else the backend's defaults); only a searched plan reads them."""
    clock = time.perf_counter()
    with _cyclic_collector_paused():
        compiled = _compile(par, bucket_mb, machine)
    # what no stage counts (the collection, checks between stages), so that the stages add up to the whole
    compiled.seconds["other"] = max(0.0, time.perf_counter() - clock - sum(compiled.seconds.values()))
    return compiled


@contextlib.contextmanager
def _cyclic_collector_paused():
    """Python's cyclic collector off while compiling, as it was after. Compiling allocates millions of
    objects that live until it ends (graphs, the search's programs, the candidates' lowered programs), and
    each of them triggered full collections that traversed them all again: on the 32-layer LLaMA of
    benchmarks/search.py the compile after export takes 12.0 s without them, 15.6 s with them, for 70 MiB
    more at the peak (672 → 742 MiB). What the compile leaves of cycles is collected as it ends (0.17 s
    there), in compile's time, not at some later allocation of the caller's."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect(0)


@dataclass(frozen=True)
class MeshShape:
    """One shape of a searched mesh, as the compiler priced it: its axes' sizes, its best plan's estimated
    step and memory per rank, whether that is within the bound, or why it has no plan."""

    sizes: tuple[int, ...]
    step_s: float | None = None
    memory: int | None = None
    within_bound: bool = True
    why_not: str = ""
    same_as: tuple[int, ...] | None = None  # priced as this shape, its axes renamed (a flat machine)


def _compile(par: ParFile, bucket_mb: float, machine, bound: BoundPlan | None = None) -> Compiled:
    if par.mesh.searched:
        return _compile_searched_mesh(par, bucket_mb, machine)
    if par.pipeline is not None:
        return _compile_pipelined(par, bucket_mb, machine)
    bound = bind(par) if bound is None else bound
    seconds = dict(bound.seconds)
    limit = memory_limit(bound)
    if limit is not None:
        typed, program = _searched_with_recomputation(bound, machine or default_machine(), bucket_mb, limit, seconds)
    elif wants_search(bound) or splits_the_sequence(bound):
        typed, program = _searched(bound, machine or default_machine(), bucket_mb, seconds)
    else:
        typed = timed(seconds, "infer", lambda: infer(bound))
        program = timed(seconds, "lower", lambda: _lowered(typed, bucket_mb, None))
        program = _passes_after_lowering(program, typed, machine)
    source = timed(seconds, "codegen", lambda: render(program))
    return Compiled(par, bound, typed, program, source, seconds, _check_memory_bound(bound, program))


def _searched(bound: BoundPlan, machine, bucket_mb: float,
              seconds: dict[str, float]) -> tuple[TypedGraph, LoweredProgram]:
    """The layouts searched with no memory bound: the search's plan, or the best known recipe where that
    is rated faster through the passes."""
    def lowered(typed: TypedGraph, limit: int | None) -> LoweredProgram:
        return _lowered(typed, bucket_mb, limit)

    def compiled_as(typed: TypedGraph, program: LoweredProgram) -> _SearchedPlan:
        program = _passes_after_lowering(program, typed, machine)
        return _SearchedPlan((False, estimate(CompletedPlan(typed, program), machine).step_s), typed, program)

    recipes_lowered = descent.recipe_plans(bound, machine, lowered, None, seconds=seconds)
    typed, program = searched_or_greedy(bound, machine, lowered, seconds, recipes_lowered=recipes_lowered)
    best = _weighed_against_recipes(bound, compiled_as(typed, program),
                                    [(r.name, compiled_as(r.typed, r.program)) for r in recipes_lowered], machine, None)
    return best.typed, best.program


# How many times the layout search runs again under a bound, each time counting activations as more
# recomputation would leave them, down to every layer recomputed
RECOMPUTATION_STEPS = 4


class _SearchedPlan(NamedTuple):
    """One plan of the search under a bound, as _searched_with_recomputation weighs it."""

    rating: tuple[bool, float]  # over the bound, then what it holds where over, else its estimated step
    typed: TypedGraph
    program: LoweredProgram  # through the passes, with the layers chosen to recompute


def _searched_with_recomputation(bound: BoundPlan, machine, bucket_mb: float, limit: int,
                                 seconds: dict[str, float]) -> tuple[TypedGraph, LoweredProgram]:
    """The layouts searched under the bound `limit` with what recomputation saves weighed in.

    The search's integer programs count a plan's activations; lowering holds every one autograd keeps,
    and the passes after it keep less (fused norms and SwiGLUs keep one input where the ops kept several;
    recomputed layers keep their inputs). What they leave is measured once, on the file's greedy
    completion (_activation_shares), and the search counts each byte of activations at that share: counted
    as lowering holds them, a plan the passes bring within the bound was searched as over it. Where the
    file names nothing to recompute, recomputation is the compiler's choice (recompute.recomputed_within:
    the fewest layers that bring a plan under the bound), and it saves memory in another coin than the
    layouts: a layer made again costs its forward's compute once more, a layout that shards more costs
    collectives. So the search runs again with activations counted at shares down to what a rank keeps
    with every repeated layer recomputed, in RECOMPUTATION_STEPS steps, each plan found given the
    recomputation it needs. Of the plans found, the one the cost model rates fastest within the bound is
    kept. The steps stop at the first whose plan is not rated faster than the best so far (where the
    bound does not bind, the second search finds the first's plan again: one search more is what weighing
    costs there); the first search keeps its own time budget (descent.SEARCH_BUDGET_S), and the steps
    share one more, passed down to their searches, so weighing about doubles the search's time at most
    (note N006 where the steps spend it)."""
    written = bound.par.recomputes_written
    # the known recipes are written, completed and lowered once: each search below weighs them anew
    recipes_lowered = descent.recipe_plans(bound, machine, lambda typed, limit: _lowered(typed, bucket_mb, limit),
                                           limit, seconds=seconds)

    def compiled_as(typed: TypedGraph, lowered: LoweredProgram, stage: str = "recompute") -> _SearchedPlan:
        """A plan through the passes, its layers recomputed where the file names none and it holds more
        than the bound; rated by the cost model (within the bound before over it; over it, the nearer first).
        `stage`: what its recomputation's time is counted as."""
        # a recipe's program is weighed by every search here: the notes the passes add are this plan's
        lowered = replace(lowered, notes=list(lowered.notes))
        passed = program = _passes_after_lowering(lowered, typed, machine)
        if not written and memory_per_rank(program)["total"] > limit:
            program = timed(seconds, stage, lambda: recomputed_within(passed, typed, limit, machine))
        plan = estimate(CompletedPlan(typed, program), machine)
        over = plan.memory["total"] > limit
        return _SearchedPlan((over, plan.memory["total"] if over else plan.step_s), typed, program)

    def planned(weight: float, deadline: float = math.inf):
        """The search's plan with activations counted `weight` times, as compiled."""
        spent: dict[str, float] = {}
        typed, lowered = searched_or_greedy(bound, machine, lambda typed, limit: _lowered(typed, bucket_mb, limit),
                                            spent, activation_weight=weight, deadline=deadline,
                                            recipes_lowered=recipes_lowered, greedy_lowered=(greedy, greedy_lowered))
        for stage, elapsed in spent.items():
            seconds[stage] = seconds.get(stage, 0.0) + elapsed
        return compiled_as(typed, lowered)

    greedy = timed(seconds, "greedy", lambda: infer(bound))
    greedy_lowered = timed(seconds, "lower", lambda: _lowered(greedy, bucket_mb, limit))
    kept, least = timed(seconds, "activations", lambda: _activation_shares(greedy, greedy_lowered, machine))
    best = planned(kept)
    if best.rating[0] and kept < 1.0:
        # the share is the greedy completion's: a plan the passes leave more of can compile over the bound
        # (where the file names what to recompute, nothing after brings it within): searched again counting
        # activations as lowering holds them, at most what the passes keep
        best = min(best, planned(1.0), key=lambda plan: plan.rating)
    deadline = descent.search_clock() + descent.SEARCH_BUDGET_S  # the steps together: one search's budget more
    weights = [kept - step / RECOMPUTATION_STEPS * (kept - least)
               for step in range(1, RECOMPUTATION_STEPS + 1)] if least < kept else []
    for step, weight in enumerate(weights):
        if descent.search_clock() >= deadline:
            best.program.notes.append(descent.out_of_time_note(
                bound, f"weighing recomputation at {step} of {len(weights)} shares"))
            break
        found = planned(weight, deadline)
        if not found.rating < best.rating:
            break
        best = found
    # a recipe whose weights and optimizer state alone hold more than the bound is not put through the
    # passes (seconds a recipe at 80 layers), unless no recipe's fit; under offload the passes move
    # those states to the host, and every recipe is weighed
    fitting = [r for r in recipes_lowered if bound.par.offload is not None or _states_bytes(r.program) <= limit] \
        or recipes_lowered
    weighed = [(r.name, compiled_as(r.typed, r.program, "recipes")) for r in fitting]
    best = _weighed_against_recipes(bound, best, weighed, machine, limit)
    return best.typed, best.program


def _activation_shares(typed: TypedGraph, lowered: LoweredProgram, machine) -> tuple[float, float]:
    """What the passes leave of a rank's activations as lowering holds them, on a plan of the file (its
    greedy completion) and its lowered program: (through the passes, the layers the file names
    recomputed; with every repeated layer recomputed as well, where the file names none), each a share
    of lowering's count, at most 1."""
    counted = memory_per_rank(lowered)["activations"]
    if not counted:
        return 1.0, 1.0
    passed = _passes_after_lowering(replace(lowered, notes=list(lowered.notes)), typed, machine)
    kept = min(1.0, memory_per_rank(passed)["activations"] / counted)
    par = typed.bound.par
    if par.recomputes_written:
        return kept, kept
    return kept, min(kept, activations_recomputing_all(passed, typed, par.memory_bound.span) / counted)


def _states_bytes(program: LoweredProgram) -> int:
    """What a rank holds whatever is recomputed: parameters, gradients, optimizer state."""
    memory = memory_per_rank(program)
    return memory["total"] - memory["activations"]


def _weighed_against_recipes(bound: BoundPlan, best, recipes: list[tuple[str, "_SearchedPlan"]], machine,
                             limit: int | None):
    """The searched plan, or the best known recipe where that is rated better as compiled (through the
    passes, within the bound before over it); note N009 says which recipe it was weighed against. Inside
    the search the recipes compete under the search's own rating, which counts activations before the
    passes: a recipe that fits only once its layers are recomputed can lose there and win here."""
    if not recipes:
        return best
    name, theirs = min(recipes, key=lambda recipe: recipe[1].rating)
    compiled_it = theirs.rating < best.rating or layouts_of(theirs.typed) == layouts_of(best.typed)
    if theirs.rating < best.rating:
        # what the search said of its own run (its budget spent: N006) stands beside the recipe compiled
        theirs.program.notes.extend(note for note in best.program.notes if note.code == "N006")
        best = theirs
    theirs_estimated = estimate(CompletedPlan(theirs.typed, theirs.program), machine)
    mine_estimated = estimate(CompletedPlan(best.typed, best.program), machine)
    best.program.notes.append(descent.recipe_note(bound, name, theirs_estimated, mine_estimated, compiled_it, limit))
    return best


def mesh_shapes(ranks: int, axes: int) -> list[tuple[int, ...]]:
    """Every way to give `axes` axes sizes whose product is `ranks` (1 allowed), in order."""
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    return [sizes for sizes in itertools.product(divisors, repeat=axes) if math.prod(sizes) == ranks]


def _compile_searched_mesh(par: ParFile, bucket_mb: float, machine) -> Compiled:
    """`mesh dp, tp = 8`: each shape of the mesh compiled as its own file would be (its layouts searched or
    inferred, recomputation chosen within the bound), all from one trace of the model, and the shape
    whose plan is estimated fastest within the memory bound kept (over it, the one that needs least).

    Exhaustive over the shapes, with one exact pruning: on a machine whose links are all alike, where the
    file writes no layout for an axis to tell them apart, two shapes that are each other's axes renamed
    (the pipeline's axis left as it is) have the same best plan up to the names, and the second is not
    compiled again."""
    _check_searched_mesh(par)
    machine = machine or default_machine()
    names = [axis.name for axis in par.mesh.axes]
    symmetric = not any(entry.layout.form != "searched" for entry in par.layouts) and \
        (not machine.ranks_per_node or machine.between_nodes is None or par.mesh.ranks <= machine.ranks_per_node)
    pipeline_axis = names.index(par.pipeline.axis) if par.pipeline and par.pipeline.axis in names else None

    def renamed(sizes: tuple[int, ...]) -> tuple:
        """What a shape is up to its axes' names: the pipeline axis's size, and the others' as a set."""
        others = sorted(size for axis, size in enumerate(sizes) if axis != pipeline_axis)
        return (sizes[pipeline_axis] if pipeline_axis is not None else None, others)

    bound, priced, shapes, elapsed, failures = None, {}, [], {}, []
    every_shape = mesh_shapes(par.mesh.ranks, len(names))
    for index, sizes in enumerate(every_shape):
        twin = next((other for other in priced if renamed(other) == renamed(sizes)), None)
        if symmetric and twin is not None:
            shapes.append(replace(priced[twin][1], sizes=sizes, same_as=twin))
            continue
        shaped = replace(par, meshes=(replace(par.mesh, ranks=None, axes=tuple(
            replace(axis, size=size) for axis, size in zip(par.mesh.axes, sizes))),))
        if pipeline_axis is not None and sizes[pipeline_axis] == 1:
            shaped = replace(shaped, pipelines=())  # one stage: no pipeline
        clock = time.perf_counter()
        try:
            with working_on(f"mesh shape {index + 1} of {len(every_shape)} ({_shape_text(names, sizes)})"):
                # one trace for every shape: its heads regrouped for none of them (the first shape's
                # split would be every other shape's, computing heads over again where it differs)
                bound = bind(shaped, regroup_heads=False) if bound is None else bound_on_mesh(bound, shaped)
                compiled = _compile(shaped, bucket_mb, machine, bound)
        except CompileError as error:
            elapsed[sizes] = time.perf_counter() - clock
            failures.append(error)
            shapes.append(MeshShape(sizes, why_not=f"error[{error.diagnostics[0].code}]: {error.diagnostics[0].message}"))
            continue
        plan = estimate(compiled, machine)
        elapsed[sizes] = time.perf_counter() - clock
        within = compiled.memory_bound is None or plan.memory["total"] <= compiled.memory_bound
        shape = MeshShape(sizes, pipelined_step_seconds(compiled, machine) if compiled.pipeline else plan.step_s,
                          plan.memory["total"], within)
        priced[sizes] = (compiled, shape)
        shapes.append(shape)
    common = [d for d in failures[0].diagnostics if all(d in error.diagnostics for error in failures)] \
        if failures and not priced else []
    if common:
        # the file's own mistakes, whatever the shape (an unknown name, a model that cannot be traced): told
        # once, where they are, not as N copies under the mesh's line; those that differ by shape wait
        first, *others = common
        every = f"every shape of the mesh ({', '.join(names)} = {par.mesh.ranks}) failed the same way"
        raise CompileError([replace(first, notes=(*first.notes, every)), *others], par.source)
    if not priced:
        raise CompileError([Diagnostic("E013", f"no shape of the mesh ({', '.join(names)} = {par.mesh.ranks}) "
                                               "has a plan", par.mesh.span,
                                       tuple(f"{_shape_text(names, s.sizes)}: {s.why_not}" for s in shapes[:6]))],
                           par.source)
    compiled, chosen = min(priced.values(), key=lambda pair: (not pair[1].within_bound,
                                                               pair[1].step_s if pair[1].within_bound else pair[1].memory))
    compiled.seconds["other mesh shapes"] = sum(t for sizes, t in elapsed.items() if sizes != chosen.sizes)
    swapped = roles_swapped_note(compiled.program, par.mesh.span)
    if swapped is not None and swapped not in compiled.program.notes:
        compiled.program.notes.append(swapped)
    return replace(compiled, mesh_shapes=(chosen, *(s for s in shapes if s.sizes != chosen.sizes)))


def axis_roles(program: LoweredProgram) -> tuple[set[str], set[str]]:
    """The axes a plan uses as tensor parallelism (some parameter split on it and computed split, not
    gathered whole before use) and as data parallelism (gradients synchronised on it, or parameters
    gathered on it: FSDP's sharding is data parallelism's too)."""
    gathered = {(member.attr, group.axis) for group in program.gathers for member in group.members}
    data = {axis for bucket in program.buckets for axis in bucket.axes} | {group.axis for group in program.gathers}
    tensor = {program.mesh.axis_names[axis] for slot in program.parameters
              for axis, placement in enumerate(slot.layout.placements)
              if placement.is_split and (slot.name, program.mesh.axis_names[axis]) not in gathered
              and (slot.var, program.mesh.axis_names[axis]) not in gathered}
    return tensor, data


def roles_swapped_note(program: LoweredProgram, span) -> Diagnostic | None:
    """Note N008: a searched mesh's shape whose plan splits the weights over the axis the file calls `dp`
    and synchronises gradients over the one it calls `tp`.

    The search prices every role on every axis: the names are labels to it. Relabelling the kept plan is
    not done: keeping the file's axis order with the names exchanged is exact but reorders the mesh the
    file wrote, and exchanging the sizes instead (dp = 4, tp = 2 for dp = 2, tp = 4) changes which ranks
    form each group, the same plan only on a machine whose links are all alike. So the mapping is said.
    Only dp and tp are read: their roles are clear from the plan; other names are the file's to mean."""
    names = program.mesh.axis_names
    if "dp" not in names or "tp" not in names:
        return None
    tensor, data = axis_roles(program)
    if not ("dp" in tensor and "dp" not in data and "tp" in data and "tp" not in tensor):
        return None
    return Diagnostic(
        "N008", f"the search kept {program.mesh}: the weights are split over dp (tensor parallelism) and "
        "gradients synchronised over tp (data parallelism): the names are the file's, their roles swapped",
        span, ("every shape is searched with either role on either axis; `pardsl explain` shows each "
               "parameter's layout",), severity="note")


def _shape_text(names: list[str], sizes: tuple[int, ...]) -> str:
    return ", ".join(f"{name} = {size}" for name, size in zip(names, sizes))


def _check_searched_mesh(par: ParFile) -> None:
    """A searched mesh's axes are distinct and its rank count positive."""
    problems, seen = [], set()
    for axis in par.mesh.axes:
        if axis.name in seen:
            problems.append(Diagnostic("E010", f"mesh axis `{axis.name}` named twice", axis.span))
        seen.add(axis.name)
    if par.mesh.ranks < 1:
        problems.append(Diagnostic("E011", f"a mesh of {par.mesh.ranks} ranks", par.mesh.span))
    if problems:
        raise CompileError(problems, par.source)


# The passes over every lowered program (or pipeline stage), in order, each program -> program (with the
# typed graph to read): norms, rotary embeddings and SwiGLUs fused, a partial loss's count started early, parameters
# held in float32 under a mixed-precision policy, and in host memory where offloaded (which turns the
# precision's casts into fetches, so it comes after), in a pipeline stage what it builds from constants
# alone made once for all its micro-batches, then each value released after its last use, which
# reads what the others made, then the regions made again in backward, which read the releases, and last
# the collective matmuls, which cut a collective and the product beside it into chunks where they stand (in
# a region's statements too), reading and releasing what they did.
# Before them, where a plan needs them: FSDP's reshard after forward (_lowered) and the cut into pipeline
# stages (_compile_pipelined).
PASSES_AFTER_LOWERING = (
    ("convert a value before its cast to a wider dtype, not after",
     lambda program, typed, machine: convert_before_widening_casts(program)),
    ("fuse each local RMSNorm", lambda program, typed, machine: fuse_rms_norms(program, typed.bound.kept)),
    ("fuse each local rotary embedding", lambda program, typed, machine: fuse_rotary_embeddings(program)),
    ("fuse each local SwiGLU, silu made again in backward",
     lambda program, typed, machine: fuse_swiglus(program, typed.bound.kept)),
    ("count a partial loss's targets early", lambda program, typed, machine: start_counts_early(program)),
    ("hold parameters in float32, compute them in the precision's dtype",
     lambda program, typed, machine: apply_precision(program, typed.bound.par.precision, typed.bound.par.inputs)),
    ("keep parameters and optimizer in host memory, fetch their device copies",
     lambda program, typed, machine: offload_to_host(program, typed.bound.par.offload)),
    ("make what a pipeline stage builds from buffers and constants once, for all its micro-batches",
     lambda program, typed, machine: share_constants_between_micro_batches(program, drawn_ops(typed.bound.graph))
     if typed.bound.par.pipeline is not None else program),
    ("release each value after its last use", lambda program, typed, machine: release_dead_values(program)),
    ("make the submodules the file recomputes again in backward",
     lambda program, typed, machine: recompute_layers(program, typed)),
    ("keep a sequence-parallel linear's input split for backward, gather it again there",
     lambda program, typed, machine: regather_split_inputs(program, typed)),
    ("cut a gather before a matrix product, or a reduce-scatter after one, into chunks that overlap it",
     lambda program, typed, machine: chunked_collective_matmuls(program, typed, machine)),
)


def _passes_after_lowering(program: LoweredProgram, typed: TypedGraph, machine) -> LoweredProgram:
    """`machine`: the one the plan is compiled for, where a pass weighs a rewrite by the cost model."""
    for _, run in PASSES_AFTER_LOWERING:
        program = run(program, typed, machine or default_machine())
    return program


def _lowered(typed: TypedGraph, bucket_mb: float, limit: int | None) -> LoweredProgram:
    """The lowered program, its FSDP groups of gathered parameters resharded after forward
    (pardsl/passes/reshard.py) unless it keeps within the memory bound `limit` (bytes per rank) without: then no
    group is gathered twice. Over the bound, every group gathered whole is resharded, as the search counts
    gathered parameters (two groups whole at a time)."""
    program = lower(typed, bucket_mb)
    if limit is not None and memory_per_rank(program)["total"] <= limit:
        return program
    return reshard_after_forward(program, typed, any_axis=limit is not None)


def _compile_pipelined(par: ParFile, bucket_mb: float, machine, bound: BoundPlan | None = None,
                       priced_on: str = "", chosen_again: frozenset[str] = frozenset()) -> Compiled:
    """The same stages for one micro-batch, with the pipeline pass between lowering and codegen. `priced_on`:
    the recipe whose layouts a searched pipeline was chosen on (PipelineOption.priced_on), if any.
    `chosen_again`: of the file's `schedule ?` and `cut ?`, those written with what its pipeline was priced
    with and chosen again for each plan weighed, on its layouts as compiled, as the pipeline search
    chooses them (the micro-batch count stays: it is the trace's)."""
    if par.pipeline.searched:
        return _compile_searched_pipeline(par, bucket_mb, machine)
    decl = pp.check_pipeline(par)
    bound = bind(pp.micro_batched(par)) if bound is None else bound
    pp.check_layouts(bound, decl)
    seconds = dict(bound.seconds)
    typed = timed(seconds, "infer", lambda: infer(bound))
    pp.check_unsplit(typed, decl)
    pipeline_axis = bound.mesh.axis_index(decl.axis)
    ranks = bound.mesh.axis_sizes[pipeline_axis]
    limit = memory_limit(bound, microbatches=decl.microbatches)
    searched = wants_search(bound) and any(size > 1 for axis, size in enumerate(bound.mesh.axis_sizes)
                                           if axis != pipeline_axis)
    if searched:
        # The other axes are searched (what the file marks `?`, or all of them where it writes no layout)
        # for one micro-batch's step through the whole model, the pipeline axis kept B. A rank holds about
        # 1/ranks of the parameters and, for the first rank, `held` micro-batches of its stage's
        # activations: so the whole model's memory, its activations counted `held` times, is held to
        # `ranks` times the bound. Lowered in stages, the plan is checked rank by rank (N003).
        # (a schedule chosen again for the plan found can hold more: the bound is checked on its stages)
        held = pp.micro_batches_held(decl.schedule, decl.microbatches, ranks, 0, decl.stages_per_rank)
        typed, searched_program = searched_or_greedy(bound, machine or default_machine(),
                                                     lambda typed, limit: _lowered(typed, bucket_mb, limit), seconds,
                                                     kept=(pipeline_axis,),
                                                     limit=None if limit is None else limit * ranks,
                                                     activation_weight=held)
        pp.check_unsplit(typed, decl)

    def pipelined(typed: TypedGraph) -> _PipelinedPlan:
        """The plan cut into its stages, through the passes, its layers recomputed where it is over the
        bound and the file names none to recompute; rated as the pipeline runs it (within the bound before
        over it; over it, the nearer first)."""
        def lower_pipelined():
            written = pipeline_for(typed) if chosen_again else decl
            stage_of, cut_before = pp.stage_of_nodes(typed, written, machine)
            program, stages = lower_in_stages(
                typed, bucket_mb, lambda *whole: pp.split_program(typed, stage_of, len(cut_before) + 1, *whole))
            outputs = tuple((str(typed.info(node).dtype), node in typed.requires_grad) for _, node in bound.outputs)
            plan = pp.PipelinePlan(written.axis, written.schedule, written.microbatches, written.stages_per_rank,
                                   tuple(cut_before), pp.shared_parameters(stages), outputs)
            return program, [_passes_after_lowering(stage, typed, machine) for stage in stages], plan

        program, stages, plan = timed(seconds, "lower", lower_pipelined)
        if limit is not None and not par.recomputes_written and pipelined_memory_per_rank(stages, plan)["total"] > limit:
            stages, note = timed(seconds, "recompute", lambda: recomputed_stages_within(
                stages, plan, typed, limit, machine or default_machine()))
            program.notes.extend([note] if note else [])
        held_total = pipelined_memory_per_rank(stages, plan)["total"]
        over = limit is not None and held_total > limit
        rated = Compiled(par, bound, typed, program, "", seconds, None, plan, tuple(stages))
        step = pipelined_step_seconds(rated, machine or default_machine()) if searched else 0.0
        return _PipelinedPlan((over, held_total if over else step), typed, program, stages, plan, step, held_total)

    def pipeline_for(typed: TypedGraph):
        """The pipeline with the cut (and where the file leaves it open, the schedule) the pipeline search
        finds fastest for these layouts, traced as compiled. The option was chosen on the layouts it was
        priced with, on the trace of the batch the file writes, where the greedy completion can differ from
        the one compiled. The long-context recipe's loss: on the whole batch's trace its labels' rows were
        split over `cp` and the logits' gradient exchanged back, which a micro-batch of one sequence a rank
        cannot do. Priced there, its interleaved schedules lost to 1F1B; chosen again on the layouts
        compiled, one of them was the fastest by a fifth."""
        asked = replace(decl, searched=chosen_again)  # the option's own schedule and cut priced beside
        # with no bound, what a rank holds does not choose the cut: the stage programs are not lowered for it
        chosen, _ = choose_pipeline(typed, lower(typed, bucket_mb), asked, machine or default_machine(), limit,
                                    decl.microbatches, price_memory=limit is not None,
                                    lowering=stage_lowering(bucket_mb, machine), other_layouts=False)
        return chosen

    chosen = pipelined(typed)
    if searched:
        chosen = _weighed_against_pipelined_recipes(bound, chosen, pipelined, pipeline_axis,
                                                    machine or default_machine(), limit, seconds, priced_on)
        # what the search said of its own run, lowered again above in stages: its budget spent (N006), and
        # where its plan is compiled, where the descent started (N004)
        chosen.program.notes.extend(note for note in searched_program.notes
                                    if note.code == "N006" or note.code == "N004" and chosen.typed is typed)
    program, stages, plan = chosen.program, chosen.stages, chosen.plan
    source = timed(seconds, "codegen", lambda: render_pipeline(stages, plan))
    memory_bound = _check_memory_bound(bound, program, pipelined_memory_per_rank(stages, plan), limit)
    return Compiled(par, bound, chosen.typed, program, source, seconds, memory_bound, plan, tuple(stages),
                    recipe=chosen.recipe)


class _PipelinedPlan(NamedTuple):
    """A pipelined plan as compiled, and its rating: over the bound, then what it holds where over, else its
    pipelined step."""

    rating: tuple[bool, float]
    typed: TypedGraph
    program: LoweredProgram  # the uncut one, which carries the plan's notes
    stages: list[LoweredProgram]
    plan: object  # pp.PipelinePlan
    step_s: float
    held: int  # bytes on the rank that holds the most
    recipe: str = ""  # the known recipe whose layouts it has, if one


def _weighed_against_pipelined_recipes(bound: BoundPlan, best: _PipelinedPlan, pipelined, pipeline_axis: int,
                                       machine, limit: int | None, seconds: dict[str, float],
                                       priced_on: str = "") -> _PipelinedPlan:
    """The searched plan, or the best known recipe on the axes beside the pipeline's where that is rated
    better cut into stages as the pipeline runs them. The search rates a plan on the whole model before it
    is cut, which is not the pipelined step: a recipe is weighed only as compiled. Note N009 says which
    recipe it was weighed against; N010, where the pipeline was chosen on the layouts of a recipe
    (`priced_on`) that could not be compiled cut into its stages."""
    weighed, failed = [], {}
    for name, typed in timed(seconds, "recipes", lambda: completed_recipes(
            bound, machine, (pipeline_axis,), limit, bound.mesh.axis_sizes[pipeline_axis])):
        try:  # a candidate the compile can do without: one the passes cannot take is left out
            weighed.append((name, pipelined(typed)._replace(recipe=name)))
        except Exception as error:  # noqa: BLE001 - see above
            failed[name] = error
            continue
    if priced_on and priced_on not in dict(weighed):
        # the option kept was priced on layouts the plan compiled does not have: its figures are not this plan's
        why = f"could not be cut into its stages ({_first_line(failed[priced_on])})" \
            if priced_on in failed else "was not written for the model at the micro-batch size chosen"
        unpriced = Diagnostic(
            "N010", f"the pipeline was chosen on the layouts of the recipe {priced_on}, which {why}; the plan "
            "compiled has other layouts, and its own estimate", bound.par.pipeline.span,
            ("`pardsl explain` lists the pipelines priced, each with the layouts it was priced on; write the "
             "schedule, micro-batches and cut to compile another",), severity="note")
    else:
        unpriced = None
    best = _recipe_weighed_in(bound, best, weighed, limit)
    best.program.notes.extend([unpriced] if unpriced else [])
    return best


def _first_line(error: Exception) -> str:
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _recipe_weighed_in(bound: BoundPlan, best: _PipelinedPlan, weighed: list[tuple[str, _PipelinedPlan]],
                       limit: int | None) -> _PipelinedPlan:
    """The better of the searched plan and the best of the recipes `weighed`, with note N009."""
    if not weighed:
        return best
    name, theirs = min(weighed, key=lambda candidate: candidate[1].rating)
    compiled_it = theirs.rating < best.rating or layouts_of(theirs.typed) == layouts_of(best.typed)
    if theirs.rating < best.rating:
        kept = theirs
    else:  # the search's plan, named for the recipe where it has the recipe's layouts
        kept = best._replace(recipe=name) if compiled_it else best

    def said(plan: _PipelinedPlan):
        return _Said(plan.step_s, {"total": plan.held})

    kept.program.notes.append(descent.recipe_note(bound, name, said(theirs), said(kept), compiled_it, limit))
    return kept


class _Said(NamedTuple):
    """What note N009 reads of a plan: its step and what it holds."""

    step_s: float
    memory: dict[str, int]


def _compile_searched_pipeline(par: ParFile, bucket_mb: float, machine) -> Compiled:
    """`pipeline pp : schedule ?, microbatches ?, cut ?`: the options written `?` chosen by the cost model
    (pardsl/planning/pipeline_search.py) on the plan traced once, then the pipeline chosen compiled as if
    written (traced again only where the micro-batch count chosen differs from the one traced)."""
    decl = pp.check_pipeline(par)
    bound = bind(pp.micro_batched(par))
    pp.check_layouts(bound, decl)
    seconds = dict(bound.seconds)
    typed = timed(seconds, "infer", lambda: infer(bound))
    pp.check_unsplit(typed, decl)
    machine = machine or default_machine()
    program = timed(seconds, "lower", lambda: lower(typed, bucket_mb))
    _, options = timed(seconds, "pipeline search", lambda: choose_pipeline(
        typed, program, decl, machine, memory_limit(bound, microbatches=decl.microbatches), decl.microbatches,
        lowering=stage_lowering(bucket_mb, machine)))

    def compiled_as(option, again: frozenset[str]) -> Compiled:
        written = pipeline_written_as(decl, option)
        concrete = replace(par, pipelines=(written,))
        same_trace = written.microbatches == decl.microbatches
        compiled = _compile_pipelined(concrete, bucket_mb, machine,
                                      replace(bound, par=pp.micro_batched(concrete)) if same_trace else None,
                                      priced_on=option.priced_on, chosen_again=again)
        for stage, spent in seconds.items():
            if same_trace and stage in bound.seconds:
                continue  # the one trace: the compile's own seconds count it already
            compiled.seconds[f"pipeline search: {stage}" if stage in compiled.seconds else stage] = spent
        return compiled

    # The options are priced on one trace (the batch the file writes) and the layouts searched for it; the
    # pipeline chosen is compiled on its own micro-batch's trace, its layouts searched again for it, and
    # can hold more than its option said (the long-context recipe at 32 layers, its layouts searched:
    # 52.3 GiB against an option of 24.8 and a bound of 31.8). Then the next options within the bound are
    # compiled, and the first the compile finds within it is kept: each with its own schedule (chosen
    # again, the schedule would be the first's again at the same micro-batch count), its cut chosen again.
    compiled = compiled_as(options[0], decl.searched & {"cut", "schedule"})
    kept, first = options[0], _option_as_compiled(options[0], compiled, machine)
    for option in options[1:1 + RECOMPILED_OPTIONS]:
        if not _over_its_bound(compiled) or not option.within_bound:
            break
        other = compiled_as(option, decl.searched & {"cut"})
        if not _over_its_bound(other):
            compiled, kept = other, option
            compiled.program.notes.append(Diagnostic(
                "N011", f"the pipeline priced fastest within the bound ({_option_text(first)}) held more "
                f"than the bound once compiled; the next within it is compiled: {_option_text(option)}",
                par.pipeline.span, ("`pardsl explain` lists the pipelines priced",), severity="note"))
    # the option kept, as compiled, in place of the one priced with its schedule and micro-batches
    kept = _option_as_compiled(kept, compiled, machine)
    return replace(compiled, pipeline_options=(kept, *(o for o in options if _pipeline_key(o) != _pipeline_key(kept))))


def _pipeline_key(option) -> tuple:
    return option.schedule, option.stages_per_rank, option.microbatches


def _option_as_compiled(option, compiled: Compiled, machine):
    """The option kept, with the schedule and cut its plan was compiled with (chosen again for the layouts
    compiled), the recipe whose layouts it has (if one), and that plan's step and memory, where they differ
    from the ones priced."""
    plan = compiled.pipeline
    if (plan.schedule, plan.stages_per_rank, plan.cut_before, compiled.recipe) == \
            (option.schedule, option.stages_per_rank, option.cut_before, option.priced_on):
        return option
    held = pipelined_memory_per_rank(compiled.stages, compiled.pipeline)["total"]
    priced = pipelined_step(compiled, machine or default_machine())
    return replace(option, schedule=plan.schedule, stages_per_rank=plan.stages_per_rank, cut_before=plan.cut_before,
                   priced_on=compiled.recipe,
                   step_s=priced.step_s, busiest_s=priced.busiest_s, synchronised_s=priced.synchronised_s,
                   memory=held, within_bound=compiled.memory_bound is None or held <= compiled.memory_bound)


# How many options after the chosen one a searched pipeline compiles where the chosen one, compiled, holds
# more than the bound: each is a compile of the whole model in stages
RECOMPILED_OPTIONS = 2


def _over_its_bound(compiled: Compiled) -> bool:
    return compiled.memory_bound is not None and \
        pipelined_memory_per_rank(compiled.stages, compiled.pipeline)["total"] > compiled.memory_bound


def _option_text(option) -> str:
    return f"{option.schedule} over {option.microbatches} micro-batches" + \
        (f", {option.stages_per_rank} stages a rank" if option.stages_per_rank > 1 else "")


def stage_lowering(bucket_mb: float = DEFAULT_BUCKET_MB, machine=None) -> StageLowering:
    """The compile's lowering, for the pipeline search to price its options on the programs the compile
    makes: the whole program, and the stage programs of a cut through the passes after lowering."""

    def staged(typed):
        def parts_of(stage_of: dict[str, int], count: int) -> list:
            _, parts = lower_in_stages(typed, bucket_mb, lambda *whole: pp.split_program(typed, stage_of, count, *whole))
            for _, run in PASSES_AFTER_LOWERING:
                parts = [run(part, typed, machine or default_machine()) for part in parts]
            return parts
        return parts_of

    return StageLowering(lambda typed: lower(typed, bucket_mb), staged)


def _check_memory_bound(bound: BoundPlan, program: LoweredProgram, memory: dict[str, int] | None = None,
                        limit: int | None = None) -> int | None:
    """The bound in bytes per rank (the one the search met); a plan that needs more (`memory`, default
    the program's per rank) is note N003 at the `memory` line."""
    limit = memory_limit(bound) if limit is None else limit
    if limit is None:
        return None
    written = bound.par.memory_bound
    memory = memory_per_rank(program) if memory is None else memory
    if memory["total"] > limit:
        program.notes.append(Diagnostic(
            "N003", f"the plan needs {format_bytes(memory['total'])} per rank, more than the bound of "
            f"{format_bytes(limit)} ({written})", written.span,
            (f"parameters {format_bytes(memory['parameters'])}, gradients {format_bytes(memory['gradients'])}, "
             f"AdamW state {format_bytes(memory['optimizer_state'])}, activations {format_bytes(memory['activations'])}"
             f", gathered parameters {format_bytes(memory['gathered_parameters'])}; split more of them "
             "(`pardsl explain` shows where the bytes are)",), severity="note"))
    return limit


def compile_bound(par: ParFile, bound: BoundPlan, bucket_mb: float = DEFAULT_BUCKET_MB, machine=None) -> Compiled:
    """`par` compiled on a model already traced and bound (`bound_on_mesh`): explain's alternatives of a
    plan, each the plan's file with a line changed, on the plan's own trace."""
    with _cyclic_collector_paused():
        return _compile(par, bucket_mb, machine or default_machine(), bound)


def compile_file(path: str, bucket_mb: float = DEFAULT_BUCKET_MB, machine=None) -> Compiled:
    return compile_par(parse_file(path), bucket_mb, machine)


def compile_text(text: str, path: str = "<string>", bucket_mb: float = DEFAULT_BUCKET_MB, machine=None) -> Compiled:
    return compile_par(parse(text, path), bucket_mb, machine)


def plan_json(compiled: Compiled, machine=None) -> dict:
    """What compile writes beside the module. `machine`: the cost model's figures for the estimate
    (default: the calibration file for this machine's backend, else the backend's defaults)."""
    machine = machine or default_machine()
    program = compiled.program
    mesh = program.mesh
    return {
        "pardsl": __version__,
        "source": program.source_path,
        "model": program.model,
        "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes)),
        "world_size": mesh.size,
        "parameters": {p.name: {"layout": named_layout(p.layout, mesh), "shape": list(p.shape),
                                "local_shape": list(p.local_shape)} for p in program.parameters},
        "buffers": {b.name: {"layout": named_layout(b.layout, mesh), "shape": list(b.shape),
                             "local_shape": list(b.local_shape)} for b in program.buffers},
        "inputs": {i.name: {"layout": named_layout(i.layout, mesh), "shape": list(i.shape),
                            "local_shape": list(i.local_shape)} for i in program.inputs},
        "outputs": {o.path: {"layout": named_layout(o.layout, mesh), "shape": list(o.shape),
                             "local_shape": list(o.local_shape)} for o in program.outputs},
        "tensors": program.values,
        "collectives": [c.to_json() for c in program.collectives],
        "parameter_gathers": [{"axis": g.axis, "bytes": sum(m.nbytes for m in g.members),
                               "parameters": [m.attr for m in g.members]} for g in program.gathers],
        "gradient_buckets": [{"collective": b.kind, "axes": list(b.axes), "bytes": b.nbytes,
                              "parameters": [m[0] for m in b.members]} for b in program.buckets],
        "collective_counts": program.collective_counts(),
        "collective_counts_by_axis": program.collective_counts_by_axis(),
        "bytes": program.collective_bytes(),
        "memory": program.memory(),
        "memory_bound": compiled.memory_bound,
        "estimate": estimate(compiled, machine).to_json(),
        "notes": [n.to_json() for n in program.notes],
    }


def write_outputs(compiled: Compiled, out_dir: str, machine=None) -> tuple[str, str]:
    """Write the module and plan.json into `out_dir`, each atomically: a temporary file in the same folder
    renamed over the old one, so a failure (a full disk) leaves the previous pair whole, and a symbolic
    link in the way is replaced, never followed. Raises OSError where the folder cannot be written."""
    if not out_dir:
        raise FileNotFoundError("the output folder is an empty path")
    os.makedirs(out_dir, exist_ok=True)
    module_path = os.path.join(out_dir, MODULE_FILE)
    plan_path = os.path.join(out_dir, PLAN_FILE)
    write_atomically(module_path, compiled.source)
    write_atomically(plan_path, json.dumps(plan_json(compiled, machine), indent=2, sort_keys=False) + "\n")
    return module_path, plan_path
