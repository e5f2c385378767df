"""Discovery: the worker's change stream, which only wakes it.

The stream (``Store.watch(work_for=names)``) is filtered by the server: inserts of
tasks the worker handles and *wakes* (a task became claimable again), nothing else:
no other worker's claims, lease renewals or outcomes. Each new task goes to the
worker's ``consider`` (which queues it only if this worker should claim it); a wake
names no task, so it asks for a sweep (``Store.due``, an indexed query the worker
runs while it has a free slot). Sweeps also cover what no stream says: expired
leases, tasks another worker should have claimed, anything written while no stream
was open (at start and after lost history). A document no model reads, from either,
is normalized (``Store.normalize``): given its defaults and considered, or marked FAIL.

A stream the server ends (MongoDB does after an invalidate: the collection or its
database dropped or renamed) is reopened at once without its resume token, and a sweep
covers what was written meanwhile; the worker logs ``change stream ended`` once
(``taskrunner.engine.follow``). A stream that keeps failing for any reason (no change streams
on the server, not authorized, getMores erroring, ending again at once) degrades the
worker to polling: one warning, sweeps every ``poll_interval``, and the stream retried
with capped backoff. A server that is away altogether is one error line per outage and
quiet jittered retries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from datetime import datetime
from typing import Any

from taskrunner.engine.follow import StreamEnds
from taskrunner.engine.outage import Outage
from taskrunner.errors import (
    ChangeHistoryLost,
    ChangeStreamEnded,
    StoreError,
    StoreUnavailable,
    TaskNotFound,
    TaskRunnerError,
)
from taskrunner.models import Task, Unreadable
from taskrunner.observability.logs import get_logger
from taskrunner.observability.redact import redact
from taskrunner.store.base import ChangeEvent, Store
from taskrunner.store.rules import MALFORMED

log = get_logger("taskrunner.discovery")
REPORTED_MAX = 10_000  # unreadable documents remembered so sweeps do not log them again
MAX_BACKOFF = 3.0  # seconds between reconnect attempts while the server is away (before jitter)
MAX_STREAM_RETRY = 60.0  # seconds between attempts to reopen a stream that keeps failing
STREAM_WAIT = 5.0  # one wait for events; the stream only wakes, so an idle worker asks rarely


class Discovery:
    def __init__(
        self,
        store: Store,
        names: Sequence[str],
        *,
        consider: Callable[[Task], object],
        sweep_at: Callable[[datetime | None], None],
        keyless: Callable[[], None],
        polling: bool = False,
    ) -> None:
        """``consider`` gets every new task; ``sweep_at`` asks for a sweep (None: now);
        ``keyless`` asks for one claim without a key, which records unreadable documents."""
        self.store, self.names = store, sorted(names)
        self.consider, self.sweep_at, self.keyless = consider, sweep_at, keyless
        self.polling = polling
        """True while the worker finds work by sweeps alone (by choice, or the stream fails)."""
        self.by_choice = polling
        self.owned: Mapping[str, Sequence[int]] | None = None
        """Buckets whose inserts the stream hears, per name (None: all; see ``listen``)."""
        self._token: Mapping[str, Any] | None = None
        # A server that is away: one error line per outage, quick jittered retries.
        self._server = Outage(
            log,
            "discovery lost the server; retrying",
            "discovery recovered",
            level="error",
            base=0.2,
            cap=MAX_BACKOFF,
        )
        # A stream that keeps failing: one warning, polling meanwhile, slower retries.
        self._stream_outage = Outage(
            log,
            "change stream failing; polling instead while retrying it",
            "change stream recovered; sweeping on events again",
            base=1.0,
            cap=MAX_STREAM_RETRY,
        )
        self._ends = StreamEnds(log, "tasks")
        self._reported: dict[str | None, str] = {}
        self.unsettled: list[Unreadable] = []
        """Unreadable documents heard of on the stream, normalized before the next event."""
        self._listened = False

    def poll_only(self) -> None:
        """Find work by sweeps alone from the start (the start-up check found no change
        streams), without trying the stream and warning again."""
        self.polling = self.by_choice = True

    def listen(self, owned: Mapping[str, Sequence[int]] | None) -> None:
        """Hear the inserts of these buckets from now on: the stream reopens with them after
        its current wait, resuming where it was, so no event is lost in between (an insert
        heard by the old owner meanwhile is an orphan its sweeps find)."""
        self.owned = owned

    def on_event(self, event: ChangeEvent) -> None:
        if event.task is not None:
            self.consider(event.task)
        elif event.wake:
            self.sweep_at(event.wake_at)
        elif event.unreadable is not None:
            self.unsettled.append(event.unreadable)

    async def settle(self, unreadable: Sequence[Unreadable]) -> None:
        """Normalize each unreadable document (``Store.normalize``): one that then reads is
        considered like a new task, one that does not is marked FAIL naming its problem. A
        document without a string key cannot be addressed: it is reported, and one claim
        without a key records it as a failed run if the server's claim filter accepts it."""
        for bad in unreadable:
            if bad.key is None:
                self.report(None, bad.problem)
                self.keyless()
            else:
                await self._normalize(bad.key)

    async def _normalize(self, key: str) -> None:
        try:
            task = await self.store.normalize(key)
        except TaskNotFound:
            return  # deleted meanwhile
        except TaskRunnerError as exc:  # the server failed the write: the next sweep finds it again
            log.warning("cannot normalize a task document yet", key=key, error=redact(str(exc)))
            return
        # Marking may leave a readable document (a wrong state replaced): its error says why.
        if task.error is not None and task.error.type == MALFORMED:
            self.report(key, task.error.message)
        elif task.unreadable is not None:
            self.report(key, task.unreadable.problem)
        else:
            log.info("normalized a task document written by hand", key=key)
            self.consider(task)

    def report(self, key: str | None, problem: str) -> None:
        # A sweep (every interval when polling) logs a document only when its problem is
        # new, so logs do not fill up with a document nobody can mark.
        if self._reported.get(key) != problem:
            event = (
                "skipping unreadable task document"
                if key is None
                else "marked an unreadable task document FAIL"
            )
            log.warning(event, key=key, problem=problem)
        if len(self._reported) >= REPORTED_MAX:
            self._reported.clear()
        self._reported[key] = problem

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the stream until ``stop`` is set, recovering from every error."""
        if self.by_choice:
            await stop.wait()
            return
        while not stop.is_set():
            try:
                await self._stream(stop)
            except ChangeHistoryLost:
                log.info("change stream history lost; sweeping")
                self._token = None
            except ChangeStreamEnded as exc:
                self._token = None  # a new stream, and a sweep for what it did not see
                if not self._ends.ended(exc):
                    await self._degrade(stop, exc)
            except StoreUnavailable as exc:
                await _pause(stop, self._server.failed(exc))
            except StoreError as exc:  # unsupported, unauthorized, getMores failing, ...
                await self._degrade(stop, exc)

    async def _stream(self, stop: asyncio.Event) -> None:
        owned = self.owned
        stream = await self.store.watch(resume_after=self._token, work_for=self.names, owned=owned)
        try:
            self._server.ok()  # the server answered the aggregate that opened the stream
            if not self._listened:  # from here on every insert and wake reaches the worker
                log.info("change stream opened")
                self._listened = True
            if self._token is None:
                self.sweep_at(None)  # what was written while no stream was open
            while not stop.is_set() and self.owned == owned:
                event = await stream.next(STREAM_WAIT)
                # Opening is not enough: a server may accept the stream and fail every getMore.
                self._opened()
                self._token = stream.resume_token
                if event is not None:
                    self.on_event(event)
                if self.unsettled:
                    unsettled, self.unsettled = self.unsettled, []
                    await self.settle(unsettled)
        finally:
            with suppress(StoreError):
                await stream.close()

    def _opened(self) -> None:
        self._stream_outage.ok()
        self._ends.worked()
        self.polling = False

    async def _degrade(self, stop: asyncio.Event, exc: StoreError) -> None:
        """Poll (sweep every poll interval) and retry the stream with capped backoff."""
        if not self.polling:
            self.polling = True
            self.sweep_at(None)
        await _pause(stop, self._stream_outage.failed(exc))


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or less if ``stop`` is set meanwhile."""
    with suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
