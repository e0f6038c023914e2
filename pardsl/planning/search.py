"""Stage 3, searched: the layouts the user did not write, chosen by an integer program solved with HiGHS.

The search runs where the file asks for it: it has a `memory <=` bound, a layout written `?`, or no layout
at all. Elsewhere inference's greedy pass (inference.infer) completes the written plan, as before.

As in inference, the mesh's axes are decided one after another (nd-SBP as the product of one-axis
signatures), in the order given (compile runs every order and keeps the plan the cost model rates
fastest, the greedy completion included: compiler._searched_or_greedy); on each, one integer program
(Alpa's formulation) chooses everything at once. A group of axes may be decided together by one
program: an op's choices are then the combinations of its one-axis signatures whose layouts fit, a
value's placement is one per axis of the group, and a conversion is priced as lowering plans it over
all of them (layouts.plan_conversion). Compile's descent decides pairs of axes so, from a plan, each op
keeping its signature on at least one of the two. The program:

- a binary per op and legal signature, exactly one taken (a dim some op downstream cuts into m equal
  parts is also offered split in m blocks: blocks_wanted); and per free tensor (a parameter or buffer the
  file leaves out, an input written `?`) per placement a consumer can use, exactly one taken. A written
  layout always stands;
- converting a value from its placement to what a consumer's signature needs costs the catalogue's
  collectives (layouts.CONVERSIONS), once per value and target placement. Each pair of choices (the
  value's placement, the consumer's requirement) is a continuous variable per pair whose sums over each
  side equal that side's choice: a tight linearisation of their product, which HiGHS solves in well
  under a second where the textbook `z >= x + y - 1` ran to its time limit;
- the all-reduce of a broadcast value's gradient where sharded computation reads it (a gathered value's
  gradient is reduce-scattered instead), once per value;
- each op's compute at the share its signature leaves a rank (FLOP from torch's counter, or bytes moved),
  backward twice forward; a parallel form's own collectives; finishing a partial output;
- a parameter's gradient is reduced in buckets behind backward, and on an axis that splits the batch its
  gather is prefetched behind forward and again behind backward (resharded after forward, as memory is
  counted: two groups whole at a time): priced at the share the machine does not overlap (a bucket's
  latency is shared by many parameters: its bytes only). The latencies of the buckets a plan fills are
  weighed after the program is solved (_fewer_buckets): a plan that reduces no parameter's gradient on
  an axis (Megatron's, whose replicated weights see whole activations) saves them.

Costs are seconds of the cost model (pardsl/planning/cost.py: α per ring step + β per byte, per kind; the
machine's throughput and bandwidth), so the objective is the estimated step time of the axis's choices.
The memory bound is a constraint: parameters with their gradients and optimizer state, the activations
autograd keeps for backward (pardsl/model/saved_for_backward.py), and parameters gathered whole while in use,
per rank; an axis before the last gets the bound times what the later axes can still divide.

Repeated layers (model.layers.0, .1, … with the same ops, shapes and layouts) share their binaries, and
values whose consumers are all shared form one class whose conversions are priced once times its size:
the program has one layer's size however deep the model is. Building it costs one layer's work too: an
op's legal signatures, their seconds and its priced runner-ups are computed once per distinct question
(a key of everything the answer reads), which the ops of repeated layers share.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import re
import sys
from dataclasses import dataclass, field

import numpy as np

from pardsl.language.progress import report
from pardsl.layouts.algebra import (
    B,
    Layout,
    P,
    Placement,
    collective_bytes,
    one_group_gather,
    plan_conversion,
    step_collectives,
)
from pardsl.layouts.oprules import is_tensor_list, signatures
from pardsl.model.binding import BoundPlan
from pardsl.planning.cost import (
    DEFAULT_BUCKET_MB,
    FIRST_BUCKET_MB,
    OPTIMIZER_STATES,
    Machine,
    layer_of,
    parameter_unit,
    repeated_layer,
    serial_bytes,
)
from pardsl.planning.inference import Candidate, TypedGraph, one_axis_collectives, prepare, typed_graph

EPSILON_S = 1e-9  # a conversion, or a split of a free tensor, that saves nothing is not made
HELD_S = 1e-15  # a copy held for backward is counted where something holds it, not beyond
# A program still proving its optimum after this long gives the best plan found by then: most programs
# prove theirs in a few seconds, and one that has not in 10 s closes the last of its gap slowly. On T5
# dp 2 × tp 2 under 30 % five programs reached a minute's limit (385 s of compile), at 20 s the same plan
# (160 s); at 10 s, T5 at 40 % compiles in 110 s (136 at 20 s) to a plan estimated the same, at 30 % in
# 86 s (153) to one 3 % faster, and Mixtral ep 2 × tp 2 at 40 % in 26 s (56) to one 1.8 % slower. Every
# other example, searched as written or under a bound, compiles to the same module (benchmarks/README.md).
TIME_LIMIT_S = 10.0
# Branch and bound stops within 0.1 % of the optimum (HiGHS's default: 0.01 %). Proving the last 0.1 %
# took most of the solve: the first pair program of a 32-layer LLaMA on dp 2 × tp 4 solved in 2.7 s,
# 0.5 s with this gap, and the plan it led to is estimated 0.02 % slower.
MIP_GAP = 1e-3
# A memory bound no plan meets is slow to prove unmeetable (a minute for GPT-2 on dp 2 × tp 2 at 30 %):
# where branch and bound has found no plan within the bound by then, it is taken as unmet
FIRST_PLAN_S = 5.0

# Answers of the programs solved last, by everything they depend on: on a mesh whose axes are alike (dp 2 ×
# tp 2 with nothing written) both orders' first programs are the same one, and on T5 it runs to its limit
ANSWERS_KEPT = 32
_ANSWERS: dict[str, tuple[str, list[float]]] = {}

Joint = tuple[Placement, ...]  # a value's placements on the axes decided together, in their order


class NoPlanFound(RuntimeError):
    """An integer program gave no plan: HiGHS found none within its time (FIRST_PLAN_S where the memory
    bound is hard to meet), or none exists."""


class BoundUnmet(NoPlanFound):
    """No plan meets the memory bound, and the search was asked not to look for the plan nearest it."""


def wants_search(bound: BoundPlan) -> bool:
    par = bound.par
    return par.memory_bound is not None or bool(bound.searched) or not par.layouts


def memory_limit(bound: BoundPlan, optimizer: str = "adamw", microbatches: int = 1) -> int | None:
    """The file's bound in bytes per rank (a percentage is of the serial model's bytes, as cost.py counts
    them; for a pipelined file, bound to one micro-batch, the serial model holds `microbatches` times its
    activations)."""
    written = bound.par.memory_bound
    if written is None:
        return None
    parameters = sum(bound.tensors[name].nbytes for name in bound.parameters)
    trained = sum(bound.tensors[name].nbytes for name in bound.trained_parameters)
    # the op results autograd keeps for backward, as LoweredProgram.memory counts activations
    activations = sum(bound.tensors[name].nbytes for name in bound.kept_for_backward) * microbatches
    return written.bytes(serial_bytes(parameters, trained, activations, optimizer))


@dataclass
class _Program:
    """An integer program in HiGHS's terms, built up column by column and row by row."""

    cost: list[float] = field(default_factory=list)  # every column lies in [0, 1]
    integer: list[bool] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)
    # plans whose objective is not below it are of no use to the caller: branch and bound prunes them
    cutoff: float = math.inf

    def column(self, cost: float = 0.0, integer: bool = False) -> int:
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, terms: dict[int, float], lower: float, upper: float) -> None:
        self.rows.append((terms, lower, upper))

    def solve(self, skip_rows: frozenset[int] = frozenset(), hint: dict[int, float] | None = None) -> tuple[str, list[float]]:
        """The program's solution, from HiGHS, or the next one of a log being replayed (SolutionLog)."""
        log = SolutionLog.active
        if log is not None and log.replaying:
            return log.next(self, skip_rows)
        key = self._key(skip_rows, hint)
        answer = _ANSWERS.pop(key, None) or self._solve(skip_rows, hint)
        _ANSWERS[key] = answer
        answer = answer[0], list(answer[1])  # the caller's own copy
        while len(_ANSWERS) > ANSWERS_KEPT:
            del _ANSWERS[next(iter(_ANSWERS))]  # the least recently asked
        if log is not None:
            log.record(self, skip_rows, answer)
        return answer

    def _key(self, skip_rows: frozenset[int], hint: dict[int, float] | None) -> str:
        """Everything an answer depends on: the program, its hint and the solver's limits."""
        rows = [r for i, r in enumerate(self.rows) if i not in skip_rows]
        text = repr((self.cost, self.integer, rows, sorted((hint or {}).items()), MIP_GAP, TIME_LIMIT_S, FIRST_PLAN_S,
                     self.cutoff))
        return hashlib.sha256(text.encode()).hexdigest()

    def _solve(self, skip_rows: frozenset[int], hint: dict[int, float] | None) -> tuple[str, list[float]]:
        """`hint`: values of integer columns, a plan known to be among the program's choices. Where it sets
        every integer column and the plan is feasible, it is completed into a whole solution (an LP over the
        continuous columns) that branch and bound starts from (an incumbent prunes from the first node), and
        the program's answer is never worse than it: HiGHS 1.16, given the integer columns alone, did not
        keep that plan as its incumbent on the 2-D layer's pair move and stopped within the gap at a plan
        0.08 % worse. A partial hint (the start plan has a placement the program does not offer) is
        passed as it is, for HiGHS to complete."""
        import highspy

        highs = _quiet_highs()
        highs.setOptionValue("output_flag", False)
        highs.setOptionValue("random_seed", 0)
        highs.setOptionValue("mip_rel_gap", MIP_GAP)
        if self.cutoff < math.inf:
            highs.setOptionValue("objective_bound", self.cutoff)
        columns = len(self.cost)
        rows = [r for i, r in enumerate(self.rows) if i not in skip_rows]
        highs.passModel(self._lp(rows))
        start = self._completed(rows, hint) if hint else None
        if start is not None:
            highs.setSolution(columns, np.arange(columns, dtype=np.int32), np.array(start, dtype=float))
        elif hint:
            indices = sorted(hint)
            highs.setSolution(len(indices), np.array(indices, dtype=np.int32),
                              np.array([hint[i] for i in indices], dtype=float))
        highs.setOptionValue("time_limit", min(TIME_LIMIT_S, FIRST_PLAN_S))
        highs.run()
        status = highs.getModelStatus()
        if status == highspy.HighsModelStatus.kTimeLimit:
            if highs.getInfo().primal_solution_status != 2:  # no plan within the bound found yet
                return "infeasible", []
            # a plan found: the search goes on from it for the rest of the time
            found = highs.getSolution().col_value
            highs.setOptionValue("time_limit", TIME_LIMIT_S - FIRST_PLAN_S)
            highs.setSolution(columns, np.arange(columns, dtype=np.int32), np.array(found, dtype=float))
            highs.run()
            status = highs.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return "infeasible", []
        solution = list(highs.getSolution().col_value)
        if len(solution) != columns or status not in (highspy.HighsModelStatus.kOptimal,
                                                       highspy.HighsModelStatus.kTimeLimit):
            return str(status), []
        if start is not None and self.objective(start) < self.objective(solution):
            solution = start
        return "optimal" if status == highspy.HighsModelStatus.kOptimal else "time limit", solution

    def objective(self, values: list[float]) -> float:
        return float(np.dot(self.cost, values))

    def _completed(self, rows, hint: dict[int, float]) -> list[float] | None:
        """The hint's plan as a whole solution: its integer columns fixed, the continuous ones at their
        least cost; None where the hint leaves an integer column unset or the plan is infeasible (over
        the memory bound)."""
        import highspy

        if not all(column in hint for column, is_integer in enumerate(self.integer) if is_integer):
            return None
        highs = _quiet_highs()
        highs.setOptionValue("output_flag", False)
        highs.passModel(self._lp(rows, fixed=hint))
        highs.run()
        if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        values = list(highs.getSolution().col_value)
        for column, value in hint.items():
            values[column] = value  # exact, where the LP's values carry its tolerances
        return values

    def _lp(self, rows, fixed: dict[int, float] | None = None):
        """The program in HiGHS's terms; with `fixed`, those columns fixed at their values and every
        column continuous (an LP)."""
        import highspy

        lp = highspy.HighsLp()
        columns = len(self.cost)
        lp.num_col_, lp.num_row_ = columns, len(rows)
        lp.col_cost_ = np.array(self.cost, dtype=float)
        lower, upper = np.zeros(columns), np.ones(columns)
        for column, value in (fixed or {}).items():
            lower[column] = upper[column] = value
        lp.col_lower_, lp.col_upper_ = lower, upper
        lp.row_lower_ = np.array([lower for _, lower, _ in rows], dtype=float)
        lp.row_upper_ = np.array([upper for _, _, upper in rows], dtype=float)
        starts, indices, values = [0], [], []
        for terms, _, _ in rows:
            for column, value in sorted(terms.items()):
                indices.append(column)
                values.append(value)
            starts.append(len(indices))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = columns, len(rows)
        lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(indices, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(values, dtype=float)
        if fixed is None:
            lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                               for i in self.integer]
        return lp


