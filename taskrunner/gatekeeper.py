"""A worker's side of the fleet-wide limits: the permits it holds and what it owes the
gates (``taskrunner.gates`` has the arithmetic and the document; docs/limits.md).

Before claiming a task of a limited name the worker needs a permit of the task's gate.
It asks for as many as it has due tasks behind the gate, in one compare-and-set of the
gate document that also settles what it owes: the claim times of permits it used,
permits it did not use, running slots of finished runs. A task whose permit starts later
waits in the claim queue until then; one without a permit waits until asking again can
give one (the gate says when), so a limited name is never claimed and released in a loop.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import structlog

from taskrunner import fields as f
from taskrunner.gates import (
    SLOT_LEASE,
    Change,
    GateDoc,
    Grant,
    Limit,
    Permit,
    Settlement,
    gate_id,
    grant,
    preferred_lanes,
    settle,
)

if TYPE_CHECKING:
    from taskrunner.claimqueue import Due
    from taskrunner.store.base import Store

log = structlog.get_logger("taskrunner.gates")
MARGIN = 0.01
"""Seconds a worker waits past a permit's start before claiming: its estimate of the
server's clock may run a little ahead, and a claim that comes too early is refused."""
SETTLE_DELAY = 0.25
"""Seconds a settlement waits to ride on this worker's next ask (which, while a backlog
lasts, comes at once); a lane waits for its settlement no longer than ``gates.HOLD``."""
MAX_BACKOFF = 0.5
"""Most seconds between asks of a worker that keeps getting no permit."""
ATTEMPTS = 4
"""Compare-and-set attempts per write before giving up until the next ask."""


