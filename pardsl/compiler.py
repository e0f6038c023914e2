"""The pipeline, one direction: text → syntax tree → bound plan → typed graph → lowered program → code.

Each stage is a function of the previous stage's result (syntax.parse, binding.bind, inference.infer,
lowering.lower, codegen.render); this module only chains them and writes what `pardsl compile` emits.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

from pardsl import __version__
from pardsl.language.diagnostics import Diagnostic
from pardsl.language.files import write_atomically
from pardsl.language.progress import report
from pardsl.language.syntax import ParFile, parse, parse_file
from pardsl.model.binding import BoundPlan, bind
from pardsl.passes import pipeline as pp
from pardsl.passes.early_count import start_counts_early
from pardsl.passes.fused_norms import fuse_rms_norms
from pardsl.passes.fused_rotary import fuse_rotary_embeddings
from pardsl.passes.liveness import release_dead_values
from pardsl.passes.reshard import reshard_after_forward
from pardsl.planning.cost import (
    DEFAULT_BUCKET_MB,
    default_machine,
    estimate,
    memory_per_rank,
    pipelined_memory_per_rank,
)
from pardsl.planning.inference import TypedGraph, infer
from pardsl.planning.search import BoundUnmet, NoPlanFound, graph_facts, memory_limit, search, wants_search
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


def _compile(par: ParFile, bucket_mb: float, machine) -> Compiled:
    if par.pipeline is not None:
        return _compile_pipelined(par, bucket_mb, machine)
    bound = bind(par)
    seconds = dict(bound.seconds)
    if wants_search(bound):
        typed, program = _searched_or_greedy(bound, machine or default_machine(), bucket_mb, seconds)
    else:
        typed = _timed(seconds, "infer", lambda: infer(bound))
        program = _timed(seconds, "lower", lambda: _lowered(typed, bucket_mb, None))
    program = _passes_after_lowering(program, typed)
    source = _timed(seconds, "codegen", lambda: render(program))
    return Compiled(par, bound, typed, program, source, seconds, _check_memory_bound(bound, program))


# The passes over every lowered program (or pipeline stage), in order, each program -> program (with the
# typed graph to read): norms and rotary embeddings fused, a partial loss's count started early, then each
# value released after its last use, which reads what the others made. Before them, where a plan needs
# them: FSDP's reshard after forward (_lowered) and the cut into pipeline stages (_compile_pipelined).
PASSES_AFTER_LOWERING = (
    ("fuse each local RMSNorm", lambda program, typed: fuse_rms_norms(program, typed.bound.kept)),
    ("fuse each local rotary embedding", lambda program, typed: fuse_rotary_embeddings(program)),
    ("count a partial loss's targets early", lambda program, typed: start_counts_early(program)),
    ("release each value after its last use", lambda program, typed: release_dead_values(program)),
)


def _passes_after_lowering(program: LoweredProgram, typed: TypedGraph) -> LoweredProgram:
    for _, run in PASSES_AFTER_LOWERING:
        program = run(program, typed)
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


# what each stage is doing, in words, for a terminal's status line (pardsl/language/progress.py)
_STAGE_WORDS = {"infer": "completing the layouts",
                "search": "searching the layouts", "greedy": "completing the layouts greedily, to compare",
                "lower": "lowering to collectives", "codegen": "writing the module"}


def _timed(seconds: dict, stage: str, work):
    report(_STAGE_WORDS.get(stage, stage))
    start = time.perf_counter()
    result = work()
    seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - start
    return result


class _Candidate(NamedTuple):
    """A completed plan, as the cost model reads it."""

    typed: TypedGraph
    program: LoweredProgram


def _searched_or_greedy(bound: BoundPlan, machine, bucket_mb: float, seconds: dict, kept: tuple[int, ...] = (),
                        limit: int | None = None, activation_weight: float = 1.0) -> tuple[TypedGraph, LoweredProgram]:
    """The search decides one mesh axis at a time, so what it finds depends on the order the axes are
    decided in, and on some meshes the greedy completion of the same file is estimated faster still. It
    runs in every order of the axes that have more than one rank; of those plans and the greedy completion
    the one the cost model rates fastest (a plan within the memory bound before one over it; the greedy
    one only within it) is the start of a descent: pairs of axes decided again jointly with the others
    fixed, kept while the plan is rated faster (_descended). Note N004 says when the greedy completion is
    where the descent started. Axes in `kept` (a pipeline's) are not searched: they stay as the greedy
    completion has them (B), and every program starts from it. `limit` (default: the file's bound) is
    met by the plan's memory with its activations counted `activation_weight` times."""
    limit = memory_limit(bound) if limit is None else limit
    seconds["search"] = seconds["lower"] = 0.0
    facts = _timed(seconds, "search", lambda: graph_facts(bound))

    def rated(typed: TypedGraph, program: LoweredProgram):
        plan = estimate(_Candidate(typed, program), machine)
        held = plan.memory["total"] + (activation_weight - 1) * plan.memory["activations"]
        return (limit is not None and held > limit, plan.step_s)

    # A descent's move often returns the plan it started from (every move of its last round does): lowered
    # and rated once per plan, as lowering reads nothing of a plan but its layouts. Nor is an axis decided
    # alone again from a plan that such a program proved optimal (TypedGraph.settled): the descent's first
    # move of the order's last axis, and of the axis its last move decided, found its start again.
    lowered: dict[tuple, tuple[tuple, set[int]]] = {}  # per plan's layouts: (rating, typed, program), settled axes

    def searched(order: tuple[int, ...], start: TypedGraph | None = None, nearest: bool = True):
        if start is not None and len(order) == 1:
            plan, settled = lowered.get(_layouts_of(start), (None, ()))
            if order[0] in settled:
                return plan
        plan, saved_buckets = found(order, start, nearest, True)
        if saved_buckets:
            # the bucket latencies are the search's own estimate, after its programs: the cost model rates
            # its plan against the one the programs alone give (whose answers the search has kept)
            plan = min(plan, found(order, start, nearest, False)[0], key=lambda plan: plan[0])
        return plan

    def found(order: tuple[int, ...], start: TypedGraph | None, nearest: bool, fewer_buckets: bool):
        clock = time.perf_counter()
        try:
            typed = search(bound, machine, limit, order=order, start=start, facts=facts, nearest=nearest,
                           activation_weight=activation_weight, fewer_buckets=fewer_buckets)
        finally:
            seconds["search"] += time.perf_counter() - clock
        key = _layouts_of(typed)
        if key not in lowered:
            clock = time.perf_counter()
            program = _lowered(typed, bucket_mb, limit)
            lowered[key] = (rated(typed, program), typed, program), set()
            seconds["lower"] += time.perf_counter() - clock
        plan, settled = lowered[key]
        settled.update(typed.settled)
        return plan, typed.saved_buckets

    sized = [a for a in range(bound.mesh.ndim) if bound.mesh.axis_sizes[a] > 1 and a not in kept]
    unsized = tuple(a for a in range(bound.mesh.ndim) if a not in sized and a not in kept)
    greedy = _timed(seconds, "greedy", lambda: infer(bound))
    start = greedy if kept else None
    deadline = time.monotonic() + SEARCH_BUDGET_S
    stopped: list[Diagnostic] = []  # note N006, where the search ran out of time
    # An order whose plan cannot meet the bound loses to one whose plan does: the plan nearest the bound
    # (two more programs, seconds at 32 layers) is looked for only in the last order, where no order
    # before it met the bound.
    orders = _axis_orders(sized)
    plans = []
    for i, order in enumerate(orders):
        out_of_time = time.monotonic() > deadline
        if out_of_time and plans:
            stopped.append(_out_of_time(bound, f"{i} of {len(orders)} orders of the mesh axes"))
            break
        with contextlib.suppress(BoundUnmet):  # out of time with no plan yet: this order's, or the nearest
            plans.append(searched(unsized + order, start=start,
                                  nearest=not plans and (out_of_time or i == len(orders) - 1)))
        if out_of_time and i < len(orders) - 1:
            stopped.append(_out_of_time(bound, f"{i + 1} of {len(orders)} orders of the mesh axes"))
            break
    best = best_searched = min(plans, key=lambda plan: plan[0])  # the mesh's own order on a tie
    clock = time.perf_counter()
    greedy_program = _lowered(greedy, bucket_mb, limit)
    theirs = rated(greedy, greedy_program)
    seconds["greedy"] += time.perf_counter() - clock
    from_greedy = not theirs[0] and theirs < best[0]
    if from_greedy:
        best = (theirs, greedy, greedy_program)
    if len(sized) > 1 and not stopped:
        best = _descended(best, sized, searched, deadline,
                          lambda: stopped.append(_out_of_time(bound, "the first moves of its descent")))
    (_, step_s), typed, program = best
    program.notes.extend(stopped)
    if not from_greedy:
        return typed, program
    mine = best_searched[0][1]
    descent = "" if typed is greedy else f", then decided axes again ({step_s * 1e3:.3g} ms)"
    program.notes.append(Diagnostic(
        "N004", f"the greedy completion is estimated at {theirs[1] * 1e3:.3g} ms per step, the layout "
        f"search's plan at {mine * 1e3:.3g} ms: compiled the greedy one{descent}", _search_span(bound),
        ("the search decides one mesh axis at a time; `pardsl explain` shows the plan",), severity="note"))
    return typed, program


# The layout search's time for one file, beyond which it compiles the best plan found so far (note N006):
# what the orders and the descent may start, not a limit inside one program (search.TIME_LIMIT_S is).
# PARDSL_SEARCH_BUDGET_S sets another, for a model whose search is worth more time.
def _search_budget() -> float:
    try:
        return max(0.0, float(os.environ.get("PARDSL_SEARCH_BUDGET_S", "15")))
    except ValueError:
        return 15.0


SEARCH_BUDGET_S = _search_budget()


def _axis_orders(sized: list[int]) -> list[tuple[int, ...]]:
    """The orders the axes are decided in: every one for up to three axes; for more (whose orders grow as
    n!), each rotation of the mesh's order and of its reverse, 2n orders that still put every axis first
    and last once."""
    if len(sized) <= 3:
        return list(itertools.permutations(sized))
    rotations = [tuple(order[i:] + order[:i]) for order in (sized, sized[::-1]) for i in range(len(sized))]
    return list(dict.fromkeys(rotations))


def _search_span(bound: BoundPlan):
    """Where a note about the search points: the `memory` bound, else the first `?`, else the mesh."""
    par = bound.par
    written = next((entry.span for entry in par.layouts if entry.layout.form == "searched"), None)
    return par.memory_bound.span if par.memory_bound is not None else written or par.mesh.span


def _out_of_time(bound: BoundPlan, where: str) -> Diagnostic:
    """Note N006: the search stopped at its budget, and where."""
    return Diagnostic(
        "N006", f"the layout search stopped at its time budget of {SEARCH_BUDGET_S:.0f} s, after {where}: the "
        "best plan found so far is compiled", _search_span(bound),
        ("`pardsl explain` shows the plan and its runner-ups",), severity="note")


def _layouts_of(typed: TypedGraph) -> tuple:
    """Everything of a plan that lowering reads."""
    return (tuple(typed.nodes.values()), tuple(typed.placeholder_layouts.items()), tuple(typed.output_layouts))


def _descended(plan, axes: list[int], searched, deadline: float = math.inf, out_of_time=lambda: None,
               rounds: int = 4):
    """Descent over the mesh's axes: each axis decided again alone, with every other axis fixed as the
    plan has it; where no such move improves, each pair of axes decided again by one integer program over
    both, every op keeping its signature on at least one of the two (a neighbourhood that holds every move
    of one axis alone, and any mix of such moves across ops, solved in seconds where the whole product of
    two axes' choices takes minutes). Each round makes the move the cost model rates best, while it rates
    it better than the plan, until a round changes nothing (or `rounds` rounds, which bounds compile time
    on large models). The one-axis moves are not only cheaper: a program's optimum is the search's own
    estimate's, which the cost model can rate behind a move of one axis."""
    neighbourhoods = ([(axis,) for axis in axes], [(pair,) for pair in itertools.combinations(axes, 2)])
    for _ in range(rounds):
        for moves in neighbourhoods:  # the pair programs, larger, only where no axis alone improves
            found = []
            for move in moves:
                if time.monotonic() > deadline:  # the moves found so far are weighed, and no more are tried
                    out_of_time()
                    return min([plan, *found], key=lambda moved: moved[0])
                with contextlib.suppress(NoPlanFound):  # a move whose program gives no plan is not made
                    found.append(searched(move, start=plan[1]))
            best = min(found, key=lambda moved: moved[0], default=plan)
            if best[0] < plan[0]:
                plan = best
                break
        else:
            break
    return plan


def _compile_pipelined(par: ParFile, bucket_mb: float, machine) -> Compiled:
    """The same stages for one micro-batch, with the pipeline pass between lowering and codegen."""
    decl = pp.check_pipeline(par)
    bound = bind(pp.micro_batched(par))
    pp.check_layouts(bound, decl)
    seconds = dict(bound.seconds)
    typed = _timed(seconds, "infer", lambda: infer(bound))
    pp.check_unsplit(typed, decl)
    pipeline_axis = bound.mesh.axis_index(decl.axis)
    ranks = bound.mesh.axis_sizes[pipeline_axis]
    limit = memory_limit(bound, microbatches=decl.microbatches)
    if wants_search(bound) and any(size > 1 for axis, size in enumerate(bound.mesh.axis_sizes) if axis != pipeline_axis):
        # The other axes are searched (what the file marks `?`, or all of them where it writes no layout)
        # for one micro-batch's step through the whole model, the pipeline axis kept B. A rank holds about
        # 1/ranks of the parameters and, for the first rank, `held` micro-batches of its stage's
        # activations: so the whole model's memory, its activations counted `held` times, is held to
        # `ranks` times the bound. Lowered in stages, the plan is checked rank by rank (N003).
        held = pp.micro_batches_held(decl.schedule, decl.microbatches, ranks, 0)
        typed, _ = _searched_or_greedy(bound, machine or default_machine(), bucket_mb, seconds, kept=(pipeline_axis,),
                                       limit=None if limit is None else limit * ranks, activation_weight=held)
        pp.check_unsplit(typed, decl)

    def lower_pipelined():
        stage_of, cut_before = pp.stage_of_nodes(typed, decl, machine)
        program, stages = lower_in_stages(
            typed, bucket_mb, lambda *whole: pp.split_program(typed, stage_of, len(cut_before) + 1, *whole))
        outputs = tuple((str(typed.info(node).dtype), node in typed.requires_grad) for _, node in bound.outputs)
        plan = pp.PipelinePlan(decl.axis, decl.schedule, decl.microbatches, decl.stages_per_rank,
                               tuple(cut_before), pp.shared_parameters(stages), outputs)
        return program, [_passes_after_lowering(stage, typed) for stage in stages], plan

    program, stages, plan = _timed(seconds, "lower", lower_pipelined)
    source = _timed(seconds, "codegen", lambda: render_pipeline(stages, plan))
    memory_bound = _check_memory_bound(bound, program, pipelined_memory_per_rank(stages, plan), limit)
    return Compiled(par, bound, typed, program, source, seconds, memory_bound, plan, tuple(stages))


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
