"""What a long compile is doing, told to whoever listens: the CLI shows it on a terminal (a rich status
line on stderr), since a searched plan can take minutes (T5 on dp 2 × tp 2 under a bound: five integer
programs run to their time limit). Stages report through `report`; nothing listens by default, so the
library prints nothing."""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Callable

import torch

_listeners: list[Callable[[str], None]] = []


@contextlib.contextmanager
def reported_to(listener: Callable[[str], None]):
    """Within the block, every `report(message)` calls `listener(message)`."""
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


def report(message: str) -> None:
    for listener in list(_listeners):
        listener(message)


# what each compile stage is doing, in words, for a terminal's status line
STAGE_WORDS = {"infer": "completing the layouts",
               "search": "searching the layouts", "greedy": "completing the layouts greedily, to compare",
               "lower": "lowering to collectives", "recompute": "choosing the layers to recompute",
               "codegen": "writing the module"}


def timed(seconds: dict[str, float], stage: str, work: Callable):
    """`work()`, reported as the stage in words, its time added to `seconds[stage]`."""
    report(STAGE_WORDS.get(stage, stage))
    start = time.perf_counter()
    result = work()
    seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - start
    return result


class OutOfTime(BaseException):
    """A compile's time limit passed (`time_limit`): the stage it was in. A BaseException, so that no
    handler of the user's model's own errors takes it for one of theirs."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Within the block (in the main thread), OutOfTime once `seconds` have passed, naming the last stage
    reported; no limit where `seconds` is None. An alarm already set (a test runner's timeout) still goes
    off when it would have, and is set again after the block."""
    if seconds is None:
        yield
        return
    last = ["parsing"]
    ours = time.monotonic() + seconds
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: expired(signum, frame))
    outer_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    outer = time.monotonic() + outer_delay if outer_delay > 0 else None
    if outer is not None and outer < ours:
        signal.setitimer(signal.ITIMER_REAL, outer_delay)

    def expired(signum, frame):
        if time.monotonic() >= ours - 1e-3:
            raise OutOfTime(last[0])
        signal.setitimer(signal.ITIMER_REAL, max(ours - time.monotonic(), 1e-3))
        if callable(previous):  # the outer alarm's own time
            previous(signum, frame)

    try:
        with reported_to(lambda message: last.__setitem__(0, message)):
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer is not None:
            signal.setitimer(signal.ITIMER_REAL, max(outer - time.monotonic(), 1e-3))


@contextlib.contextmanager
def modules_reported(stage: str, model: torch.nn.Module, every_s: float = 0.5):
    """While tracing `model`: how many of its modules' forwards have run, reported every `every_s` (a
    deep model takes minutes to trace)."""
    total = sum(1 for _ in model.modules())
    calls, reported_at = [0], [time.monotonic()]
    report(f"{stage}: 0 module calls traced (the model has {total} modules)")  # a stop before the first call says so

    def counted(module, args):
        calls[0] += 1
        if time.monotonic() - reported_at[0] > every_s:
            reported_at[0] = time.monotonic()
            report(f"{stage}: {calls[0]} module calls traced (the model has {total} modules)")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(counted)
    try:
        yield
    finally:
        handle.remove()