class GateKeeper:
    def __init__(
        self,
        store: Store,
        worker_id: str,
        now: Callable[[], float],
        limits: dict[str, Limit],
        *,
        capacity: int,
        peers: Callable[[str], list[str]] | None = None,
    ) -> None:
        """``now``: the worker's estimate of server time (POSIX seconds); ``capacity``: the
        most permits it holds at once (its concurrency: more would expire unused);
        ``peers``: ids of the live workers serving a name, this one included (for fair
        shares and preferred lanes)."""
        self.store, self.worker_id, self.now, self.capacity = store, worker_id, now, capacity
        self.peers = peers or (lambda name: [worker_id])
        self._preferred: dict[tuple[str, int, tuple[str, ...]], frozenset[int]] = {}
        self.limits = dict(limits)
        self.wake = asyncio.Event()
        self._docs: dict[str, GateDoc] = {}
        self._owed: dict[str, Settlement] = defaultdict(Settlement)
        self._held: dict[str, Permit] = {}  # by task key
        self._runs: dict[str, Permit] = {}  # by run id: permits holding a running slot
        self._retry: dict[str, float] = {}  # by gate: asking sooner gives nothing
        self._misses: dict[str, int] = {}  # by gate: asks in a row that got nothing
        self._asked: dict[str, float] = {}  # by name: when this worker last asked
        self._names: dict[str, str] = {}  # gate -> task name
        self._problems: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self.counts: Counter[str] = Counter()
        """Asks, permits granted, empty asks, writes, failed expectations, reads, flushes."""

    def gate_of(self, name: str, params: Any) -> str:
        """The task's gate, or "" when its name has no limits."""
        limit = self.limits.get(name)
        if not limit:
            return ""
        gate = gate_id(name, limit.limit_by, params)
        self._names[gate] = name
        return gate

    def name_of(self, gate: str) -> str:
        return self._names.get(gate, gate.split("#", 1)[0])

    def set_limits(self, limits: dict[str, Limit]) -> set[str]:
        """Apply new limits; returns the names whose limits changed (their permits are
        given back: their queued tasks must be looked at again)."""
        changed = {n for n in set(limits) | set(self.limits) if limits.get(n) != self.limits.get(n)}
        self.limits = dict(limits)
        self.give_back(lambda p: self.name_of(p.gate) in changed)
        self._retry.clear()
        return changed

    # -- permits ---------------------------------------------------------------------------------
    def busy(self, name: str) -> bool:
        """Whether this worker is working a limited name's backlog: it holds permits of
        it or asked for some within the last second."""
        if name not in self.limits:
            return False
        asked = self._asked.get(name)
        recent = asked is not None and asked > self.now() - 1.0
        return recent or any(self.name_of(p.gate) == name for p in self._held.values())

    async def admit(
        self, due: Iterable[Due], *, ask_now: bool = False
    ) -> tuple[list[tuple[Due, Permit]], list[tuple[Due, float]]]:
        """Split due entries into those whose permit lets them be claimed now, and those to
        put back in the queue until the given time (a permit's start, or when asking again
        may give one); ``ask_now`` asks even before the gate's retry time. Raises
        ``StoreError`` when the gate cannot be read or written."""
        now = self.now()
        ready: list[tuple[Due, Permit]] = []
        later: list[tuple[Due, float]] = []
        needing: dict[str, list[Due]] = defaultdict(list)
        # Too late to claim with these (their task was busy, or is gone): give them back.
        self.give_back(lambda p: p.until.timestamp() <= now + MARGIN)
        for entry in due:
            permit = self._held.get(entry.key)
            if permit is None:
                needing[entry.gate].append(entry)
            elif permit.start.timestamp() + MARGIN <= now:
                ready.append((entry, permit))
            else:
                later.append((entry, permit.start.timestamp() + MARGIN))
        for gate, entries in needing.items():
            retry = self._retry.get(gate)
            room = self.capacity - len(self._held)
            if room <= 0:  # permits this worker could not use in time would only block lanes
                retry = max(now, min(p.start.timestamp() for p in self._held.values())) + 0.05
            if retry is not None and retry > now and not (ask_now and room > 0):
                later.extend((entry, retry) for entry in entries)
                continue
            granted = await self._ask(gate, entries[0].name, min(len(entries), room))
            self._assign(entries, granted, gate, now, ready, later)
        return ready, later

    def _assign(
        self, entries: list[Due], granted: Grant, gate: str, now: float,
        ready: list[tuple[Due, Permit]], later: list[tuple[Due, float]],
    ) -> None:  # fmt: skip
        for entry, permit in zip(entries, granted.permits, strict=False):
            self._held[entry.key] = permit
            start = permit.start.timestamp() + MARGIN
            if start <= now:
                ready.append((entry, permit))
            else:
                later.append((entry, start))
        rest = entries[len(granted.permits) :]
        misses = 0 if granted.permits else self._misses.get(gate, 0) + 1
        self._misses[gate] = misses
        if rest:
            # Workers told the same time must not all ask at once, and one that keeps
            # getting nothing asks less often: others are taking the lanes meanwhile.
            asked = granted.retry_at.timestamp() if granted.retry_at is not None else now
            backoff = min(MAX_BACKOFF, 0.025 * 2**misses) if misses else 0.0
            retry = max(asked, now + backoff) + random.uniform(0.01, 0.05)
            self._retry[gate] = retry
            later.extend((entry, retry) for entry in rest)

    def used(
        self, entry: Due, permit: Permit, claimed_at: datetime | None, run_id: str | None = None
    ) -> None:
        """The claim with ``permit`` started at ``claimed_at`` (server time), or claimed
        nothing (None); a run holding a running slot gives it back when ``finished``."""
        if self._held.get(entry.key) == permit:
            del self._held[entry.key]
        self._settle(permit, claimed_at)
        if claimed_at is not None and run_id is not None and permit.slot:
            self._runs[run_id] = permit

    def finished(self, run_id: str) -> None:
        permit = self._runs.pop(run_id, None)
        if permit is not None:
            self._owed[permit.gate].released.add(permit.id)
            self.wake.set()

    def forget(self, key: str) -> None:
        """The task is no longer this worker's to claim: give its permit back."""
        permit = self._held.pop(key, None)
        if permit is not None:
            self._settle(permit, None)

    def give_back(self, which: Callable[[Permit], bool] = lambda p: True) -> None:
        for key, permit in list(self._held.items()):
            if which(permit):
                del self._held[key]
                self._settle(permit, None)

    def _settle(self, permit: Permit, claimed_at: datetime | None) -> None:
        self._owed[permit.gate].used[permit.id] = claimed_at
        self.wake.set()

    # -- the gate documents ----------------------------------------------------------------------
    async def _ask(self, gate: str, name: str, want: int) -> Grant:
        """Permits for ``want`` tasks: as many as this worker's fair share of the gate
        allows, the rest only on lanes or slots nobody took for a moment."""
        limit = self.limits.get(name, Limit())
        self._asked[name] = self.now()
        peers = self.peers(name)
        size = limit.rate.limit if limit.rate else limit.max_running or 1
        share = -(-size // max(1, len(peers))) - sum(p.gate == gate for p in self._held.values())
        fair = max(0, min(want, share))
        key = (gate, size, tuple(peers))
        if key not in self._preferred:
            if len(self._preferred) > 256:  # peers churned: keep only what is current
                self._preferred.clear()
            self._preferred[key] = (
                preferred_lanes(gate, size, self.worker_id, peers) if limit.rate else frozenset()
            )
        prefer = self._preferred[key]
        granted = await self._write(
            gate,
            name,
            lambda change, now: grant(change, limit, fair, self.worker_id, now, want - fair, prefer),
        )
        self.counts.update(asks=1, permits=len(granted.permits), empty=not granted.permits)
        return granted

    async def throttle(self, gate: str, name: str, seconds: float) -> None:
        """``RateLimited`` for a ``limit_by`` value: no permit of ``gate`` for ``seconds``.
        This worker's own permits of it are given back at once."""
        self.give_back(lambda p: p.gate == gate)

        def hold(change: Change, now: datetime) -> Grant:
            until = now + timedelta(seconds=seconds)
            change.work.throttled_until = max(change.work.throttled_until or until, until)
            change.throttle = True
            return Grant([], change.work.throttled_until)

        await self._write(gate, name, hold)
        self._retry[gate] = self.now() + seconds

    async def flush(self, renew: bool = False) -> None:
        """Write what this worker owes its gates (and renew its running slots)."""
        if renew:
            for permit in self._runs.values():
                self._owed[permit.gate].renew.add(permit.id)
        for gate in [g for g, owed in self._owed.items() if owed]:
            self.counts["flushes"] += 1
            await self._write(gate, self.name_of(gate), lambda change, now: Grant([], None))

    async def _write(self, gate: str, name: str, make: Callable[[Change, datetime], Grant]) -> Grant:
        """Read (or reuse the last reply), compute, write with expectations on what it
        touches; on a failed expectation read again and redo. Settles what is owed."""
        async with self._lock:
            for attempt in range(ATTEMPTS + 1):
                seen = self._docs.get(gate) if attempt == 0 else None
                change = Change.of(seen or await self._read(gate, name))
                owed = self._owed.pop(gate, Settlement())
                now = datetime.fromtimestamp(self.now(), UTC)
                settle(change, owed, self.limits.get(name, Limit()).rate, now)
                settled, freed = set(change.lanes), set(change.slots)
                result = make(change, now)
                if seen is not None and (change.lanes - settled or change.slots - freed):
                    # Lanes this write did not just settle may have been taken since the
                    # last reply: read first rather than fail a write over them.
                    self._owed[gate].merge(owed)
                    continue
                write = change.write()
                if write is None:
                    return result
                write.changes[f.NAME] = name
                self.counts["writes"] += 1
                try:
                    written = await self.store.update_gate(
                        gate, write.expect, write.changes, create=write.create
                    )
                except BaseException:
                    self._owed[gate].merge(owed)
                    raise
                if written is not None:
                    self._docs[gate] = self._parse(written, gate, name)
                    return result
                self.counts["conflicts"] += 1
                self._owed[gate].merge(owed)  # someone changed what this touches: read again, redo
                self._docs.pop(gate, None)
            return Grant([], datetime.fromtimestamp(self.now() + 0.1, UTC))

    async def _read(self, gate: str, name: str) -> GateDoc:
        self.counts["reads"] += 1
        return self._parse(await self.store.read_gate(gate), gate, name)

    def _parse(self, doc: dict[str, Any] | None, gate: str, name: str) -> GateDoc:
        parsed, problem = GateDoc.read(doc, gate, name)
        if problem is not None and self._problems.get(gate) != problem:
            self._problems[gate] = problem
            log.warning("unreadable gate document; starting it over", gate=gate, problem=problem)
        return parsed

    # -- the side task ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, declared: dict[str, Limit]) -> None:
        """Record the code's limits, then settle within ``SETTLE_DELAY`` of a claim or a
        run's end, and renew running slots every third of their lease."""
        for name, limit in declared.items():
            if limit:
                await self.store.declare_limits(name, describe(limit))
        renew_at = self.now() + SLOT_LEASE / 3
        while not stop.is_set():
            with suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), max(0.0, renew_at - self.now()))
            self.wake.clear()
            await asyncio.sleep(SETTLE_DELAY)
            renew = self.now() >= renew_at
            await self.flush(renew=renew)
            if renew:
                renew_at = self.now() + SLOT_LEASE / 3

    async def close(self) -> None:
        """Give back every permit and slot this worker holds (shutdown)."""
        self.give_back()
        for run_id in list(self._runs):
            self.finished(run_id)
        await self.flush()
        if self.counts:
            log.info("gate round trips", **self.counts)


def describe(limit: Limit) -> dict[str, Any]:
    """A ``Limit`` as stored under ``declared`` in a limits document."""
    return {f.RATE_LIMIT: str(limit.rate) if limit.rate else None, f.MAX_RUNNING: limit.max_running,
            f.LIMIT_BY: limit.limit_by}  # fmt: skip
