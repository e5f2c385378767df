"""A worker's side of workflows: the follow-ups its own runs owe, done at once, and a sweep
that does any task's (a worker killed between an outcome and its follow-up, a publisher
killed before it linked its tasks) every sweep interval."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from taskrunner.engine.outage import Outage
from taskrunner.errors import StoreError
from taskrunner.store.base import FlowStore
from taskrunner.workflows.saga import PublishMany, check
from taskrunner.workflows.settling import follow_up

SWEEP_LIMIT = 100
"""Tasks owing a follow-up one sweep reads; a full page sweeps again at once."""


class Follower:
    """Does follow-ups: ``owed(key)`` after a run's outcome landed on a task others wait
    on, ``run()`` until ``stop`` (a worker's side task)."""

    def __init__(
        self, store: FlowStore, publish: PublishMany, interval: Callable[[], tuple[float, float]], log: Any
    ) -> None:
        """``publish`` publishes a failed flow's compensations (any task name); ``interval``
        gives the seconds between sweeps after one that found work and after one that did not."""
        self.store, self.publish, self.interval = store, publish, interval
        self._owed: set[str] = set()
        self._done: dict[str, list[Callable[[], None]]] = {}
        self._busy = False
        self._sweep_now = False
        self._wake = asyncio.Event()
        self._outage = Outage(log, "workflow follow-ups failed; retrying", "workflow follow-ups recovered")

    def owed(self, key: str, done: Callable[[], None] | None = None) -> None:
        """The run of ``key`` wrote an outcome that may have ended it: follow up now, then
        call ``done`` (the run's span ends then: the releases sit inside it)."""
        self._owed.add(key)
        if done is not None:
            self._done.setdefault(key, []).append(done)
        self._wake.set()

    def _followed(self, keys: list[str]) -> None:
        for key in keys:
            for done in self._done.pop(key, []):
                done()

    async def idle(self) -> bool:
        """Nothing is owed, here or by any task (a draining worker stops only then); when
        something is, a sweep starts now."""
        if self._owed or self._busy or await self.store.follow_ups(limit=1):
            self._sweep_now = True
            self._wake.set()
            return False
        return True

    async def flows(self, flow: str) -> None:
        await check(self.store, flow, self.publish)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._run(stop)
        finally:
            self._followed(list(self._done))  # stopping: what was owed is the sweep's now

    async def _run(self, stop: asyncio.Event) -> None:
        sweep_at = time.monotonic()
        while not stop.is_set():
            with suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, sweep_at - time.monotonic())):
                    await self._wake.wait()
            self._wake.clear()
            keys, self._owed = sorted(self._owed), set()
            sweeping = self._sweep_now or time.monotonic() >= sweep_at
            self._busy, self._sweep_now = True, False
            try:
                if keys:
                    await follow_up(self.store, await self.store.follow_ups(keys=keys), self.flows)
                    self._followed(keys)
                if sweeping:
                    found = await self.store.follow_ups(limit=SWEEP_LIMIT)
                    await follow_up(self.store, found, self.flows)
                    busy, quiet = self.interval()
                    pause = 0.0 if len(found) >= SWEEP_LIMIT else busy if found else quiet
                    sweep_at = time.monotonic() + pause
                self._outage.ok()
            except StoreError as exc:
                self._owed.update(keys)  # done again after the pause
                sweep_at = time.monotonic() + self._outage.failed(exc)
            finally:
                self._busy = False