class SolutionLog:
    """The integer programs' answers in the order a compile asked for them, to give other processes the
    same plan. A program that hits its time limit returns the best plan found by then, so ranks of
    different speed compiling the same file could choose different plans; replaying one rank's log, the
    others skip HiGHS and build the same programs with the same answers (compile is deterministic given
    them). Each entry keeps the program's size, so a rank whose file or model differs is told so."""

    active: "SolutionLog | None" = None

    def __init__(self, entries: list | None = None):
        self.replaying = entries is not None
        self.entries = list(entries or [])
        self._next = 0

    def __enter__(self) -> "SolutionLog":
        SolutionLog.active = self
        return self

    def __exit__(self, *exc) -> None:
        SolutionLog.active = None

    @staticmethod
    def _shape(program: _Program, skip_rows: frozenset[int]) -> tuple[int, int]:
        return len(program.cost), len(program.rows) - len(skip_rows)

    def record(self, program: _Program, skip_rows: frozenset[int], answer: tuple[str, list[float]]) -> None:
        self.entries.append((self._shape(program, skip_rows), answer))

    def next(self, program: _Program, skip_rows: frozenset[int]) -> tuple[str, list[float]]:
        shape = self._shape(program, skip_rows)
        if self._next >= len(self.entries) or self.entries[self._next][0] != shape:
            raise LogMismatch(f"integer program {self._next + 1} has {shape[0]} columns and {shape[1]} rows "
                              "here, which the replayed compile did not ask for")
        _, answer = self.entries[self._next]
        self._next += 1
        return answer


