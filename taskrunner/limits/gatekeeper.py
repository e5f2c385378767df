"""A worker's side of the fleet-wide limits: the lanes and running slots it leases, and
the permits it makes from them (``taskrunner.limits.gates`` has the arithmetic and the
document; docs/limits.md).

Before claiming a task of a limited name the worker needs a permit: one of its leased
lanes whose next start has come, and one of its leased running slots that is free. Both
are its own, so a permit costs no round trip; the claim carries the permit's window and
the server refuses it outside. The gate document is written only to take lanes and slots
(when a due task finds none), to renew their lease (every ``LEASE / 3``), and to give
them back (``IDLE`` seconds after the last due task, when limits change, at shutdown).
A task that finds no permit waits in the claim queue until a lane of this worker opens,
a slot frees or a claim took nothing (``opened`` wakes it at once), or asking the gate
again may give more, so a limited name is never claimed and released in a loop, and a
permit never idles while a task it could start waits here.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from taskrunner.engine.outage import Outage
from taskrunner.errors import StoreError
from taskrunner.limits.gates import (
    FENCE,
    IDLE,
    MARGIN,
    Change,
    GateDoc,
    GateLease,
    HeldLane,
    HeldSlot,
    Limit,
    Permit,
    dealt,
    dealt_to,
    gate_id,
    lease_end,
    release,
    renew,
    resize,
    take,
)
from taskrunner.observability.logs import get_logger
from taskrunner.store import fields as f

if TYPE_CHECKING:
    from taskrunner.engine.claim_queue import Due
    from taskrunner.store.base import LimitStore

log = get_logger("taskrunner.gates")
TICK = 0.5
"""Seconds between looks at what to renew or give back."""
LIFTED = 0.2
"""Seconds before a task of a name whose limits were just lifted looks again (the worker
queues such tasks again without a gate as it applies the change)."""
FALLBACK = 1.0
"""Most seconds a task waiting for a running slot of this worker waits: a slot that
frees wakes it at once (``opened``); this only bounds a wake that went missing."""
UNREAD = 0.25
"""Seconds a worker holds a gate back past its own estimate of the end of a throttle it
stored and has not read back yet: the estimate of the server's clock at the write may
lag the server's by up to half a round trip, and the read normally comes within that."""
MAX_BACKOFF = 4.0
"""Most seconds between asks of a worker that keeps getting nothing from a gate."""
ASK_AGAIN = 1.0
"""Seconds before asking a gate for more after an ask that gave something."""
ATTEMPTS = 3
"""Conditional-write attempts per change before giving up until the next tick or ask."""


