"""The layout search's clock: work done, not seconds elapsed.

The search is held to budgets (descent.SEARCH_BUDGET_S for a file, solver.TIME_LIMIT_S and its stall rule
for one integer program). Counted in seconds, of the wall or of the compiling thread's CPU, they stopped
the search at another plan on a slower or busier machine: the same file compiled to different modules on
a laptop, in CI beside another test worker, and on two runs of one shared VM. And a rank replaying rank
0's answers (solver.SolutionLog), which skips HiGHS and so runs faster, went on past where rank 0 stopped
and asked for programs rank 0 never solved.

So the search counts what it does, each thing at the seconds it takes on a reference machine (2 cores of
a 2026 cloud VM, where the budgets were set): the simplex iterations of the programs it solves, the
entries of the programs it writes, and the statements of the plans it lowers and rates. What these count
depends only on the file, the model and the versions of torch, HiGHS and pardsl, so the same file
compiles to the same plan on every machine and under any load. A machine twice as fast spends half the
seconds on the same budget.

The count is per thread, like the CPU clock it replaces: a compile runs on one thread.
"""

from __future__ import annotations

import threading

# Fitted on the reference machine to 39 solves of a LLaMA's search on dp 2 × tp 4 (2, 8 and 32 layers;
# 6,000 to 21,000 columns; 0.1 to 20 s each; their sum within 3 %): a solve takes 127 µs per simplex
# iteration and 1.8 µs per non-zero of its program each time branch and bound calls back. While it runs,
# HiGHS reports no iterations: its limits count its call-backs alone, 4.2 µs per non-zero each (within a
# factor of two of the CPU seconds on those solves). Writing a program took about 5 µs per
# entry; lowering a plan and rating it, about 90 µs per statement of the lowered program.
SECONDS_PER_SIMPLEX_ITERATION = 127e-6
SECONDS_PER_NONZERO_CALLED_BACK = 1.8e-6
SECONDS_PER_NONZERO_CALLED_BACK_ALONE = 4.2e-6
SECONDS_PER_ENTRY_WRITTEN = 5e-6
SECONDS_PER_STATEMENT_LOWERED = 90e-6

_counted = threading.local()


def spent() -> float:
    """The work this thread's searches have done, in the reference machine's seconds."""
    return getattr(_counted, "seconds", 0.0)


def charge(seconds: float) -> None:
    _counted.seconds = spent() + seconds


def solving(simplex_iterations: int, callbacks: int, nonzeros: int) -> float:
    """What a solve took on the reference machine, in seconds: its simplex iterations, and branch and
    bound's call-backs on a program of `nonzeros` non-zeros."""
    return max(0, simplex_iterations) * SECONDS_PER_SIMPLEX_ITERATION + \
        callbacks * nonzeros * SECONDS_PER_NONZERO_CALLED_BACK


def branching(callbacks: int, nonzeros: int) -> float:
    """What branch and bound has done by its `callbacks`-th call back on a program of `nonzeros`
    non-zeros, in seconds: the solver's limits count this."""
    return callbacks * nonzeros * SECONDS_PER_NONZERO_CALLED_BACK_ALONE


def writing(entries: int) -> float:
    """What writing an integer program of `entries` columns and non-zeros takes, in seconds."""
    return entries * SECONDS_PER_ENTRY_WRITTEN


def lowering(statements: int) -> float:
    """What lowering a plan to `statements` statements and rating it takes, in seconds."""
    return statements * SECONDS_PER_STATEMENT_LOWERED