class LogMismatch(RuntimeError):
    """A replayed compile asked for a program the recorded one did not: the two compiled different files,
    models or versions."""


_HIGHS_STARTED = False


def _quiet_highs():
    """A HiGHS instance, its banner unprinted. HiGHS 1.16 writes it to the process's stdout (file
    descriptor 1, below Python's sys.stdout) when the first instance is made, whatever `output_flag`
    says; it would land in the middle of `pardsl compile --json`'s output."""
    global _HIGHS_STARTED
    import highspy

    if _HIGHS_STARTED:
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highs = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    _HIGHS_STARTED = True
    return highs


def _nearest_the_bound(program: _Program, memory_row: int, hint) -> tuple[str, list[float]]:
    """Where no plan meets the memory bound: of the plans that exceed it least, the fastest. Two programs:
    the least excess (the bound's row with an excess column, the only cost), then the fastest plan within
    that excess. Dropping the bound instead gave the fastest plan at any memory: on LLaMA under dp 2 ×
    tp 2 at 30 %, every parameter replicated (1.95 MB a rank against a bound of 0.73)."""
    terms, lower, upper = program.rows[memory_row]
    scale = sum(v for v in terms.values() if v > 0) + 1.0  # the excess as a share of all there is to hold
    least = _Program([0.0] * len(program.cost), list(program.integer), list(program.rows))
    least_excess = least.column(1.0)
    least.row({**terms, least_excess: -scale}, lower, upper)
    status, solution = least.solve(frozenset({memory_row}), hint=hint)
    if status not in ("optimal", "time limit"):
        return program.solve(frozenset({memory_row}), hint=hint)
    excess = program.column()
    assert excess == least_excess  # the least-excess plan is a plan of this program, column for column
    program.row({**terms, excess: -scale}, lower, upper)
    program.row({excess: 1.0}, 0.0, solution[least_excess] + 1e-6)
    # branch and bound starts from that plan: without it, HiGHS may find none within FIRST_PLAN_S
    return program.solve(frozenset({memory_row}), hint=dict(enumerate(solution)))


def _bucket_seconds(solution: list[float], latencies: dict) -> float:
    """The latencies of the gradient buckets a plan fills: per axis and kind, lowering's first bucket, then
    one per DEFAULT_BUCKET_MB of the gradients beyond it."""
    first, later = FIRST_BUCKET_MB * (1 << 20), DEFAULT_BUCKET_MB * (1 << 20)
    seconds = 0.0
    for latency, members in latencies.values():
        nbytes = sum(nbytes for column, nbytes in members if solution[column] > 0.5)
        if nbytes:
            seconds += latency * (1 + math.ceil(max(0.0, nbytes - first) / later))
    return seconds


def _fewer_buckets(program: _Program, latencies: dict, status: str, solution: list[float],
                   hint) -> tuple[str, list[float]]:
    """The program's plan, or a plan that reduces no parameter's gradient on an axis where it would save
    those buckets' latencies. The program prices a bucketed gradient at its bytes alone: a latency shared
    by whatever a plan puts in the bucket is a maximum over the gradients, and written as a column of the
    program (any gradient on the axis ≤ the column) it made the three-axis schemes' programs ten times
    slower to solve (benchmarks/README.md). So the plan's latencies are added afterwards, and for each axis
    the plan fills buckets on, the program is solved again without those gradients where its linear
    relaxation (a lower bound, and quick) leaves room for a faster plan, cut off at the plan's seconds."""
    best = program.objective(solution) + _bucket_seconds(solution, latencies)
    filled = sorted({axis for (axis, _), (_, members) in latencies.items()
                     if any(solution[column] > 0.5 for column, _ in members)})
    for axis in filled:
        columns = [column for (on, _), (_, members) in latencies.items() if on == axis for column, _ in members]
        without = _Program(list(program.cost), list(program.integer), list(program.rows))
        for column in columns:
            without.row({column: 1.0}, 0.0, 0.0)
        relaxed = _Program(without.cost, [False] * len(without.cost), without.rows)
        found, values = relaxed.solve()
        if found != "optimal" or relaxed.objective(values) >= best:
            continue
        without.cutoff = best
        found, values = without.solve(hint=hint)
        if found not in ("optimal", "time limit"):
            continue
        seconds = program.objective(values) + _bucket_seconds(values, latencies)
        if seconds < best:
            best, status, solution = seconds, found, values
    return status, solution


def _layer_key(path: str) -> tuple[str, str] | None:
    """`model.layers.3` → ("model.layers.#", "3"): the family of a repeated layer and its index."""
    layer = layer_of(path)
    match = re.fullmatch(r"(.*\.)?(\d+)", layer)
    if not match:
        return None
    return (match.group(1) or "") + "#", layer


def repeated_layers(bound: BoundPlan, names: list[str], fingerprint) -> dict[str, str]:
    """Each name in a repeated layer identical to an earlier one (same ops, shapes, layouts decided and
    written, and links inside the layer) → the name at its place in the first such layer."""
    paths = {name: bound.parameters.get(name) or bound.buffers.get(name) or bound.module_paths.get(name) or ""
             for name in names}
    layers: dict[tuple[str, str], list[str]] = {}
    for name in names:
        key = _layer_key(paths[name])
        if key is not None:
            layers.setdefault(key, []).append(name)
    representative: dict[str, str] = {}
    first: dict[tuple, list[str]] = {}
    for (family, _), members in layers.items():
        position = {name: index for index, name in enumerate(members)}
        prints = tuple(fingerprint(name, position) for name in members)
        earlier = first.setdefault((family, prints), members)
        if earlier is not members:
            representative.update(zip(members, earlier))
    return representative


def _gather_units(bound: BoundPlan, nodes: list[str], operands) -> dict[str, str]:
    """Per parameter, the group lowering gathers it in (lowering.GatherGroup): its repeated layer, or the
    parameters outside the layers used before the first layer, or those used after it."""
    first_use: dict[str, int] = {}
    first_layer = None
    for index, name in enumerate(nodes):
        if first_layer is None and repeated_layer(bound.module_paths.get(name)):
            first_layer = index
        for o in operands[name]:
            first_use.setdefault(o, index)
    units = {}
    for name, path in bound.parameters.items():
        before = first_layer is None or first_use.get(name, 0) < first_layer
        units[name] = parameter_unit(path) or ("outside, before the layers" if before else "outside, after the layers")
    return units


def blocks_wanted(specs, nodes: list[str], operands) -> dict[str, dict[str, set[int]]]:
    """Per op, per letter of its output, block counts worth offering its signatures: where an op
    downstream cuts a dim into m equal parts (a fused QKV projection's split into q, k and v), the dim can
    be split in m blocks all the way from the parameters (Megatron's fused QKV: `S(1, blocks=3)`), each
    rank then holding its share of every part. Inference offers only the blocks its operands already
    carry, which a parameter left to the search never does."""
    wanted: dict[str, dict[str, set[int]]] = {}
    for name in reversed(nodes):  # consumers before producers
        spec = specs[name]
        asks = {letter: set(counts) for letter, counts in wanted.get(name, {}).items()}
        if spec.cut is not None:
            letter, parts = spec.cut
            asks.setdefault(letter, set()).add(parts)
        for o, letters in zip(operands[name], spec.operands):
            if o not in specs:
                continue  # a placeholder: its placements are its consumers' signatures'
            for d, letter in enumerate(letters):
                if letter in asks and d < len(specs[o].output) and specs[o].output[d] is not None:
                    wanted.setdefault(o, {}).setdefault(specs[o].output[d], set()).update(asks[letter])
    return wanted


