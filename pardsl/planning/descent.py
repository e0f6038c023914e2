"""Stage 3, searched, as a whole: which integer programs to solve, and which plan to keep.

search.search decides a group of mesh axes by one integer program, the other axes fixed. What it finds
depends on the order the axes are decided in, so every order is searched; the greedy completion
(inference.infer) competes too; and from the best of those, a descent decides axes again, one at a time
and then in pairs, while the cost model rates the move faster. Plans are rated on their lowered programs
(cost.estimate): lowering is a later stage, which the compiler passes in, so that planning never imports
it. The whole is held to a time budget (SEARCH_BUDGET_S, note N006).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import time
from typing import Any, Callable, NamedTuple

from pardsl.language.diagnostics import Diagnostic
from pardsl.language.progress import timed
from pardsl.model.binding import BoundPlan
from pardsl.planning import work
from pardsl.planning.cost import Machine, estimate, format_bytes
from pardsl.planning.inference import TypedGraph, infer
from pardsl.planning.recipes import completed_recipes
from pardsl.planning.search import BoundUnmet, NoPlanFound, graph_facts, memory_limit, search


class CompletedPlan(NamedTuple):
    """A completed plan and its lowered program, as the cost model reads them (cost.estimate)."""

    typed: TypedGraph
    program: Any  # program.ir.LoweredProgram, a later stage's type


class RecipePlan(NamedTuple):
    """A known recipe written for the model (recipes.py), completed and lowered: a candidate of the search."""

    name: str
    typed: TypedGraph
    program: Any


def recipe_plans(bound: BoundPlan, machine: Machine, lowered: Callable[[TypedGraph, int | None], Any],
                 limit: int | None, kept: tuple[int, ...] = (),
                 seconds: dict[str, float] | None = None) -> list[RecipePlan]:
    """Each recipe that fits the file completed by the greedy inference around its layouts and lowered; a
    recipe the model's ops cannot take is left out. Its plan is typed against the file as written, so that
    what lowering says of written layouts is said of the file's."""
    def written() -> list[RecipePlan]:
        # A recipe is a candidate the compile can do without: one the graph's recognition or the model's
        # ops cannot take, whatever goes wrong, is left out rather than failing a compile that needs none.
        # Nor is one offered here beside a pipeline: there the search's rating of the whole model, before it
        # is cut into stages, is not the pipelined step, and a recipe it rated better was slower once cut
        # (the long-context Llama 3 405B row: 3.29 times the written plan's step, where the search's own
        # plan took 0.51). The compiler weighs them there as compiled, cut into stages.
        if kept:
            return []
        found = []
        for name, typed in completed_recipes(bound, machine, kept, None):
            try:
                found.append(RecipePlan(name, typed, lowered(typed, limit)))
            except Exception:  # noqa: BLE001 - see above
                continue
        return found

    return timed({} if seconds is None else seconds, "recipes", written)


