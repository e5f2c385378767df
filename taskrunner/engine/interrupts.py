"""One stop request, however many signals deliver it.

A terminal's Ctrl-C reaches the whole foreground process group, ``uv run`` forwards
SIGTERM to its child at once and SIGINT 200 ms later (when not attached to a terminal, or
on a second Ctrl-C), systemd signals every process of the unit. So signals within
``REPEAT_AFTER`` of the first are that same request; only a later one is a person asking
again. The CLI's commands (``taskrunner.cli.signals``) and ``TaskRunner.run_worker``
under ``asyncio.run`` both follow this rule.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

REPEAT_AFTER = 1.0
"""Seconds after the first signal before another one means "exit at once": five times
uv's 200 ms forwarding delay, and less than a person takes to see that the first did not
stop the process yet and press Ctrl-C again."""


class _OnceWithin:
    """A SIGINT handler passing the first signal, and any ``REPEAT_AFTER`` later, to ``handler``."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.first: float | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        now = time.monotonic()
        if self.first is not None and now - self.first < REPEAT_AFTER:
            return None  # the same request delivered twice (group signal and a forward)
        if self.first is None:
            self.first = now
        return self.handler(signum, frame)


@contextmanager
def sigint_once() -> Iterator[None]:
    """While inside, repeats of a SIGINT within ``REPEAT_AFTER`` are dropped.

    ``asyncio.run`` cancels its main task on the first SIGINT (``run_worker`` then stops
    gracefully and gives its claims back) and raises ``KeyboardInterrupt`` on any other,
    wherever the loop is: inside that cleanup, when ``uv run`` forwards the same Ctrl-C.
    Only the main thread's Python-level handler is wrapped, and only when it is a Python
    callable (asyncio's, or the default raising ``KeyboardInterrupt``); once a signal came,
    the wrapper stays, so a late duplicate cannot interrupt what follows the stop either."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    wrapper = _OnceWithin(previous)
    signal.signal(signal.SIGINT, wrapper)
    try:
        yield
    finally:
        if wrapper.first is None and signal.getsignal(signal.SIGINT) is wrapper:
            signal.signal(signal.SIGINT, previous)