class GateKeeper:
    def __init__(
        self,
        store: LimitStore,
        worker_id: str,
        now: Callable[[], float],
        limits: dict[str, Limit],
        *,
        capacity: int,
        peers: Callable[[str], list[str]] | None = None,
        throttled: Callable[[str], float | None] | None = None,
        stop_run: Callable[[str], None] | None = None,
        opened: Callable[[str], None] | None = None,
        clock_error: Callable[[], float] | None = None,
    ) -> None:
        """``now``: the worker's estimate of server time (POSIX seconds); ``capacity``: the
        most running slots of one gate it leases (its concurrency); ``peers``: ids of the
        live workers serving a name, this one included (whose lanes and slots are whose);
        ``throttled``: until when a gate is held back by a handler's ``RateLimited``;
        ``stop_run``: stops a run whose running slot is lost (its claim is released);
        ``opened``: a permit of the gate opened before the time its waiting tasks were
        given (a running slot freed, a claim took nothing): wake them; ``clock_error``:
        the most ``now`` may be off the server's clock (seconds; 0.02 when not told)."""
        self.store, self.worker_id, self.now, self.capacity = store, worker_id, now, capacity
        self.peers = peers or (lambda name: [worker_id])
        self.throttled = throttled or (lambda gate: None)
        self.stop_run = stop_run or (lambda run_id: None)
        self.opened = opened or (lambda gate: None)
        self.clock_error = clock_error or (lambda: 0.02)
        self._runs: dict[str, str] = {}  # run -> the gate whose running slot it holds
        self.limits = dict(limits)
        self.wake = asyncio.Event()
        self._leases: dict[str, GateLease] = {}
        self._docs: dict[str, GateDoc] = {}  # the last reply per gate (a write's first guess)
        self._names: dict[str, str] = {}  # gate -> task name
        self._dealt: dict[tuple[str, str, tuple[str, ...]], tuple[frozenset[int], frozenset[int]]] = {}
        self._throttles: dict[str, float] = {}  # gates this worker throttled: its estimate of the end
        self._problems: dict[str, str] = {}
        self._lock = asyncio.Lock()
        self.counts: Counter[str] = Counter()
        """Asks, empty asks, renewals, releases, writes, failed expectations, reads."""

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
        """Apply new limits; returns the names whose limits changed. The lanes and slots
        held of their gates that the new limits do not deal to this worker start nothing
        more and go back as soon as nothing uses them (a gate's shape and split follow its
        limit), so the workers dealt them now take them; when max_running drops, every
        slot held does, so the runs on them count against the new limit until they end."""
        changed = {n for n in set(limits) | set(self.limits) if limits.get(n) != self.limits.get(n)}
        lowered = {n for n in changed if _fewer_runs(self.limits.get(n), limits.get(n))}
        self.limits = dict(limits)
        for gate, lease in self._leases.items():
            name = self.name_of(gate)
            if name in changed:
                limit = self.limits.get(name)
                keep = self._mine(gate, limit, name) if limit else (frozenset[int](), frozenset[int]())
                lease.retry = 0.0
                # Runs on slots held when max_running drops count against the new limit.
                lease.retire(keep[0], frozenset() if name in lowered else keep[1])
        self.wake.set()
        return changed

    def can_start(self, gate: str) -> bool:
        """Whether this worker is dealt (or holds) a lane and a slot of ``gate``, as far as
        its limits have them: it may then take on other workers' tasks of the gate with
        its own permits, so that no permit idles while tasks of the gate wait anywhere."""
        name = self.name_of(gate)
        limit, lease = self.limits.get(name), self._leases.get(gate)
        if not limit:
            return False
        lanes, slots = self._mine(gate, limit, name)
        if lease is not None:
            lanes, slots = lanes | set(lease.lanes), slots | set(lease.slots)
        return (not limit.rate or bool(lanes)) and (not limit.max_running or bool(slots))

    def startable(self, gate: str) -> bool:
        """Whether a permit of ``gate`` could start a task now (no round trip)."""
        lease, limit = self._leases.get(gate), self.limits.get(self.name_of(gate))
        now = self.now()
        if lease is None or not limit or (self._throttled_until(gate) or 0.0) > now:
            return False
        return lease.open(limit, _utc(now))

    # -- permits ---------------------------------------------------------------------------------
    async def admit(
        self, due: Iterable[Due], room: int
    ) -> tuple[list[tuple[Due, Permit]], list[tuple[Due, float]]]:
        """Permits for up to ``room`` due entries that may be claimed now, and the entries
        to put back until the given time; entries past ``room`` are left as they are.
        Raises ``StoreError`` when the gate cannot be read or written, and then every
        permit it made is given back (nothing was claimed with them)."""
        now = self.now()
        ready: list[tuple[Due, Permit]] = []
        later: list[tuple[Due, float]] = []
        by_gate: dict[str, list[Due]] = defaultdict(list)
        for entry in due:
            by_gate[entry.gate].append(entry)
        try:
            for gate, entries in by_gate.items():
                entries = entries[: max(0, room - len(ready))]
                if entries:
                    await self._admit(gate, entries, now, ready, later)
        except BaseException:
            self.unused([permit for _, permit in ready])
            raise
        return ready, later

    def unused(self, permits: Iterable[Permit]) -> None:
        """These permits claimed nothing, for sure (the gate could not be asked): their
        lanes and slots are free again, and the tasks waiting wait for their retry."""
        for permit in permits:
            self.used(permit, None, wake=False)

    async def _admit(
        self,
        gate: str,
        entries: list[Due],
        now: float,
        ready: list[tuple[Due, Permit]],
        later: list[tuple[Due, float]],
    ) -> None:
        name = entries[0].name
        limit, lease = self.limits.get(name), self._leases.setdefault(gate, GateLease())
        self._names[gate] = name
        lease.wanted = now
        throttled = self._throttled_until(gate)
        if not limit:  # lifted: the worker queues the name's tasks again without a gate
            later.extend((entry, now + LIFTED) for entry in entries)
            return
        if throttled is not None and throttled > now:  # until it ends, by this worker's clock
            later.extend((entry, throttled + self._margin()) for entry in entries)
            return
        at = _utc(now)
        permits = lease.permits(gate, limit, len(entries), at)
        waiting = len(entries) - len(permits)
        if waiting and now >= lease.retry and self._wants_more(gate, lease, limit, name):
            try:  # raises StoreError only when the server does
                await self._ask(gate, name, lease, limit, waiting)
            except BaseException:
                self.unused(permits)
                raise
            permits += lease.permits(gate, limit, waiting, at)
        if throttled is not None:  # ended by this worker's clock: the server checks it too
            end = _utc(throttled)
            permits = [replace(p, start=end, throttled=True) if end > p.start else p for p in permits]
        ready.extend(zip(entries, permits, strict=False))
        rest = entries[len(permits) :]
        waits = self._wait_times(lease, limit, len(rest), now)

        later.extend(zip(rest, waits, strict=True))
        lease.wanted = max([now, *waits])  # its lanes are wanted until these tasks look again

    def _margin(self) -> float:
        """Seconds past a server time to wait, by ``now``, to be sure the server reached it."""
        return MARGIN + self.clock_error()

    def owners(self, gate: str, name: str) -> list[str] | None:
        """The live workers that should own ``gate``'s tasks: those dealt a lane and a
        slot of it when the limit is smaller than the fleet, else None (every worker)."""
        limit = self.limits.get(name)
        return dealt_to(gate, limit, self.peers(name)) if limit else None

    def _mine(self, gate: str, limit: Limit, name: str) -> tuple[frozenset[int], frozenset[int]]:
        """The lanes and slots dealt to this worker among the live workers of the name
        (slots: at most its concurrency, it could not run more at once)."""
        peers = self.peers(name)
        key = (gate, str(limit), tuple(sorted(peers)))
        if key not in self._dealt:
            if len(self._dealt) > 1024:  # peers churned: keep only what is current
                self._dealt.clear()
            lanes = dealt(gate, limit.rate.limit if limit.rate else 0, self.worker_id, peers)
            slots = sorted(dealt(gate, limit.max_running or 0, self.worker_id, peers))[: self.capacity]
            self._dealt[key] = lanes, frozenset(slots)
        return self._dealt[key]

    def _wants_more(self, gate: str, lease: GateLease, limit: Limit, name: str) -> bool:
        """Whether some lane or slot dealt to it is not its own yet."""
        lanes, slots = self._mine(gate, limit, name)
        return bool(lanes - set(lease.lanes)) or bool(slots - set(lease.slots))

    def _wait_times(self, lease: GateLease, limit: Limit, count: int, now: float) -> list[float]:
        """When each of ``count`` waiting tasks should look again: when a lane of this
        worker opens for it; when a slot of its own frees (``opened`` wakes it then, this
        is only a fallback); else when asking the gate again may give more."""
        opens = lease.opens_at(limit, count, _utc(now))
        ask = max(lease.retry, now + 0.001)
        times = []
        for k in range(count):
            lane = opens[k] if k < len(opens) else ask if limit.rate else now
            slot = (now + FALLBACK if lease.usable_slots(limit) else ask) if limit.max_running else now
            times.append(max(lane, slot, now + 0.001))
        return times

    def used(
        self, permit: Permit, started: datetime | None, run_id: str | None = None, *, wake: bool = True
    ) -> None:
        """The claim with ``permit`` started at ``started`` (server time), or claimed
        nothing (None: with ``wake``, a task waiting for the gate looks again now); a run on
        a running slot holds it until ``finished``."""
        lease = self._leases.get(permit.gate)
        if lease is not None:
            limit = self.limits.get(self.name_of(permit.gate)) or Limit()
            lease.used(permit, started, limit.rate.period if limit.rate else 0.0, run_id, self._margin())
            if run_id is not None and permit.slot is not None and started is not None:
                self._runs[run_id] = permit.gate
            if lease.retiring():
                self.wake.set()  # retired lanes and slots go back as soon as they are free
        if started is None and wake:
            self.opened(permit.gate)

    def finished(self, run_id: str) -> None:
        """``run_id``'s outcome is written: its running slot is free for the next task."""
        gate = self._runs.pop(run_id, None)
        for lease in self._leases.values():
            if lease.finished(run_id):
                if lease.retiring():
                    self.wake.set()
                break
        if gate is not None:
            self.opened(gate)

    async def holds_slot(self, run_id: str) -> bool:
        """Whether ``run_id`` may write its outcome: it holds no running slot, or still
        holds its slot's lease with time to spare. A lease about to end (the worker was
        frozen or cut off past its renewals) is renewed first; a slot lost meanwhile
        (another worker took it) means the run must not count as done: it could not
        have been one of max_running runs all along."""
        gate = self._runs.get(run_id)
        if gate is None:
            return True
        lease = self._leases.get(gate)
        if lease is None or (slot := lease.slot_of(run_id)) is None:
            return False
        if slot.until.timestamp() - FENCE > self.now():
            return True
        try:
            await self._renew(gate, self.name_of(gate), lease)
        except StoreError:
            return False
        slot = lease.slot_of(run_id)
        return slot is not None and slot.until.timestamp() - FENCE > self.now()

    async def throttle(self, gate: str, name: str, seconds: float) -> None:
        """``RateLimited`` for a ``limit_by`` value: no worker starts a task of ``gate`` for
        ``seconds`` (the name's limits document lists it; this worker stops at once)."""
        self._throttles[gate] = self.now() + seconds
        await self.store.throttle(name, seconds, gate=gate)

    def _throttled_until(self, gate: str) -> float | None:
        """Until when ``gate`` is held back (server time): the stored end once this worker
        has read it; until then, for a throttle of its own, its estimate of that end
        (the server's now at the write plus the seconds) with ``UNREAD`` to spare."""
        stored, mine = self.throttled(gate), self._throttles.get(gate)
        if mine is None:
            return stored
        if stored is not None and stored >= mine - UNREAD:  # its own throttle, read back (or a later one)
            del self._throttles[gate]
            return stored
        if mine + UNREAD <= self.now():
            del self._throttles[gate]  # over, whether read back or not
        return max(stored or 0.0, mine + UNREAD)

    # -- the gate documents ----------------------------------------------------------------------
    async def _ask(self, gate: str, name: str, lease: GateLease, limit: Limit, waiting: int) -> None:
        """Take the free lanes and slots dealt to this worker."""
        lanes, slots = self._mine(gate, limit, name)
        mine = lanes - set(lease.lanes), slots - set(lease.slots)
        got: list[tuple[dict[int, Any], dict[int, Any]]] = []

        def taking(change: Change, now: datetime) -> None:
            got[:] = [take(change, limit, self.worker_id, now, mine, self._margin())]

        if not any(mine):  # nothing dealt to it is missing (more workers than the limit)
            got.clear()
        elif not await self._write(gate, name, taking, fresh=True):
            got.clear()  # others kept changing it: as if nothing was free
        lanes_got, slots_got = got[0] if got else ({}, {})
        lease.lanes.update(lanes_got)
        lease.slots.update(slots_got)
        gained = bool(lanes_got or slots_got)
        lease.misses = 0 if gained else lease.misses + 1
        lease.starved = not gained and not lease
        wait = ASK_AGAIN if gained else min(MAX_BACKOFF, 0.25 * 2**lease.misses)
        lease.retry = self.now() + wait * random.uniform(0.8, 1.2)
        self.counts.update(asks=1, empty=not gained)

    async def _renew(self, gate: str, name: str, lease: GateLease) -> None:
        """Extend the lease of everything held; what was lost meanwhile is forgotten."""
        kept: list[tuple[set[int], set[int], datetime]] = []

        def extending(change: Change, now: datetime) -> None:
            probe = GateLease(dict(lease.lanes), dict(lease.slots))
            renew(change, probe, self.worker_id, now)
            kept[:] = [(set(probe.lanes), set(probe.slots), lease_end(now))]

        if not await self._write(gate, name, extending):
            return
        if kept:
            lanes, slots, until = kept[0]
            self._keep(lease, lanes, slots, until)
        self.counts["renewals"] += 1

    def _keep(self, lease: GateLease, lanes: set[int], slots: set[int], until: datetime) -> None:
        lost = (set(lease.lanes) - lanes, set(lease.slots) - slots)
        if any(lost):
            log.warning(
                "lost lanes or running slots whose lease lapsed", lanes=sorted(lost[0]), slots=sorted(lost[1])
            )
        for j in lost[1]:
            if (run := lease.slots[j].run) is not None:
                self._stop(run, "lost its running slot")
        for i in list(lease.lanes):
            if i in lanes:
                lease.lanes[i].until = until
            else:
                del lease.lanes[i]
        for j in list(lease.slots):
            if j in slots:
                lease.slots[j].until = until
                lease.slots[j].fenced = False
            else:
                del lease.slots[j]

    def _stop(self, run_id: str, why: str) -> None:
        log.warning("stopping a run on a running slot", run_id=run_id, reason=why)
        self.stop_run(run_id)

    def _fence(self, lease: GateLease, now: float) -> None:
        """Stop every run whose running slot's lease ends within ``FENCE`` by this
        worker's clock: the renewals did not land, so another worker may soon take it."""
        for held in lease.slots.values():
            if held.run is not None and not held.fenced and held.until.timestamp() - FENCE <= now:
                held.fenced = True
                self._stop(held.run, "its running slot's lease is ending unrenewed")

    async def _release(
        self, gate: str, name: str, lease: GateLease, lanes: set[int], slots: set[int]
    ) -> None:
        """Give back these lanes and slots (none with a claim or a run on it). They start
        nothing while the write is on its way: a claim made on one meanwhile would run on
        a lane or slot the gate may already have handed to another worker."""
        leaving: list[HeldLane | HeldSlot] = [lease.lanes[i] for i in lanes if i in lease.lanes]
        leaving += [lease.slots[j] for j in slots if j in lease.slots]
        for held in leaving:
            held.leaving = True

        def giving(change: Change, now: datetime) -> None:
            probe = GateLease(dict(lease.lanes), dict(lease.slots))
            release(change, probe, self.worker_id, now, lanes, slots)
            resize(change.work, self.limits.get(name) or Limit(), now)  # past a lowered limit: gone

        gone = False
        try:
            gone = await self._write(gate, name, giving)
        finally:
            for held in leaving:
                held.leaving = False
        if not gone:
            return
        for i in lanes:
            lease.lanes.pop(i, None)
        for j in slots:
            lease.slots.pop(j, None)
        self.counts["releases"] += 1

    async def _write(
        self, gate: str, name: str, make: Callable[[Change, datetime], None], *, fresh: bool = False
    ) -> bool:
        """Apply ``make`` to the gate as last seen (or as read, when ``fresh``: taking free
        lanes needs the others' latest), write it conditionally on what it touches; when an
        expectation fails, read and redo. False: it kept failing (try again later)."""
        async with self._lock:
            for attempt in range(ATTEMPTS):
                seen = self._docs.get(gate) if attempt == 0 and not fresh else None
                change = Change.of(seen or await self._read(gate, name))
                now = datetime.fromtimestamp(self.now(), UTC)
                resize(change.work, self.limits.get(name) or Limit(), now)
                make(change, now)
                write = change.write()
                if write is None:
                    return True
                write.changes[f.NAME] = name
                self.counts["writes"] += 1
                written = await self.store.update_gate(gate, write.expect, write.changes, create=write.create)
                if written is not None:
                    self._docs[gate] = self._parse(written, gate, name)
                    return True
                self.counts["conflicts"] += 1
                self._docs.pop(gate, None)
            return False

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
        """Record the code's limits, then every ``TICK``: give back what has no use, renew
        what is due, forget gates left with nothing. A server that does not answer is one
        warning when it starts and one info line when it answers again; what failed (the
        limits not yet recorded, a renewal) is tried again at the next tick."""
        undeclared = {name: limit for name, limit in declared.items() if limit}
        outage = Outage(log, "gates cannot reach the server; retrying", "gates recovered", cap=TICK)
        while not stop.is_set():
            try:
                declared_now = await self._declare(undeclared)
                await self.tend()
            except StoreError as exc:
                outage.failed(exc)
            else:
                # Only a server that answered ends an outage: with nothing recorded and no
                # lane or slot held, this tick asked it nothing.
                if declared_now or any(self._leases.values()):
                    outage.ok()
            with suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), TICK)
            self.wake.clear()

    async def _declare(self, undeclared: dict[str, Limit]) -> bool:
        """Record each name's limits from code in its limits document (for operators),
        removing each from ``undeclared`` once written; whether any was."""
        written = False
        for name, limit in list(undeclared.items()):
            await self.store.declare_limits(name, describe(limit))
            del undeclared[name]
            written = True
        return written

    async def tend(self, everything: bool = False) -> None:
        """Give back what has no use, renew what is due, forget gates left with nothing;
        ``everything``: give back every lane and slot held (nothing runs here any more)."""
        now = self.now()
        failed: StoreError | None = None
        for gate, lease in list(self._leases.items()):
            name = self.name_of(gate)
            limit = self.limits.get(name) or Limit()
            done = not limit or now - lease.wanted > IDLE
            if everything:
                lanes, slots = set(lease.lanes), set(lease.slots)
            else:
                lanes, slots = self._spare(gate, lease, limit, name, done, now)
            try:
                if lanes or slots:
                    await self._release(gate, name, lease, lanes, slots)
                elif lease and (renew_at := lease.renew_at()) is not None and now >= renew_at:
                    await self._renew(gate, name, lease)
            except StoreError as exc:
                failed = failed or exc  # the other gates are tended all the same
            self._fence(lease, self.now())  # renewed or not, a run on a slot about to lapse stops
            if not lease and now - lease.wanted > IDLE:
                del self._leases[gate]
        if failed is not None:
            raise failed

    def _spare(
        self, gate: str, lease: GateLease, limit: Limit, name: str, done: bool, now: float
    ) -> tuple[set[int], set[int]]:
        """What to give back: everything not in use once done with the gate; else lanes
        and slots past the limit or held since before its limits changed, and, when the
        lease is due for renewal, those not dealt to this worker (a worker that joined
        since may want them)."""
        lanes = {i for i, held in lease.lanes.items() if held.permit is None}
        slots = {j for j, held in lease.slots.items() if held.run is None and held.permit is None}
        if done:
            return lanes, slots
        size = limit.rate.limit if limit.rate else 0
        over = (
            {i for i in lanes if i >= size or lease.lanes[i].stale},
            {j for j in slots if j >= (limit.max_running or 0) or lease.slots[j].stale},
        )
        renew_at = lease.renew_at()
        if renew_at is not None and now >= renew_at:
            mine = self._mine(gate, limit, name)
            over[0].update(lanes - mine[0])
            over[1].update(slots - mine[1])
        return over

    async def close(self) -> None:
        """Give back every lane and slot this worker holds (shutdown)."""
        with suppress(StoreError):
            await self.tend(everything=True)
        if self.counts:
            log.info("gate round trips", **self.counts)


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _fewer_runs(old: Limit | None, new: Limit | None) -> bool:
    """Whether ``new`` allows fewer runs at once than ``old`` did."""
    before, after = old.max_running if old else None, new.max_running if new else None
    return after is not None and (before is None or after < before)


def describe(limit: Limit) -> dict[str, Any]:
    """A ``Limit`` as stored under ``declared`` in a limits document."""
    return {
        f.RATE_LIMIT: str(limit.rate) if limit.rate else None,
        f.MAX_RUNNING: limit.max_running,
        f.LIMIT_BY: limit.limit_by,
    }
