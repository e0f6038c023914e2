"""The layout search's solver: an integer program built column by column and row by row, solved by HiGHS.

Nothing here knows layouts: the search (search.py) writes its choices, their seconds and the memory bound
as columns and rows, and reads the columns back. What the wrapper adds to HiGHS is what a compile needs
of it: limits that give a plan in bounded time, answers kept for a program asked again, a start from a
known plan, a log that lets other processes replay one compile's answers, and the plan nearest a row no
plan meets.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pardsl.planning import work

# A program still proving its optimum after this long gives the best plan found by then: most programs
# prove theirs in a few seconds, and one that has not in 10 s closes the last of its gap slowly. On T5
# dp 2 × tp 2 under 30 % five programs reached a minute's limit (385 s of compile), at 20 s the same plan
# (160 s); at 10 s, T5 at 40 % compiles in 110 s (136 at 20 s) to a plan estimated the same, at 30 % in
# 86 s (153) to one 3 % faster, and Mixtral ep 2 × tp 2 at 40 % in 26 s (56) to one 1.8 % slower. Every
# other example, searched as written or under a bound, compiles to the same module.
TIME_LIMIT_S = 10.0
# Branch and bound stops within 0.1 % of the optimum (HiGHS's default: 0.01 %). Proving the last 0.1 %
# took most of the solve: the first pair program of a 32-layer LLaMA on dp 2 × tp 4 solved in 2.7 s,
# 0.5 s with this gap, and the plan it led to is estimated 0.02 % slower.
MIP_GAP = 1e-3
# A memory bound no plan meets is slow to prove unmeetable (a minute for GPT-2 on dp 2 × tp 2 at 30 %):
# where branch and bound has found no plan within the bound by then, it is taken as unmet
FIRST_PLAN_S = 5.0
# Where no plan better by STALL_GAIN has come for STALL_S, branch and bound stops with the best it has. The
# programs that ran to TIME_LIMIT_S found a plan within a few per cent in their first seconds and spent the
# rest raising a weak bound: the 32-layer LLaMA's pair move (dp 2 x tp 4, 25 %) had a plan at 1.9 s, one
# 0.8 % better at 4.1 s and its optimum, 1.4 % better, at 23 s; its tp-first order a plan at 1.5 s that
# the next 9.5 s bettered by 0.05 %. The cost model rates what the programs find again.
STALL_S = 2.0
STALL_GAIN = 0.01
# The limits above are seconds of work (work.py: branch and bound's calls back, at the reference machine's
# rate), not of a clock: on a loaded or slower machine clock limits stopped branch and bound earlier, at
# another plan, so the same file compiled to different modules. HiGHS's own wall-clock limit stays, this
# many times longer, for a solve that works long between calls on a machine far slower than the reference.
WALL_LIMIT_FACTOR = 10.0

# Answers of the programs solved last, by everything they depend on: on a mesh whose axes are alike (dp 2 ×
# tp 2 with nothing written) both orders' first programs are the same one, and on T5 it runs to its limit
ANSWERS_KEPT = 32
_ANSWERS: dict[str, tuple[str, list[float], float]] = {}  # (status, values, seconds of work it took)

@dataclass
class IntegerProgram:
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
        """The program's solution, from HiGHS, or the next one of a log being replayed (SolutionLog). The
        work it took is charged to the search's clock (work.py), however the answer came: solved, kept from
        an earlier ask or replayed, so that every rank's search stops where rank 0's did."""
        work.charge(work.writing(len(self.cost) + sum(len(terms) for terms, _, _ in self.rows)))
        log = SolutionLog.active
        if log is not None and log.replaying:
            status, values, seconds = log.next(self, skip_rows)
        else:
            key = self._key(skip_rows, hint)
            answer = _ANSWERS.pop(key, None) or self._solve(skip_rows, hint)
            _ANSWERS[key] = answer
            status, values, seconds = answer[0], list(answer[1]), answer[2]  # the caller's own copy
            while len(_ANSWERS) > ANSWERS_KEPT:
                del _ANSWERS[next(iter(_ANSWERS))]  # the least recently asked
            if log is not None:
                log.record(self, skip_rows, (status, values, seconds))
        work.charge(seconds)
        return status, values

    def _key(self, skip_rows: frozenset[int], hint: dict[int, float] | None) -> str:
        """Everything an answer depends on: the program, its hint and the solver's limits."""
        rows = [r for i, r in enumerate(self.rows) if i not in skip_rows]
        limits = (MIP_GAP, TIME_LIMIT_S, FIRST_PLAN_S, STALL_S, STALL_GAIN, WALL_LIMIT_FACTOR)
        text = repr((self.cost, self.integer, rows, sorted((hint or {}).items()), limits, self.cutoff))
        return hashlib.sha256(text.encode()).hexdigest()

    def _solve(self, skip_rows: frozenset[int], hint: dict[int, float] | None) -> tuple[str, list[float], float]:
        """`hint`: values of integer columns, a plan known to be among the program's choices. Where it sets
        every integer column and the plan is feasible, it is completed into a whole solution (an LP over the
        continuous columns) that branch and bound starts from (an incumbent prunes from the first node), and
        the program's answer is never worse than it: HiGHS 1.16, given the integer columns alone, did not
        keep that plan as its incumbent on the 2-D layer's pair move and stopped within the gap at a plan
        0.08 % worse. A partial hint (the start plan has a placement the program does not offer) is
        passed as it is, for HiGHS to complete. Returns the status, the columns' values and the seconds of
        work the solve took (work.solving)."""
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
        start, iterations = self._completed_counting(rows, hint) if hint else (None, 0)
        if start is not None:
            highs.setSolution(columns, np.arange(columns, dtype=np.int32), np.array(start, dtype=float))
        elif hint:
            indices = sorted(hint)
            highs.setSolution(len(indices), np.array(indices, dtype=np.int32),
                              np.array([hint[i] for i in indices], dtype=float))
        highs.setOptionValue("time_limit", TIME_LIMIT_S * WALL_LIMIT_FACTOR)
        rule = _StoppingRule(sum(len(terms) for terms, _, _ in rows), self.cutoff)
        highs.cbMipInterrupt.subscribe(rule)
        highs.run()
        seconds = work.solving(iterations + highs.getInfo().simplex_iteration_count, rule.calls, rule.nonzeros)
        status = highs.getModelStatus()
        if status in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt) and \
                (highs.getInfo().primal_solution_status != 2 or
                 highs.getInfo().objective_function_value >= self.cutoff):  # no plan within the bounds found
            return "infeasible", [], seconds
        status = highspy.HighsModelStatus.kTimeLimit if status == highspy.HighsModelStatus.kInterrupt else status
        if status == highspy.HighsModelStatus.kInfeasible:
            return "infeasible", [], seconds
        solution = list(highs.getSolution().col_value)
        if len(solution) != columns or status not in (highspy.HighsModelStatus.kOptimal,
                                                       highspy.HighsModelStatus.kTimeLimit):
            return str(status), [], seconds
        if start is not None and self.objective(start) < self.objective(solution):
            solution = start
        return "optimal" if status == highspy.HighsModelStatus.kOptimal else "time limit", solution, seconds

    def objective(self, values: list[float]) -> float:
        return float(np.dot(self.cost, values))

    def _completed(self, rows, hint: dict[int, float]) -> list[float] | None:
        """The hint's plan as a whole solution: its integer columns fixed, the continuous ones at their
        least cost; None where the hint leaves an integer column unset or the plan is infeasible (over
        the memory bound)."""
        return self._completed_counting(rows, hint)[0]

    def _completed_counting(self, rows, hint: dict[int, float]) -> tuple[list[float] | None, int]:
        """`_completed`'s answer, and the simplex iterations it took."""
        import highspy

        if not all(column in hint for column, is_integer in enumerate(self.integer) if is_integer):
            return None, 0
        highs = _quiet_highs()
        highs.setOptionValue("output_flag", False)
        highs.passModel(self._lp(rows, fixed=hint))
        highs.run()
        iterations = highs.getInfo().simplex_iteration_count
        if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None, iterations
        values = list(highs.getSolution().col_value)
        for column, value in hint.items():
            values[column] = value  # exact, where the LP's values carry its tolerances
        return values, iterations

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