@dataclass(frozen=True)
class GraphFacts:
    """What the search reads from the bound graph and no move changes: computed once per compile
    (graph_facts) and shared by every program it solves."""

    specs: dict
    graph_nodes: list
    placeholders: list[str]
    operands: dict[str, tuple[str, ...]]
    requires_grad: set[str]
    flops: dict[str, int]
    cut_blocks: dict[str, dict[str, set[int]]]
    gather_unit: dict[str, str]
    consumers: dict[str, list[tuple[str, int]]]
    outputs_of: dict[str, list[int]]

    @property
    def nodes(self) -> list[str]:
        return [node.name for node in self.graph_nodes]


def graph_facts(bound: BoundPlan) -> GraphFacts:
    specs, graph_nodes, placeholders, operands, requires_grad = prepare(bound)
    nodes = [node.name for node in graph_nodes]
    consumers: dict[str, list[tuple[str, int]]] = {name: [] for name in placeholders + nodes}
    for name in nodes:
        for slot, o in enumerate(operands[name]):
            consumers[o].append((name, slot))
    outputs_of: dict[str, list[int]] = {}
    for index, (_, name) in enumerate(bound.outputs):
        if name:
            outputs_of.setdefault(name, []).append(index)
    return GraphFacts(specs, graph_nodes, placeholders, operands, requires_grad, bound.flops,
                      blocks_wanted(specs, nodes, operands), _gather_units(bound, nodes, operands), consumers,
                      outputs_of)


