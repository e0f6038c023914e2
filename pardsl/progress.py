"""What a long compile is doing, told to whoever listens: the CLI shows it on a terminal (a rich status
line on stderr), since a searched plan can take minutes (T5 on dp 2 × tp 2 under a bound: five integer
programs run to their time limit). Stages report through `report`; nothing listens by default, so the
library prints nothing."""

from __future__ import annotations

import contextlib
from typing import Callable

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