class _StoppingRule:
    """HiGHS's interrupt callback for one solve: branch and bound stops at TIME_LIMIT_S, at FIRST_PLAN_S
    where it has found no plan yet, and where it has, once STALL_S pass without a plan better by STALL_GAIN.
    Each is counted in seconds of work (work.branching): HiGHS reports no simplex iterations while it runs,
    but calls this back between its steps of work, at the same points on every machine, so where it stops
    depends on the program alone. Both in one tree: stopping at FIRST_PLAN_S and starting again from the
    plan, as this did before, threw away the tree and its cuts. Under a `cutoff` (IntegerProgram.cutoff),
    HiGHS reports the cutoff as its primal bound until a plan beats it: no plan yet."""

    def __init__(self, nonzeros: int, cutoff: float = math.inf):
        self.nonzeros, self.cutoff = nonzeros, cutoff  # the program's
        self.calls = 0
        self.best, self.since = math.inf, 0.0

    def __call__(self, event) -> None:
        self.calls += 1
        elapsed, found = work.branching(self.calls, self.nonzeros), event.data_out.mip_primal_bound
        if elapsed > TIME_LIMIT_S:
            event.interrupt()
        elif not math.isfinite(found) or found >= self.cutoff:
            if elapsed > FIRST_PLAN_S:
                event.interrupt()
        elif not math.isfinite(self.best) or found < self.best - abs(self.best) * STALL_GAIN:
            self.best, self.since = found, elapsed
        elif elapsed - self.since > STALL_S:
            event.interrupt()


class SolutionLog:
    """The integer programs' answers in the order a compile asked for them, to give other processes the
    same plan. A program that hits its time limit returns the best plan found by then, so ranks of
    different speed compiling the same file could choose different plans; replaying one rank's log, the
    others skip HiGHS and build the same programs with the same answers (compile is deterministic given
    them). Each entry keeps the program's size, so a rank whose file or model differs is told so, and the
    work its solve took, which the replaying search charges as rank 0's did (work.py)."""

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
    def _shape(program: IntegerProgram, skip_rows: frozenset[int]) -> tuple[int, int]:
        return len(program.cost), len(program.rows) - len(skip_rows)

    def record(self, program: IntegerProgram, skip_rows: frozenset[int], answer: tuple[str, list[float], float]) -> None:
        self.entries.append((self._shape(program, skip_rows), answer))

    def next(self, program: IntegerProgram, skip_rows: frozenset[int]) -> tuple[str, list[float], float]:
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


def nearest_the_bound(program: IntegerProgram, memory_row: int, hint) -> tuple[str, list[float]]:
    """Where no plan meets the memory bound: of the plans that exceed it least, the fastest. Two programs:
    the least excess (the bound's row with an excess column, the only cost), then the fastest plan within
    that excess. Dropping the bound instead gave the fastest plan at any memory: on LLaMA under dp 2 ×
    tp 2 at 30 %, every parameter replicated (1.95 MB a rank against a bound of 0.73)."""
    terms, lower, upper = program.rows[memory_row]
    scale = sum(v for v in terms.values() if v > 0) + 1.0  # the excess as a share of all there is to hold
    least = IntegerProgram([0.0] * len(program.cost), list(program.integer), list(program.rows))
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