def searched_or_greedy(bound: BoundPlan, machine: Machine, lowered: Callable[[TypedGraph, int | None], Any],
                       seconds: dict[str, float], kept: tuple[int, ...] = (), limit: int | None = None,
                       activation_weight: float = 1.0, deadline: float = math.inf,
                       recipes_lowered: list[RecipePlan] | None = None,
                       greedy_lowered: tuple[TypedGraph, Any] | None = None) -> tuple[TypedGraph, Any]:
    """The search decides one mesh axis at a time, so what it finds depends on the order the axes are
    decided in, and on some meshes the greedy completion of the same file is estimated faster still. It
    runs in every order of the axes that have more than one rank; of those plans and the greedy completion
    the one the cost model rates fastest (a plan within the memory bound before one over it; the greedy
    one only within it) is the start of a descent: pairs of axes decided again jointly with the others
    fixed, kept while the plan is rated faster (descended). Note N004 says when the greedy completion is
    where the descent started. Axes in `kept` (a pipeline's) are not searched: they stay as the greedy
    completion has them (B), and every program starts from it. `limit` (default: the file's bound) is
    met by the plan's memory with its activations counted `activation_weight` times. `lowered(typed,
    limit)`: the plan's lowered program, which the cost model rates (lowering is a later stage's: the
    compiler passes it in). `deadline` (search_clock's): where it comes before the search's own budget
    is spent, no order or move is started after it. The known recipes written for the model compete too
    (`recipes_lowered`, recipe_plans' where the caller has them already): those within the bound, as the
    greedy completion, and the plan kept is never rated behind one of them by the search's own rating (the
    compiler weighs them again as compiled: note N009). `greedy_lowered`: the greedy completion and its
    lowered program, where the caller has them already. Returns the plan kept and its lowered program."""
    limit = memory_limit(bound) if limit is None else limit
    seconds["search"] = seconds["lower"] = 0.0
    facts = timed(seconds, "search", lambda: graph_facts(bound))

    def rated(typed: TypedGraph, program):
        plan = estimate(CompletedPlan(typed, program), machine)
        held = plan.memory["total"] + (activation_weight - 1) * plan.memory["activations"]
        return (limit is not None and held > limit, plan.step_s)

    # A descent's move often returns the plan it started from (every move of its last round does): lowered
    # and rated once per plan, as lowering reads nothing of a plan but its layouts. Nor is an axis decided
    # alone again from a plan that such a program proved optimal (TypedGraph.settled): the descent's first
    # move of the order's last axis, and of the axis its last move decided, found its start again.
    plans_lowered: dict[tuple, tuple[tuple, set[int]]] = {}  # per plan's layouts: (rating, typed, program), settled axes

    def searched(order: tuple[int, ...], start: TypedGraph | None = None, nearest: bool = True):
        if start is not None and len(order) == 1:
            plan, settled = plans_lowered.get(layouts_of(start), (None, ()))
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
        key = layouts_of(typed)
        if key not in plans_lowered:
            clock = time.perf_counter()
            program = lowered(typed, limit)
            work.charge(work.lowering(len(program.statements)))
            plans_lowered[key] = (rated(typed, program), typed, program), set()
            seconds["lower"] += time.perf_counter() - clock
        plan, settled = plans_lowered[key]
        settled.update(typed.settled)
        return plan, typed.saved_buckets

    sized = [a for a in range(bound.mesh.ndim) if bound.mesh.axis_sizes[a] > 1 and a not in kept]
    unsized = tuple(a for a in range(bound.mesh.ndim) if a not in sized and a not in kept)
    greedy = greedy_lowered[0] if greedy_lowered is not None else timed(seconds, "greedy", lambda: infer(bound))
    start = greedy if kept else None
    deadline = min(deadline, search_clock() + SEARCH_BUDGET_S)
    stopped: list[Diagnostic] = []  # note N006, where the search ran out of time
    # An order whose plan cannot meet the bound loses to one whose plan does: the plan nearest the bound
    # (two more programs, seconds at 32 layers) is looked for only in the last order, where no order
    # before it met the bound.
    orders = _axis_orders(sized)
    plans = []
    for i, order in enumerate(orders):
        out_of_time = search_clock() >= deadline
        if out_of_time and plans:
            stopped.append(out_of_time_note(bound, f"{i} of {len(orders)} orders of the mesh axes"))
            break
        with contextlib.suppress(BoundUnmet):  # out of time with no plan yet: this order's, or the nearest
            plans.append(searched(unsized + order, start=start,
                                  nearest=not plans and (out_of_time or i == len(orders) - 1)))
        if out_of_time and i < len(orders) - 1:
            stopped.append(out_of_time_note(bound, f"{i + 1} of {len(orders)} orders of the mesh axes"))
            break
    best = best_searched = min(plans, key=lambda plan: plan[0])  # the mesh's own order on a tie
    clock = time.perf_counter()
    # the caller's program is shared by every search that weighs it: the notes added below are this one's
    greedy_program = lowered(greedy, limit) if greedy_lowered is None else \
        dataclasses.replace(greedy_lowered[1], notes=list(greedy_lowered[1].notes))
    theirs = rated(greedy, greedy_program)
    seconds["greedy"] = seconds.get("greedy", 0.0) + time.perf_counter() - clock
    from_greedy = not theirs[0] and theirs < best[0]
    if from_greedy:
        best = (theirs, greedy, greedy_program)
    if recipes_lowered is None:
        recipes_lowered = recipe_plans(bound, machine, lowered, limit, kept, seconds)
    # a recipe, like the greedy completion, only within the bound: over it, the plan nearest the bound is the
    # search's to find
    rated_recipes = sorted(((rating, r) for r in recipes_lowered if not (rating := rated(r.typed, r.program))[0]),
                           key=lambda pair: pair[0])
    from_recipe = bool(rated_recipes) and rated_recipes[0][0] < best[0]
    if from_recipe:
        from_greedy = False
        # the recipe's program is shared by every search that weighs it: the notes added below are this one's
        chosen = rated_recipes[0][1]
        program = dataclasses.replace(chosen.program, notes=list(chosen.program.notes))
        best = (rated_recipes[0][0], chosen.typed, program)
    if len(sized) > 1 and not stopped:
        best = descended(best, sized, searched, deadline,
                          lambda: stopped.append(out_of_time_note(bound, "the first moves of its descent")))
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