def search(bound: BoundPlan, machine: Machine, limit: int | None = None,
           optimizer: str = "adamw", order: tuple[int | tuple[int, ...], ...] | None = None,
           start: TypedGraph | None = None, facts: GraphFacts | None = None, nearest: bool = True,
           activation_weight: float = 1.0, fewer_buckets: bool = True) -> TypedGraph:
    """`order`: the mesh axes in the order they are decided (default: the mesh's, one at a time); an entry
    that is a tuple of axes is decided jointly, by one program over every combination of their choices
    (Alpa's strategies over a 2-D mesh). With `start`, a plan of the same file, the axes in `order` are
    decided again, each with every other axis as `start` has it: one move of a descent over the mesh's
    axes, which a plan decided one axis at a time cannot make; where an entry has several axes, every op
    keeps its signature in `start` on at least one of them. `facts`: graph_facts(bound), where the caller
    solves several programs. `nearest`: where the bound cannot be met, the plan nearest it (two more
    programs); without it, BoundUnmet, for a caller that has another way to a plan within the bound.
    `activation_weight`: what the bound counts each byte of activations as (a pipeline's rank holds
    several micro-batches' activations of its stage: compiler._compile_pipelined). `fewer_buckets`: a
    program's plan may give way to one without an axis's bucketed gradients (_fewer_buckets); where one
    did, the plan says so (TypedGraph.saved_buckets), and compile rates the plan found without them too."""
    facts = facts or graph_facts(bound)
    specs, graph_nodes, placeholders = facts.specs, facts.graph_nodes, facts.placeholders
    operands, requires_grad, flops = facts.operands, facts.requires_grad, facts.flops
    cut_blocks, gather_unit, consumers, outputs_of = facts.cut_blocks, facts.gather_unit, facts.consumers, facts.outputs_of
    mesh = bound.mesh
    states = OPTIMIZER_STATES[optimizer]
    nodes = facts.nodes
    lists = {node.name for node in graph_nodes if is_tensor_list(node)}

    # per name, what is decided so far, by mesh axis
    value: dict[str, dict[int, Placement]] = {name: {} for name in placeholders + nodes}
    op_out: dict[str, dict[int, Placement]] = {name: {} for name in nodes}
    needs: dict[str, list[dict[int, Placement]]] = {name: [{} for _ in operands[name]] for name in nodes}
    candidates: dict[str, dict[int, list[Candidate]]] = {name: {} for name in nodes}

    if start is not None:
        for name in placeholders + nodes:
            value[name] = dict(enumerate(start.layout_of(name).placements))
        for name, node in start.nodes.items():
            op_out[name] = dict(enumerate(node.op_layout.placements))
            needs[name] = [dict(enumerate(layout.placements)) for layout in node.operand_layouts]
            candidates[name] = dict(enumerate(start.candidates[name]))

    groups = [(g,) if isinstance(g, int) else tuple(g) for g in (range(mesh.ndim) if order is None else order)]

    def pinned(name: str, group: tuple[int, ...]) -> Joint | None:
        pin = bound.pins.get(name)
        return tuple(pin.layout.placements[a] for a in group) if pin is not None else None

    proven = None  # the last group, where its program proved its plan optimal
    saved_buckets = False  # a program's plan gave way to one without an axis's bucketed gradients
    for step, group in enumerate(groups):
        proven = None
        sizes = [mesh.axis_sizes[a] for a in group]
        whole_joint = (B,) * len(group)
        # the axes still undecided (B so far), whose ranks share what this group leaves per rank
        later = 1 if start is not None else math.prod(mesh.axis_sizes[a] for g in groups[step + 1:] for a in g)
        for name in placeholders + nodes:  # from `start`: these axes are decided afresh
            for a in group:
                value[name].pop(a, None)
        for name in nodes:
            for a in group:
                op_out[name].pop(a, None)
                for need in needs[name]:
                    need.pop(a, None)

        def layout(decided: dict[int, Placement], joint: Joint) -> Layout:
            placements = [decided.get(a, B) for a in range(mesh.ndim)]
            for a, placement in zip(group, joint):
                placements[a] = placement
            return Layout(tuple(placements))

        local_sizes: dict[tuple[str, Joint], int] = {}  # the axes outside the group stay as they are meanwhile

        def local_bytes(name: str, joint: Joint) -> int:
            if (name, joint) not in local_sizes:
                info = bound.tensors[name]
                local_sizes[name, joint] = math.prod(layout(value[name], joint).local_shape(info.shape, mesh)) * info.itemsize
            return local_sizes[name, joint]

        fitted: dict[tuple, bool] = {}  # the same question comes back for every combination of a group

        def fits(name: str, joint: Joint, decided: dict[int, Placement] | None = None) -> bool:
            key = (name, joint, id(decided))
            if key not in fitted:
                shape = bound.tensors[name].shape
                fitted[key] = layout(value[name], joint).fits(shape, mesh) and \
                    (decided is None or layout(decided, joint).fits(shape, mesh))
            return fitted[key]

        if math.prod(sizes) == 1:  # nothing moves on a one-rank axis: every layout is the same tensor
            for a in group:
                for name in placeholders + nodes:
                    value[name][a] = pinned(name, (a,))[0] if name in bound.pins else B
                for name in nodes:
                    for slot in range(len(operands[name])):
                        needs[name][slot][a] = B
                    op_out[name][a] = B
                    candidates[name][a] = [Candidate(signatures(specs[name])[0], 0, 0, 0, 0, 0, 0, True)]
            continue

        free = {name for name in placeholders if name not in bound.pins and
                (name not in bound.inputs or name in bound.searched)}
        batch_axes = {a for a in group if any(
            name in free or (pinned(name, (a,)) or (B,))[0].is_split and pinned(name, (a,))[0].dim == 0
            for name in bound.inputs)}
        unhidden = 1.0 - machine.overlap

        # Legal signatures per op, given the axes decided before these: on each axis of the group the
        # rule's own, then every combination of them whose layouts fit
        legal: dict[str, list[tuple]] = {}  # per op: its joint signatures, one one-axis signature per axis
        legal_on: dict[str, list[list]] = {}  # per op, per axis of the group: its legal one-axis signatures
        domain: dict[str, list[Joint]] = {}
        for name in placeholders:
            domain[name] = [pinned(name, group) or whole_joint]
        # Ops of repeated layers ask the same question: answered once per distinct question (everything
        # the answer reads is in the key), so a deep model costs what its distinct ops cost
        answered: dict[int, tuple[list, list, list]] = {}
        question: dict[tuple, int] = {}  # each distinct question a small number, hashed once
        legal_key: dict[str, int] = {}
        for name in nodes:
            key = (
                specs[name], _frozen(cut_blocks.get(name, {})), bound.tensors[name].shape, _items(value[name]),
                _items(op_out[name]), pinned(name, group),
                tuple((o in free, bound.tensors[o].shape, None if o in free else tuple(domain[o]), _items(value[o]),
                       _items(needs[name][slot])) for slot, o in enumerate(operands[name])),
                None if start is None or len(group) == 1 else _signature_on(start.nodes[name], group))
            legal_key[name] = key = question.setdefault(key, len(question))
            if key not in answered:
                answered[key] = _legal(name, group, specs[name], cut_blocks.get(name, {}), operands[name], free,
                                       domain, needs[name], op_out[name], fits,
                                       start.nodes[name] if start is not None and len(group) > 1 else None)
            legal_on[name], legal[name], outputs = answered[key]
            written = pinned(name, group)
            domain[name] = [written] if written is not None else outputs
        for name in free:  # what its consumers can take it as (a partial sum: from B, locally)
            wanted = [whole_joint] + [_operand(signature, slot) for consumer, slot in consumers[name]
                                      for signature in legal[consumer]]
            if start is not None:  # a move may keep it as it is (its consumers may no longer take it so)
                wanted.append(tuple(start.layout_of(name).placements[a] for a in group))
            domain[name] = [p for p in dict.fromkeys(wanted) if P not in p and fits(name, p)]

        def fingerprint(name: str, position: dict[str, int]) -> tuple:
            info = bound.tensors[name]
            links = tuple(("in", position[o]) if o in position else ("out", bound.tensors[o].shape)
                          for o in operands.get(name, ()))
            return (info.shape, str(info.dtype), tuple(domain[name]), _items(value[name]),
                    name in free, name in requires_grad, tuple(legal.get(name, ())), links,
                    tuple(_items(need) for need in needs.get(name, ())), _items(op_out.get(name, {})),
                    name in outputs_of)

        shared = repeated_layers(bound, placeholders + nodes, fingerprint)

        program = _Program()
        choice: dict[str, list[int]] = {}  # per name: a column per signature (ops) or placement (free tensors)
        for name in placeholders + nodes:
            if name in shared:
                continue
            options = len(legal[name]) if name in legal else len(domain[name])
            choice[name] = [program.column(integer=True) for _ in range(options)]
            program.row({column: 1.0 for column in choice[name]}, 1.0, 1.0)

        def columns_of(name: str) -> list[int]:
            return choice[shared.get(name, name)]

        def add_cost(terms: dict[int, float], column: int, seconds: float) -> None:
            terms[column] = terms.get(column, 0.0) + seconds

        objective: dict[int, float] = {}

        def placement_terms(name: str) -> dict[Joint, dict[int, float]]:
            """The value's placement on these axes as sums of choice columns (a constant: one fixed column)."""
            result: dict[Joint, dict[int, float]] = {}
            columns = columns_of(name)
            if name in legal and pinned(name, group) is None:
                for signature, column in zip(legal[name], columns):
                    result.setdefault(_output(signature), {})[column] = 1.0
            elif name in legal:  # written: whatever the op computes, the value is the written layout
                result[domain[name][0]] = {column: 1.0 for column in columns}
            else:
                for placement, column in zip(domain[name], columns):
                    result[placement] = {column: 1.0}
            return result

        def conversion_steps(name: str, source: Joint, target: Joint) -> list:
            """The one-axis steps lowering converts the value in (layouts.plan_conversion)."""
            info = bound.tensors[name]
            return plan_conversion(layout(value[name], source), layout(value[name], target), info.shape,
                                   info.itemsize, mesh, name in requires_grad)

        def regathered(gathered_to: Layout) -> bool:
            """Whether backward gathers a parameter's prefetched group again (reshard.py, as compile applies
            it): without a bound, an FSDP group, one that leaves its parameters whole; under a bound, every
            group, as the program counts gathered memory (two groups at a time), though compile keeps them
            gathered where the plan fits without."""
            return limit is not None or all(p == B for p in gathered_to.placements)

        def conversion_seconds(name: str, source: Joint, target: Joint) -> float:
            """Converting a value: on one axis, the catalogue's step; on several, the steps lowering plans
            (layouts.plan_conversion), a parameter's gathers on an axis that splits the batch prefetched."""
            gradient, parameter = name in requires_grad, name in bound.parameters
            if len(group) == 1:
                seconds = machine.steps_seconds(one_axis_collectives(
                    source[0], target[0], local_bytes(name, source), sizes[0], gradient), sizes[0])
                if parameter and source[0].is_split and target[0] == B and group[0] in batch_axes:
                    # prefetched forward, reduce-scattered in buckets backward, and where compile reshards
                    # the group after forward, gathered again for backward
                    if regathered(layout(value[name], target)):
                        again = one_axis_collectives(source[0], target[0], local_bytes(name, source), sizes[0], False)
                        seconds += machine.steps_seconds(again, sizes[0])
                    seconds *= unhidden
                return seconds + EPSILON_S
            steps = conversion_steps(name, source, target)
            # lowering prefetches a parameter's gather where it is one all-gather (lowering.GatherGroup);
            # gathered over several axes, it is gathered where it is used, and reduce-scattered there
            prefetched = parameter and len(steps) == 1 and steps[0].kind == "all_gather" and steps[0].axis in batch_axes
            seconds = 0.0
            for conversion in steps:
                moved = machine.steps_seconds(step_collectives(conversion, gradient), mesh.axis_sizes[conversion.axis])
                if prefetched:
                    if regathered(conversion.target):
                        moved += machine.steps_seconds(step_collectives(conversion, False),
                                                       mesh.axis_sizes[conversion.axis])
                    moved *= unhidden
                seconds += moved
            return seconds + EPSILON_S

        placements = {name: placement_terms(name) for name in placeholders + nodes}
        memory: dict[int, float] = {}
        fixed_memory = 0.0
        for name in placeholders + nodes:
            if name in bound.parameters:
                factor = 1 + (1 + states) * (name in requires_grad)
            elif name in bound.kept_for_backward:  # held at its own layout, whoever reads it how
                factor = activation_weight
            else:
                continue
            for placement, terms in placements[name].items():
                nbytes = local_bytes(name, placement) * factor
                if len(domain[name]) == 1:
                    fixed_memory += nbytes
                    break
                for column in terms:
                    add_cost(memory, column, nbytes)
            if name in free:
                for placement, terms in placements[name].items():
                    if placement != whole_joint:
                        for column in terms:
                            add_cost(objective, column, EPSILON_S)

        def subtract(row: dict[int, float], terms: dict[int, float]) -> dict[int, float]:
            for column, v in terms.items():
                row[column] = row.get(column, 0.0) - v
            return row

        def edge(source: dict[Joint, dict[int, float]], target: dict[Joint, dict[int, float]]):
            """The pair of placements a value is taken in, as terms per (from, to). Where either side has
            one choice the pair is the other side's; else a continuous variable per pair whose sums over
            each side equal that side's choice (a tight linearisation of their product)."""
            if len(source) == 1:
                (p, _), = source.items()
                return {(p, q): terms for q, terms in target.items()}
            if len(target) == 1:
                (q, _), = target.items()
                return {(p, q): terms for p, terms in source.items()}
            pairs = {(p, q): {program.column(): 1.0} for p in source for q in target}
            for p, terms in source.items():
                program.row(subtract({next(iter(pairs[p, q])): 1.0 for q in target}, terms), 0.0, 0.0)
            for q, terms in target.items():
                program.row(subtract({next(iter(pairs[p, q])): 1.0 for p in source}, terms), 0.0, 0.0)
            return pairs

        # What an op keeps of an operand it reads converted (saved_for_backward.Kept.reads) is a copy held
        # until backward, while some keeping reader takes it so (lowering._copies_held_for_backward); in the
        # choices' own columns, which keeps the program as quick to solve as without it
        kept = bound.kept
        held_copies: dict[tuple, int] = {}  # (class, the copy's layout on other axes, on these) → its column
        copy_rows: set[tuple] = set()

        def held_column(bytes_held: float) -> int:
            column = program.column(HELD_S)  # at its least where nothing needs it held
            add_cost(memory, column, bytes_held * activation_weight)
            return column

        def hold(key, name: str, reader: str, reader_rep: str, slot: int, pairs, members: list[str]) -> None:
            need, own = needs[reader][slot], value[name]
            moved_before = any(need.get(a, B) != own.get(a, B) for a in set(need) | set(own))
            count = len(members)  # each member a value of its own, converted on its own
            parameter = kept.owner.get(name, name) in bound.parameters
            for (p, q), terms in pairs.items():
                if not (moved_before or p != q):
                    continue  # taken as it is: held at its own layout, counted with the values
                if parameter and in_group(name, layout(own, p), layout(need, q)):
                    continue  # gathered in a group, counted a group at a time
                copy = (key, _items(need), q)
                if copy not in held_copies:
                    held_copies[copy] = held_column(count * taken_bytes(name, need, q))
                if parameter:  # whether it is a group's gather depends on the pair
                    program.row(subtract({held_copies[copy]: 1.0}, terms), 0.0, math.inf)
                elif (copy, reader_rep, slot) not in copy_rows:  # taken as q where the value is not q
                    copy_rows.add((copy, reader_rep, slot))
                    row = subtract({held_copies[copy]: 1.0}, slots[reader_rep][slot].get(q, {}))
                    if not moved_before:
                        for column, v in placements[name].get(q, {}).items():
                            row[column] = row.get(column, 0.0) + v
                    program.row(row, 0.0, math.inf)

        converted: dict[tuple, int] = {}  # once per value (class), from and to
        gathered: dict[str, dict[int, float]] = {}  # per gather group: its conversions' columns → bytes whole
        copies: dict[str, int] = {}  # per gather group: how many layers it stands for
        gathered_elsewhere: dict[tuple, int] = {}  # (class, need elsewhere, taken at) → gathered on other axes

        def taken_bytes(name: str, need: dict[int, Placement], joint: Joint) -> int:
            """A rank's bytes of the value as a reader takes it: `need` on the other axes, `joint` on these."""
            info = bound.tensors[name]
            return math.prod(layout(need, joint).local_shape(info.shape, mesh)) * info.itemsize

        def in_group(name: str, source: Layout, target: Layout) -> bool:
            """Whether lowering gathers the parameter in a prefetched group."""
            info = bound.tensors[name]
            return one_group_gather(plan_conversion(source, target, info.shape, info.itemsize, mesh,
                                                    name in requires_grad), mesh)

        def gathered_in_group(name: str, column: int, nbytes: int, count: int) -> None:
            """A parameter's gather in one of lowering's groups (GatherGroup), where `column` is taken: held a
            group at a time."""
            unit = gather_unit[name]
            add_cost(gathered.setdefault(unit, {}), column, nbytes)
            copies[unit] = max(copies.get(unit, 1), count)

        def convert(key, name: str, pairs, count: int, need: dict[int, Placement] | None = None) -> None:
            """`need`: what the reader takes on the other axes, where it is a parameter's reader."""
            own = value[name]
            for (p, q), terms in pairs.items():
                if p == q:
                    if need is not None and need != own and in_group(name, layout(own, p), layout(need, q)):
                        # gathered on an axis this program does not decide, at the bytes the pair leaves a rank
                        taken = (key, _items(need), q)
                        if taken not in gathered_elsewhere:
                            gathered_elsewhere[taken] = program.column()
                            gathered_in_group(name, gathered_elsewhere[taken], taken_bytes(name, need, q), count)
                        program.row(subtract({gathered_elsewhere[taken]: 1.0}, terms), 0.0, math.inf)
                    continue
                if (key, p, q) not in converted:
                    column = program.column(count * conversion_seconds(name, p, q))
                    converted[key, p, q] = column
                    if name in bound.parameters and any(s.is_split and t == B for s, t in zip(p, q)) and \
                            in_group(name, layout(own, p), layout(own, q)):
                        gathered_in_group(name, column, local_bytes(name, q), count)
                program.row(subtract({converted[key, p, q]: 1.0}, terms), 0.0, math.inf)

        def op_seconds(name: str) -> list[list[float]]:
            """Per legal signature, the seconds it adds to its column: the op's compute at the share it leaves
            a rank (backward twice forward), a parallel form's own collectives, converting to what is
            written."""
            share = math.prod(mesh.axis_sizes[a] for a, p in op_out[name].items() if p.kind != "B")
            backward = 3 if name in requires_grad else 1
            written = pinned(name, group)
            result = []
            for signature in legal[name]:
                output = _output(signature)
                split = math.prod(n for n, p in zip(sizes, output) if p != B)
                moved = local_bytes(name, output) + sum(
                    local_bytes(o, _operand(signature, slot)) for slot, o in enumerate(operands[name]))
                terms = [backward * machine.compute_seconds(flops.get(name, 0) / share / split, moved)]
                for i, one in enumerate(signature):
                    for inner in one.inner_collectives:
                        if not inner.made(operands[name][0] in requires_grad):
                            continue
                        first = bound.tensors[operands[name][0]]
                        local = layout(value[operands[name][0]], _operand(signature, 0)).local_shape(first.shape, mesh)
                        terms.append(machine.collective_seconds(
                            inner.kind, inner.volume(local, one.operands[0], first.itemsize, sizes[i]), sizes[i]))
                if written is not None and written != output:
                    terms.append(conversion_seconds(name, output, written))
                result.append(terms)
            return result

        slots: dict[str, list[dict[Joint, dict[int, float]]]] = {}  # per op and operand: its signatures' needs
        computed: dict[str, dict[int, Joint]] = {}  # per op: what each of its columns computes

        def traits(name: str) -> tuple:
            """What an op's seconds and prices read beyond its legal key: gradients and dtypes."""
            return (name in requires_grad, str(bound.tensors[name].dtype),
                    tuple((o in requires_grad, str(bound.tensors[o].dtype)) for o in operands[name]))

        costed: dict[tuple, list[list[float]]] = {}  # as `answered`: once per distinct question
        for name in nodes:
            key = (legal_key[name], flops.get(name, 0), traits(name))
            if key not in costed:
                costed[key] = op_seconds(name)
            for column, terms in zip(columns_of(name), costed[key]):
                for seconds in terms:
                    add_cost(objective, column, seconds)
            if shared.get(name) in slots:  # a repeated layer's op: the same columns, the same needs
                slots[name], computed[name] = slots[shared[name]], computed[shared[name]]
                continue
            by_slot: list[dict[Joint, dict[int, float]]] = [{} for _ in operands[name]]
            computed[name] = {}
            for signature, column in zip(legal[name], columns_of(name)):
                computed[name][column] = _output(signature)
                for slot in range(len(operands[name])):
                    terms = by_slot[slot].setdefault(_operand(signature, slot), {})
                    terms[column] = terms.get(column, 0.0) + 1.0
            slots[name] = by_slot

        # Each value's consumers, through the shared layers: values of repeated layers that are taken by
        # the same (shared) consumers are one class, whose conversions are priced once times its size
        classes: dict[tuple, list[str]] = {}
        for name in placeholders + nodes:
            uses = tuple(sorted({(shared.get(v, v), slot) for v, slot in consumers[name]}))
            ends = tuple((i, tuple(bound.output_pins[i].layout.placements[a] for a in group)
                          if i in bound.output_pins else None) for i in outputs_of.get(name, ()))
            if uses or ends:
                classes.setdefault((shared.get(name, name), uses, ends), []).append(name)
        syncs: dict[tuple, int] = {}  # (class, axis, placements) → its gradient's reduction over the axis
        bucketed: dict[tuple[int, str], list[tuple[int, int]]] = {}  # (axis, kind) → (sync column, bytes)
        for key, members in classes.items():
            name, uses, ends = members[0], key[1], key[2]
            count = len(members)
            for v, slot in uses:
                pairs = edge(placements[name], slots[v][slot])
                reader = next(u for u, at in consumers[name] if shared.get(u, u) == v and at == slot)
                # a list (a split's parts) is converted part by part, as each getitem takes it
                # (inference.typed_graph): each reader pays its own
                once = (key, v, slot) if name in lists else key
                convert(once, name, pairs, count, needs[reader][slot] if name in bound.parameters else None)
                if (reader, name) in kept.reads:
                    hold(key, name, reader, v, slot, pairs, members)
                if name not in requires_grad:
                    continue
                # taken whole on an axis by a signature that computes split, the value's gradient is partial
                # over it: one all-reduce of it serves every such consumer; a gathered one's adjoint
                # reduce-scatters it
                taken_whole = {(target, i): [c for c in columns if computed[v][c][i] == B]
                               for target, columns in slots[v][slot].items() for i in range(len(group))}
                for (source, target), terms in pairs.items():
                    for i, a in enumerate(group):
                        if target[i] != B:
                            continue
                        if (key, i, source, target) not in syncs:
                            kind = "reduce_scatter" if source[i].is_split else "all_reduce"
                            seconds = machine.local_collective_seconds(kind, local_bytes(name, target), sizes[i])
                            syncs[key, i, source, target] = column = program.column()
                            if name in bound.parameters:  # in a bucket: its bytes, behind the rest of backward
                                seconds = unhidden * (seconds - machine.collective_seconds(kind, 0, sizes[i]))
                                bucketed.setdefault((i, kind), []).append((column, count * local_bytes(name, target)))
                            program.cost[column] = count * seconds
                        row = subtract({syncs[key, i, source, target]: 1.0}, terms)
                        for column in taken_whole[target, i]:
                            row[column] = row.get(column, 0.0) + 1.0
                        program.row(row, 0.0, math.inf)
            for _, written in ends:
                if written is not None:
                    convert(key, name, edge(placements[name], {written: {}}), count)
                    continue
                for placement, terms in placements[name].items():
                    for i, p in enumerate(placement):
                        if p == P:  # a partial output is finished
                            seconds = machine.local_collective_seconds("all_reduce", local_bytes(name, placement),
                                                                       sizes[i])
                            for column in terms:
                                add_cost(objective, column, count * seconds)

        if gathered:
            # Gathered parameters are held one group at a time, the next one prefetched (cost.memory_per_rank
            # counts its two largest gather groups). The two largest, in the program: at its least over a
            # level λ, 2λ + Σ each group's excess over λ (times the layers it stands for, at most 2: repeated
            # layers share their columns); columns scaled to [0, 1].
            scale = sum(sum(unit.values()) for unit in gathered.values())
            held = min(2, sum(copies.values()))
            level = program.column(HELD_S * held)  # HELD_S in proportion: at its least, the sum of the two
            add_cost(memory, level, held * scale)
            for unit, terms in gathered.items():
                times = min(held, copies.get(unit, 1))
                over = program.column(HELD_S * times)
                program.row(subtract({over: scale, level: scale}, terms), 0.0, math.inf)
                add_cost(memory, over, times * scale)
        for column, seconds in objective.items():
            program.cost[column] += seconds
        memory_row = None
        if limit is not None:
            memory_row = len(program.rows)
            program.row(memory, -math.inf, limit * later - fixed_memory)
        # a descent's move starts from its plan, one of its choices: branch and bound starts there too
        hint = _hint(start, group, choice, legal, domain) if start is not None else None
        report(f"searching the layouts: deciding {', '.join(mesh.axis_names[a] for a in group)}"
               f"{' again, from a plan' if start is not None else ''}: an integer program of "
               f"{len(program.cost):,} columns and {len(program.rows):,} rows (up to {TIME_LIMIT_S:.0f} s)")
        status, solution = program.solve(hint=hint)
        # `proven` is set below, after the buckets are weighed: the program alone (`fewer_buckets` off) is
        # not what deciding the group again asks, and a plan nearest an unmeetable bound is not proven
        if status == "infeasible" and memory_row is not None:  # the bound cannot be met: N003
            if not nearest:
                raise BoundUnmet()
            status, solution = _nearest_the_bound(program, memory_row, hint)
        elif status in ("optimal", "time limit") and fewer_buckets:
            # where the batch may be split, every parameter's gradient is reduced: no other plan to try
            latencies = {key: (unhidden * machine.collective_seconds(key[1], 0, sizes[key[0]]), members)
                         for key, members in bucketed.items() if group[key[0]] not in batch_axes}
            programs_own = solution
            status, solution = _fewer_buckets(program, latencies, status, solution, hint)
            saved_buckets |= solution is not programs_own
            proven = group if status == "optimal" else None
        if status not in ("optimal", "time limit"):  # at the limit: the best plan found by then
            names = ", ".join(mesh.axis_names[a] for a in group)
            raise NoPlanFound(f"the layout search found no plan on axis {names}: {status}")

        def taken(name: str) -> int:
            columns = columns_of(name)
            return max(range(len(columns)), key=lambda i: solution[columns[i]])

        for name in placeholders:
            chosen = domain[name][taken(name)] if name in free else domain[name][0]
            for i, a in enumerate(group):
                value[name][a] = chosen[i]
        for name in nodes:
            signature = legal[name][taken(name)]
            written = pinned(name, group)
            for i, a in enumerate(group):
                for slot, req in enumerate(signature[i].operands):
                    needs[name][slot][a] = req
                op_out[name][a] = signature[i].output
                value[name][a] = written[i] if written is not None else signature[i].output
        priced: dict[tuple, list[list[Candidate]]] = {}  # as `answered`: once per distinct question
        for name in nodes:
            index = taken(name)
            key = (legal_key[name], index, traits(name), _items(value[name]),
                   tuple(_items(value[o]) for o in operands[name]))
            if key not in priced:
                signature = legal[name][index]
                priced[key] = [_priced(name, a, legal_on[name][i], signature[i], operands[name], value,
                                       requires_grad, bound, mesh, mesh.axis_sizes[a]) for i, a in enumerate(group)]
            for i, a in enumerate(group):
                candidates[name][a] = list(priced[key][i])

    def by_axis(decided: dict[int, object]) -> list:
        return [decided[a] for a in range(mesh.ndim)]

    typed = typed_graph(bound, specs, graph_nodes, placeholders, operands, requires_grad,
                        {name: by_axis(v) for name, v in value.items()},
                        {name: [by_axis(need) for need in v] for name, v in needs.items()},
                        {name: by_axis(v) for name, v in op_out.items()},
                        {name: by_axis(v) for name, v in candidates.items()})
    if proven is not None and len(proven) == 1:
        typed.settled = frozenset(proven)
    typed.saved_buckets = saved_buckets
    return typed


