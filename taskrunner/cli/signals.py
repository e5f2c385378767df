"""SIGINT and SIGTERM for long-running commands: the first stops gracefully, a second exits at once.

The worker, ``dev-server`` and ``demo`` all use it: a worker stops claiming and releases
its runs, the server and the demo clean up; a second signal (an impatient Ctrl-C) ends
the process on the spot.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from taskrunner.cli.render import stderr

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Signalled(Exception):
    """The command was stopped by a signal (and cleaned up)."""

    def __init__(self, signum: signal.Signals) -> None:
        super().__init__(f"stopped by {signum.name}")
        self.signum = signum


@contextmanager
def stop_signals(stop: Callable[[signal.Signals], object], *, at_once: str) -> Iterator[None]:
    """While inside, the first SIGINT/SIGTERM calls ``stop``; a second prints ``at_once`` and exits 1."""
    loop, received = asyncio.get_running_loop(), 0

    def handle(signum: signal.Signals) -> None:
        nonlocal received
        received += 1
        if received == 1:
            stop(signum)
            return
        stderr().print(f"second signal: {at_once}", markup=False)
        os._exit(1)

    installed = []
    for signum in STOP_SIGNALS:
        # Outside the main thread (or on Windows) only cancellation can stop the command.
        with suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, handle, signum)
            installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


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
