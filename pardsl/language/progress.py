"""What a long compile is doing, told to whoever listens: the CLI shows it on a terminal (a rich status
line on stderr), since a searched plan can take minutes (T5 on dp 2 × tp 2 under a bound: five integer
programs run to their time limit). Stages report through `report`; nothing listens by default, so the
library prints nothing."""

from __future__ import annotations

import _weakrefset
import contextlib
import os
import signal
import sys
import time
import weakref
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


# the larger pieces of work the stages told are part of ("mesh shape 2 of 4"), outermost first
_within: list[str] = []


@contextlib.contextmanager
def working_on(piece: str):
    """Within the block, every message told is said as part of `piece`: `mesh shape 2 of 4 (dp = 2, tp
    = 4): searching the layouts`."""
    _within.append(piece)
    report(piece)
    try:
        yield
    finally:
        _within.pop()


def tell(message: str) -> None:
    """Tell the listeners, and nothing else: from any thread (a watchdog's), where no time limit is kept."""
    if _within and message != _within[-1]:
        message = ": ".join([*_within, message])
    for listener in list(_listeners):
        listener(message)


def report(message: str) -> None:
    """Tell the listeners; past a time limit (`time_limit`), raise OutOfTime here, a place it may be raised."""
    tell(message)
    if past_time_limit():
        raise OutOfTime(message)


def past_time_limit() -> bool:
    """Whether a time limit in force (`time_limit`) has passed."""
    return bool(_deadlines) and time.monotonic() >= min(_deadlines)


# what each compile stage is doing, in words, for a terminal's status line
STAGE_WORDS = {"infer": "completing the layouts",
               "search": "searching the layouts", "greedy": "completing the layouts greedily, to compare",
               "lower": "lowering to collectives", "recompute": "choosing the layers to recompute",
               "activations": "counting the activations the passes keep",
               "recipes": "writing the known plans (Megatron, FSDP) for the model, to compare",
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


# the deadlines (time.monotonic's) of the time limits in force, for report() to raise at
_deadlines: list[float] = []
# The alarm raises OutOfTime in whatever Python code it interrupts, but not in torch's: there it may be a
# callback from C++ that cannot pass an exception on (a destructor), and an interrupted `check` in a
# long-lived process ended it: "terminate called after throwing an instance of 'python_error'",
# SIGABRT, under torch.export's proxy_call. Nor in a finalizer or a weakref callback, which swallows it
# ("Exception ignored in"), the limit with it. Where it may not, it tries again this much later, and
# report() raises it at the next stage or, while torch.export traces, at the next module call.
_RETRY_S = 0.01
_TORCH = os.path.dirname(torch.__file__) + os.sep
_FINALIZERS = {weakref.__file__, _weakrefset.__file__}


def _interruptible(frame) -> bool:
    """Whether OutOfTime may be raised in `frame`: no frame in its calls is torch's, and it is no
    finalizer."""
    if frame is not None and (frame.f_code.co_name == "__del__" or frame.f_code.co_filename in _FINALIZERS):
        return False
    while frame is not None:
        if frame.f_code.co_filename.startswith(_TORCH):
            return False
        frame = frame.f_back
    return True


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Within the block (in the main thread), OutOfTime once `seconds` have passed, naming the last stage
    reported: raised by the alarm where it may be (`_interruptible`), else a moment later or at the next
    report(); no limit where `seconds` is None. An alarm already set (a test runner's timeout) still goes
    off when it would have, and is set again after the block."""
    if seconds is None:
        yield
        return
    last = ["parsing"]
    ours = time.monotonic() + seconds
    finished = [False]
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: expired(signum, frame))
    outer_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    outer = time.monotonic() + outer_delay if outer_delay > 0 else None
    if outer is not None and outer < ours:
        signal.setitimer(signal.ITIMER_REAL, outer_delay)

    def expired(signum, frame):
        if finished[0]:  # an alarm that went off as the block ended
            return
        if time.monotonic() >= ours - 1e-3:
            if _interruptible(frame):
                raise OutOfTime(last[0])
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
            return
        signal.setitimer(signal.ITIMER_REAL, max(ours - time.monotonic(), 1e-3))
        if callable(previous):  # the outer alarm's own time
            previous(signum, frame)

    previous_hook = sys.unraisablehook

    def unraisable(info):
        if isinstance(info.exc_value, OutOfTime):  # swallowed all the same (a finalizer of the user's): again
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
        else:
            previous_hook(info)

    sys.unraisablehook = unraisable
    _deadlines.append(ours - 1e-3)
    try:
        with reported_to(lambda message: last.__setitem__(0, message)):
            yield
    finally:
        finished[0] = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook = previous_hook
        _deadlines.remove(ours - 1e-3)
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
        if time.monotonic() - reported_at[0] > every_s or past_time_limit():  # report() raises OutOfTime
            reported_at[0] = time.monotonic()
            report(f"{stage}: {calls[0]} module calls traced (the model has {total} modules)")

    handle = torch.nn.modules.module.register_module_forward_pre_hook(counted)
    try:
        yield
    finally:
        handle.remove()