def _items(decided: dict) -> tuple:
    return tuple(sorted(decided.items()))


def _frozen(offered: dict[str, set[int]]) -> tuple:
    return tuple(sorted((letter, tuple(sorted(counts))) for letter, counts in offered.items()))


def _signature_on(node, group: tuple[int, ...]) -> tuple:
    """What a plan's op computes and needs on the group's axes."""
    return tuple((node.op_layout.placements[a], tuple(layout.placements[a] for layout in node.operand_layouts))
                 for a in group)


def _legal(name, group, spec, cut_blocks, operands, free, domain, needs, op_out, fits, start_node):
    """An op's legal signatures on a group of axes, given the axes decided before: on each axis the rule's
    own whose layouts fit, then every combination of them whose layouts fit; with `start_node` (a move of
    the descent over several axes) only those keeping its signature on at least one axis. Returns the
    per-axis lists (index in the rule's order, signature), the joint signatures, and their distinct
    outputs (the op's domain, where its layout is not written)."""
    width = len(group)
    per_axis = []
    for i in range(width):
        offered = {letter: set(counts) for letter, counts in cut_blocks.items()}
        for o, letters in zip(operands, spec.operands):
            if o in free:
                continue
            for joint in domain[o]:
                placement = joint[i]
                if placement.is_split and placement.blocks > 1 and placement.dim < len(letters) and \
                        letters[placement.dim] is not None:
                    offered.setdefault(letters[placement.dim], set()).add(placement.blocks)
        per_axis.append([
            (index, signature) for index, signature in enumerate(signatures(spec, offered))
            if all(fits(o, _on(i, width, B if (req == P and o in free) else req), needs[slot])
                   for slot, (o, req) in enumerate(zip(operands, signature.operands)))
            and fits(name, _on(i, width, signature.output), op_out)])
    kept = [{index for index, one in entries if _same_signature(start_node, a, one)}
            for a, entries in zip(group, per_axis)] if start_node is not None else None
    legal = []
    for combination in itertools.product(*per_axis):
        indices = tuple(index for index, _ in combination)
        if kept is not None and any(kept) and not any(i in k for i, k in zip(indices, kept)):
            continue
        joint_signature = tuple(signature for _, signature in combination)
        if width == 1 or (
                all(fits(o, tuple(B if (s.operands[slot] == P and o in free) else s.operands[slot]
                                  for s in joint_signature), needs[slot])
                    for slot, o in enumerate(operands))
                and fits(name, _output(joint_signature), op_out)):
            legal.append(joint_signature)
    assert legal, f"no legal signature for {name}"  # all-B always fits
    return per_axis, legal, list(dict.fromkeys(_output(signature) for signature in legal))


