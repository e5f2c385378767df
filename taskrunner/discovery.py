"""Discovery keeps the claim queue in step with the collection.

The change stream is opened first and only then is the collection scanned
(seed order), so nothing written during the scan is missed. The stream resumes
from its token after an error; when history is lost, or the queue overflowed,
everything is scanned again, page by page through *all* unfinished tasks (no
first-N starvation). Against a server without change streams it polls.
The stream only informs: claims are always atomic updates made elsewhere.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any

import structlog

from taskrunner.errors import ChangeHistoryLost, ChangeStreamsUnsupported, StoreError
from taskrunner.models import Task
from taskrunner.redact import redact
from taskrunner.schedule import ClaimQueue, Rank
from taskrunner.store.base import ChangeEvent, ChangeStream, Store

ClaimTime = Callable[[Task], tuple[float, Rank] | None]
log = structlog.get_logger("taskrunner.discovery")
REPORTED_MAX = 10_000  # unreadable documents remembered so scans do not log them again
MAX_BACKOFF = 3.0  # seconds between reconnect attempts while the server is away (before jitter)


class Discovery:
    def __init__(
        self,
        store: Store,
        queue: ClaimQueue,
        claim_time: ClaimTime,
        *,
        poll_interval: float = 5.0,
        page_size: int = 500,
        sweep: Callable[[], None] = lambda: None,
    ) -> None:
        """``sweep`` is called when unreadable documents may be claimable: after an event
        showing one, and after each scan (which skips them)."""
        self.store, self.queue, self.claim_time = store, queue, claim_time
        self.sweep = sweep
        self.poll_interval, self.page_size = poll_interval, page_size
        self.polling = False
        self._token: Mapping[str, Any] | None = None
        self._rescan = True
        self._failures = 0
        self._reported: dict[str | None, str] = {}

    def apply(self, task: Task) -> None:
        """Schedule the task's next claim time for this worker, or forget it."""
        when = self.claim_time(task)
        if when is None:
            self.queue.discard(task.key)
        else:
            self.queue.put(task.key, *when)

    def on_event(self, event: ChangeEvent) -> None:
        if event.task is not None:
            self.apply(event.task)
            return
        if event.key is not None:
            self.queue.discard(event.key)
        if event.problem:
            self._report(event.key, event.problem, repeat=True)
            self.sweep()

    async def scan(self) -> int:
        """Page through every unfinished task; returns how many were read."""
        self._rescan, self.queue.overflowed, after, seen = False, False, None, 0
        while True:
            page = await self.store.candidates(after=after, limit=self.page_size)
            for task in page.tasks:
                self.apply(task)
            for bad in page.unreadable:
                self._report(bad.key, bad.problem, repeat=False)
            seen += len(page.tasks)
            if page.after is None:
                self.sweep()
                return seen
            after = page.after

    def _report(self, key: str | None, problem: str, *, repeat: bool) -> None:
        # A change event is news, so it is always logged; a scan (every poll interval when
        # polling) logs a document only when its problem is new, so logs do not fill up.
        if repeat or self._reported.get(key) != problem:
            log.warning("skipping unreadable task document", key=key, problem=problem)
        if len(self._reported) >= REPORTED_MAX:
            self._reported.clear()
        self._reported[key] = problem

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the collection until ``stop`` is set, recovering from every error."""
        while not stop.is_set():
            try:
                if self.polling:
                    await self._poll(stop)
                else:
                    await self._stream(stop)
                self._recovered()
            except ChangeStreamsUnsupported as exc:
                self.polling = True
                log.warning("no change streams on this server; polling instead",
                            interval=self.poll_interval, reason=redact(str(exc)))  # fmt: skip
            except ChangeHistoryLost:
                log.info("change stream history lost; rescanning")
                self._token, self._rescan = None, True
            except StoreError as exc:
                await self._back_off(stop, exc)

    async def _stream(self, stop: asyncio.Event) -> None:
        stream = await self.store.watch(resume_after=self._token)
        try:
            if self._token is None or self._rescan:
                count = await self.scan()
                log.debug("scanned unfinished tasks", count=count, queued=len(self.queue))
            await self._follow(stream, stop)
        finally:
            with suppress(StoreError):
                await stream.close()

    async def _follow(self, stream: ChangeStream, stop: asyncio.Event) -> None:
        while not stop.is_set():
            event = await stream.next(0.5)
            self._token = stream.resume_token
            self._recovered()
            if event is not None:
                self.on_event(event)
            if self.queue.overflowed and len(self.queue) < self.queue.capacity // 2:
                await self.scan()  # what the overflow evicted is far off: fetch it again

    async def _poll(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.scan()
            self._recovered()
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_interval)

    def _recovered(self) -> None:
        if self._failures:
            log.info("discovery recovered", failures=self._failures)
            self._failures = 0

    async def _back_off(self, stop: asyncio.Event, exc: StoreError) -> None:
        # One log line per outage, then quiet retries with jittered exponential backoff,
        # capped low enough that the worker is back within seconds of the server.
        if self._failures == 0:
            log.error("discovery lost the server; retrying", error=redact(str(exc)))
        else:
            log.debug("discovery lost the server; retrying", error=redact(str(exc)), failures=self._failures)
        self._failures += 1
        delay = min(MAX_BACKOFF, 0.2 * 2 ** min(self._failures, 8)) * random.uniform(0.5, 1.0)
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