def recipe_note(bound: BoundPlan, recipe: str, theirs, mine, compiled_it: bool, limit: int | None) -> Diagnostic:
    """Note N009: the best recipe's estimate (`theirs`, cost.estimate's) beside the compiled plan's (`mine`),
    both through the compile's passes, and whether the recipe is what was compiled."""
    def said(plan) -> str:
        over = " (over the bound)" if limit is not None and plan.memory["total"] > limit else ""
        return f"{plan.step_s * 1e3:.4g} ms a step in {format_bytes(plan.memory['total'])} per rank{over}"

    if compiled_it:
        verdict = f"is compiled ({said(mine)}): no plan the search found was rated better"
    else:
        verdict = (f"would take {said(theirs)}; the compiled plan, {mine.step_s / theirs.step_s:.2f} × its step, "
                   f"takes {said(mine)}")
    return Diagnostic("N009", f"the best known recipe for this model and mesh, {recipe}, {verdict}",
                      _search_span(bound), ("`pardsl explain` prices the plan per layer",), severity="note")


# The layout search's time for one file, beyond which it compiles the best plan found so far (note N006):
# what the orders and the descent may start, not a limit inside one program (solver.TIME_LIMIT_S is).
# PARDSL_SEARCH_BUDGET_S sets another, for a model whose search is worth more time.
def _search_budget() -> float:
    try:
        return max(0.0, float(os.environ.get("PARDSL_SEARCH_BUDGET_S", "15")))
    except ValueError:
        return 15.0


SEARCH_BUDGET_S = _search_budget()


def search_clock() -> float:
    """The clock the budget is counted on: the work the searches have done (work.py), in a reference
    machine's seconds. On a clock of seconds, of the wall or the thread's CPU, a loaded or slower machine
    stopped the search earlier than an idle or faster one, at another plan."""
    return work.spent()


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


def out_of_time_note(bound: BoundPlan, where: str) -> Diagnostic:
    """Note N006: the search stopped at its budget (SEARCH_BUDGET_S as it is now), and where."""
    return Diagnostic(
        "N006", f"the layout search stopped at its time budget of {SEARCH_BUDGET_S:.0f} s, after {where}: the "
        "best plan found so far is compiled", _search_span(bound),
        ("`pardsl explain` shows the plan and its runner-ups",), severity="note")


def layouts_of(typed: TypedGraph) -> tuple:
    """Everything of a plan that lowering reads."""
    return (tuple(typed.nodes.values()), tuple(typed.placeholder_layouts.items()), tuple(typed.output_layouts))


def descended(plan, axes: list[int], searched, deadline: float = math.inf, out_of_time=lambda: None,
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
                if search_clock() >= deadline:  # the moves found so far are weighed, and no more are tried
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
