"""SIGINT and SIGTERM for long-running commands: the first stops gracefully; a second one,
sent at least ``REPEAT_AFTER`` seconds later, exits at once.

The worker, ``dev-server`` and ``demo`` all use it: a worker stops claiming and releases
its runs, the server and the demo clean up; a second signal (an impatient Ctrl-C) ends
the process on the spot.

One request to stop often arrives as several signals within milliseconds
(``taskrunner.engine.interrupts``): signals within ``REPEAT_AFTER`` of the first are that same
request; only a later one is a person asking again (taking any second signal as "stop
now" would kill a worker started by ``uv run`` before it gives its claims back).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from taskrunner.cli.render import stderr
from taskrunner.engine.interrupts import REPEAT_AFTER

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Signalled(Exception):
    """The command was stopped by a signal (and cleaned up)."""

    def __init__(self, signum: signal.Signals) -> None:
        super().__init__(f"stopped by {signum.name}")
        self.signum = signum


class _Requests:
    """Counts stop requests: the first signal, then any signal ``REPEAT_AFTER`` later."""

    def __init__(self, stop: Callable[[signal.Signals], object], at_once: str) -> None:
        self.stop, self.at_once = stop, at_once
        self.first: float | None = None

    def received(self, signum: signal.Signals) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.stop(signum)
        elif now - self.first >= REPEAT_AFTER:
            self.exit_at_once()
        # else: the same request delivered twice (group signal and a forward)

    def exit_at_once(self) -> None:
        stderr().print(f"second signal: {self.at_once}", markup=False)
        os._exit(1)


@contextmanager
def stop_signals(stop: Callable[[signal.Signals], object], *, at_once: str) -> Iterator[None]:
    """While inside, the first SIGINT/SIGTERM calls ``stop``; another one ``REPEAT_AFTER``
    seconds later or more prints ``at_once`` and exits 1 (earlier ones are the same request).

    Once a signal was received, leaving keeps a process-level handler with the same rule,
    so a duplicate arriving while the command finishes does not kill it (SIGTERM's
    default) or raise ``KeyboardInterrupt`` in its cleanup."""
    loop, requests = asyncio.get_running_loop(), _Requests(stop, at_once)
    installed = []
    for signum in STOP_SIGNALS:
        # Outside the main thread (or on Windows) only cancellation can stop the command.
        with suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, requests.received, signum)
            installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)  # restores the default handler: replaced at once
            if requests.first is not None:
                signal.signal(signum, lambda number, _: requests.received(signal.Signals(number)))


async def cancelled_by_signal(coro: Coroutine[Any, Any, T], *, at_once: str) -> T:
    """Run ``coro``; the first signal cancels it (its cleanup runs), then raises ``Signalled``."""
    task: asyncio.Task[T] = asyncio.ensure_future(coro)
    received: list[signal.Signals] = []

    def stop(signum: signal.Signals) -> None:
        received.append(signum)
        task.cancel()

    with stop_signals(stop, at_once=at_once):
        try:
            return await task
        except asyncio.CancelledError:
            if received:
                raise Signalled(received[0]) from None
            raise