def _hint(start: TypedGraph, group: tuple[int, ...], choice: dict[str, list[int]], legal, domain) -> dict[int, float]:
    """The choice columns of the plan `start` on the group's axes: per op the signature it computes there,
    per free tensor its placement (left out where the program does not offer it)."""
    hint = {}
    for name, columns in choice.items():
        if name in legal:
            taken = [j for j, signature in enumerate(legal[name])
                     if all(_same_signature(start.nodes[name], a, one) for a, one in zip(group, signature))]
        else:
            before = tuple(start.layout_of(name).placements[a] for a in group)
            taken = [j for j, joint in enumerate(domain[name]) if joint == before]
        if taken:
            hint.update({column: float(j == taken[0]) for j, column in enumerate(columns)})
    return hint


def _same_signature(node, axis: int, signature) -> bool:
    """Whether a one-axis signature is what the op computes on `axis` in `node` (a plan's)."""
    return signature.output == node.op_layout.placements[axis] and \
        all(req == layout.placements[axis] for req, layout in zip(signature.operands, node.operand_layouts))


def _on(i: int, width: int, placement: Placement) -> Joint:
    """A joint placement: `placement` on the group's i-th axis, B on its others."""
    return (B,) * i + (placement,) + (B,) * (width - i - 1)


def _output(signature: tuple) -> Joint:
    return tuple(one.output for one in signature)


