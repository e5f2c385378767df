"""Flow control by task name, stored in ``<collection>.limits`` (docs/limits.md).

One document per task name (``_id`` is the name; ``"*"`` stands for every name)::

    {_id: "send_email", paused: true, paused_at: ISODate(...), updated_at: ISODate(...)}

Operators write them (``taskrunner pause NAME``, ``runner.pause(...)``, or the mongo
shell); every worker reads its names' documents again whenever the collection's change
stream says something changed (``LimitWatch``), so a change applies fleet-wide within a
second, without a leader. A paused name is not
claimed (its queued tasks are dropped, sweeps and claims leave it out); running
tasks finish and publishing goes on. Resuming sweeps at once for the backlog.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from taskrunner.errors import ChangeStreamEnded, InvalidTask, StoreError, StoreUnavailable
from taskrunner.follow import Reading, StreamEnds
from taskrunner.gates import Limit, check_max_running, parse_rate
from taskrunner.logs import get_logger
from taskrunner.models import UtcDatetime, first_error
from taskrunner.outage import Outage

log = get_logger("taskrunner.limits")
ALL = "*"
"""The ``_id`` whose document pauses every task name (``taskrunner pause --all``)."""
POLL_INTERVAL = 0.5  # seconds between a worker's reads of its names' documents without a stream
RECHECK = 30.0  # seconds between reads while following the stream (a missed event costs no more)
MAX_STREAM_RETRY = 60.0  # seconds between attempts to reopen a stream that keeps failing


class GateThrottle(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    gate: str
    until: UtcDatetime


class LimitState(BaseModel):
    """One stored document of ``<collection>.limits``."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    name: str = Field(alias="_id")
    paused: bool = False
    paused_at: UtcDatetime | None = None
    resumed_at: UtcDatetime | None = None
    updated_at: UtcDatetime | None = None
    throttled_until: UtcDatetime | None = None
    """Set when a handler raised ``RateLimited``: no task of the name starts before it."""
    throttled_gates: list[GateThrottle] = Field(default_factory=list)
    """``RateLimited`` of a name with ``limit_by``: that value's gate only."""
    rate_limit: str | None = None
    """An operator's rate (``taskrunner limit NAME --rate 10/s``); wins over the code's.
    Present but null: no rate, whatever the code says."""
    max_running: int | None = None
    """An operator's ``max_running``, as ``rate_limit``."""
    declared: dict[str, Any] = Field(default_factory=dict)
    """The limits the app's code declares, as its workers last wrote them (for operators)."""

    @field_validator("rate_limit")
    @classmethod
    def _rate(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_rate(value)
            except InvalidTask as exc:
                raise ValueError(exc.message) from None
        return value

    @field_validator("max_running")
    @classmethod
    def _max_running(cls, value: int | None) -> int | None:
        try:
            return check_max_running(value) if value is not None else None
        except InvalidTask as exc:
            raise ValueError(exc.message) from None

    def limit(self, code: Limit) -> Limit:
        """The limits in force: an operator's where set (null lifts one), else the code's."""
        chosen = self.model_fields_set
        rate = code.rate
        if "rate_limit" in chosen:
            rate = parse_rate(self.rate_limit) if self.rate_limit is not None else None
        running = self.max_running if "max_running" in chosen else code.max_running
        return Limit(rate, running, code.limit_by)

    @classmethod
    def read(cls, doc: dict[str, Any]) -> LimitState | str:
        """The document as a model, or what is wrong with it (a hand edit)."""
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            return first_error(exc)


def readable_limit(doc: dict[str, Any]) -> LimitState:
    """A document just written, as a model; a hand-broken field makes it an ``InvalidTask``."""
    state = LimitState.read(doc)
    if isinstance(state, str):
        raise InvalidTask(f"limits.{doc.get('_id')}", f"the stored document is unreadable: {state}")
    return state


def paused_names(states: dict[str, LimitState | str], names: Sequence[str], now: datetime) -> frozenset[str]:
    """Which of ``names`` are not claimed now: paused, by their own document or by ``"*"``,
    or throttled until after ``now`` (server time). An unreadable document pauses nothing:
    a hand edit gone wrong must not stop the fleet."""
    every = states.get(ALL)
    if isinstance(every, LimitState) and every.paused:
        return frozenset(names)

    def held(state: LimitState | str | None) -> bool:
        if not isinstance(state, LimitState):
            return False
        return state.paused or (state.throttled_until is not None and state.throttled_until > now)

    return frozenset(n for n in names if held(states.get(n)))


def limits_in_force(
    states: Mapping[str, LimitState | str], names: Sequence[str], declared: Mapping[str, Limit]
) -> dict[str, Limit]:
    """Each limited name's limits: operators' over the code's (an unreadable document
    changes nothing)."""
    limits = {}
    for name in names:
        code, state = declared.get(name, Limit()), states.get(name)
        limit = state.limit(code) if isinstance(state, LimitState) else code
        if limit:
            limits[name] = limit
    return limits


class LimitWatch:
    """A worker's view of its names' limit documents: read again whenever the limits
    collection's change stream says something changed (an idle worker costs one getMore
    per few seconds), when a throttle ends, and every ``RECHECK`` seconds anyway; every
    ``POLL_INTERVAL`` seconds instead while no stream can be followed."""

    def __init__(
        self,
        store: Any,
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
        problems = {name: s for name, s in states.items() if isinstance(s, str)}
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
        task stream does (``taskrunner.follow``)."""
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
