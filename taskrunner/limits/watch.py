"""A worker's view of its names' limit documents (``LimitWatch``): read again on every change
the limits collection's stream reports, when a throttle ends, and periodically."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from taskrunner.engine.follow import Reading, StreamEnds
from taskrunner.engine.outage import Outage
from taskrunner.errors import ChangeStreamEnded, StoreError, StoreUnavailable
from taskrunner.limits.gates import Limit
from taskrunner.limits.state import ALL, LimitState, limits_in_force, paused_names
from taskrunner.models import Unreadable
from taskrunner.observability.logs import get_logger

if TYPE_CHECKING:
    from taskrunner.store.base import LimitStore

log = get_logger("taskrunner.limits")
POLL_INTERVAL = 0.5  # seconds between a worker's reads of its names' documents without a stream
RECHECK = 30.0  # seconds between reads while following the stream (a missed event costs no more)
MAX_STREAM_RETRY = 60.0  # seconds between attempts to reopen a stream that keeps failing


class LimitWatch:
    """A worker's view of its names' limit documents: read again whenever the limits
    collection's change stream says something changed (an idle worker costs one getMore
    per few seconds), when a throttle ends, and every ``RECHECK`` seconds anyway; every
    ``POLL_INTERVAL`` seconds instead while no stream can be followed."""

    def __init__(
        self,
        store: LimitStore,
        names: Sequence[str],
        on_change: Callable[[frozenset[str]], None],
        now: Callable[[], datetime],
        declared: Mapping[str, Limit] | None = None,
        on_limits: Callable[[dict[str, Limit]], None] | None = None,
    ) -> None:
        """``now`` is the worker's estimate of server time (a throttle ends by it);
        ``declared`` the code's fleet-wide limits, ``on_limits`` told those in force
        (with operators' changes) whenever they change."""
        self.store, self.names, self.on_change, self.now = store, sorted(names), on_change, now
        self.declared = dict(declared or {})
        self.on_limits = on_limits
        self.limits = {n: lim for n, lim in self.declared.items() if lim}
        self.paused: frozenset[str] = frozenset()
        self.problems: dict[str, str] = {}
        self._throttle_ends: float | None = None
        self.gate_throttles: dict[str, float] = {}
        """Gates of ``limit_by`` values a handler's ``RateLimited`` holds back, until when."""
        self.follow = True
        """Whether to follow the change stream (False: the start-up check found none; poll)."""
        self._reading: Reading | None = None
        self._retry_at = 0.0  # monotonic time before which a failing stream is not retried
        self._ends = StreamEnds(log, "limits")
        self._stream_outage = Outage(
            log,
            "limits change stream failing; reading the limits every 0.5 s instead while retrying it",
            "limits change stream recovered",
            base=1.0,
            cap=MAX_STREAM_RETRY,
        )

    async def refresh(self) -> None:
        states = await self.store.limits([*self.names, ALL])
        problems = {name: s.problem for name, s in states.items() if isinstance(s, Unreadable)}
        for name, problem in problems.items():
            if self.problems.get(name) != problem:  # once per problem, not every half second
                log.warning("skipping unreadable limits document", name=name, problem=problem)
        self.problems = problems
        now = self.now()
        readable = [s for s in states.values() if isinstance(s, LimitState)]
        self.gate_throttles = {
            t.gate: t.until.timestamp() for s in readable for t in s.throttled_gates if t.until > now
        }
        ends = [
            s.throttled_until for s in readable if s.throttled_until is not None and s.throttled_until > now
        ]
        ends += [datetime.fromtimestamp(t, UTC) for t in self.gate_throttles.values()]
        self._throttle_ends = min(ends).timestamp() if ends else None
        paused = paused_names(states, self.names, now)
        if paused != self.paused:
            self.paused = paused
            self.on_change(paused)
        limits = limits_in_force(states, self.names, self.declared)
        if limits != self.limits:
            self.limits = limits
            if self.on_limits is not None:
                self.on_limits(limits)

    async def run(self, stop: asyncio.Event, outage: Outage) -> None:
        """Read the documents, then again on every change, until ``stop``; ``outage`` logs
        a server that is away. A stream the server ends is reopened at once (and the
        documents read again); one that keeps failing degrades to polling, as a worker's
        task stream does (``taskrunner.engine.follow``)."""
        try:
            while not stop.is_set():
                await self._step(stop, outage)
        finally:
            await self._drop_stream()

    async def _step(self, stop: asyncio.Event, outage: Outage) -> None:
        """Open the stream if due (before the read: nothing slips by), read, wait."""
        if self._reading is None and self.follow and time.monotonic() >= self._retry_at:
            try:
                self._reading = Reading(await self.store.watch_limits(), RECHECK)
            except StoreUnavailable:
                pass  # the read below fails too, and says so once per outage
            except StoreError as exc:
                self._degrade(exc)
        try:
            await self.refresh()
        except StoreError as exc:
            await self._drop_stream()
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), outage.failed(exc))
            return
        outage.ok()
        try:
            await self._wait(stop)
        except ChangeStreamEnded as exc:
            await self._drop_stream()
            if not self._ends.ended(exc):
                self._degrade(exc)
        except StoreUnavailable:
            await self._drop_stream()  # the next read says whether the server is away
        except StoreError as exc:
            await self._drop_stream()
            self._degrade(exc)

    def _degrade(self, exc: StoreError) -> None:
        """Poll (read every ``POLL_INTERVAL``) and retry the stream with capped backoff."""
        self._retry_at = time.monotonic() + self._stream_outage.failed(exc)

    async def _drop_stream(self) -> None:
        reading, self._reading = self._reading, None
        if reading is not None:
            await reading.close()
            with suppress(StoreError):
                await reading.stream.close()

    async def _wait(self, stop: asyncio.Event) -> None:
        """Until something may have changed: an event, a throttle's end, or the recheck.
        The stream's read outlives a wait cut short by a throttle's end (``Reading``)."""
        reading = self._reading
        limit = RECHECK if reading is not None else POLL_INTERVAL * random.uniform(0.8, 1.0)
        if self._throttle_ends is not None:
            limit = min(limit, max(0.0, self._throttle_ends - self.now().timestamp()) + 0.01)
        if reading is None:
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), limit)
            return
        done, _ = await reading.until(limit)
        if done:  # the stream answered: it works
            self._stream_outage.ok()
            self._ends.worked()