def _operand(signature: tuple, slot: int) -> Joint:
    return tuple(one.operands[slot] for one in signature)


def _priced(name, axis, legal, chosen, operands, value, requires_grad, bound, mesh, n) -> list[Candidate]:
    """Each legal signature priced in bytes against the placements chosen around it: what `explain`
    shows as runner-ups."""
    def local_bytes(tensor: str, placement: Placement) -> int:
        info = bound.tensors[tensor]
        placements = tuple(placement if a == axis else value[tensor].get(a, B) for a in range(mesh.ndim))
        return math.prod(Layout(placements).local_shape(info.shape, mesh)) * info.itemsize

    priced = []
    for index, signature in legal:
        forward = backward = changes = 0
        for o, req in zip(operands, signature.operands):
            source = value[o][axis]
            for phase, _, nbytes in one_axis_collectives(source, req, local_bytes(o, source), n, o in requires_grad):
                forward += nbytes if phase == "forward" else 0
                backward += nbytes if phase == "backward" else 0
            changes += source != req
            if req == B and source == B and signature.output != B and o in requires_grad:
                backward += collective_bytes("all_reduce", local_bytes(o, B), n)
        priced.append(Candidate(signature, forward, backward, 0, changes, local_bytes(name, signature.output),
                                index, signature == chosen))
    return priced
