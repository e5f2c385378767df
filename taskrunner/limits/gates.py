"""Fleet-wide limits per task name: the arithmetic of a *gate* (docs/limits.md).

A gate is one task name, or one value of its ``limit_by`` params field. Its document in
``<collection>.gates`` says which worker holds which part of the limit::

    {_id: 'call_api#"acme"', name: "call_api", shape: "50/3", updated_at: ISODate(...),
     lanes: [{holder: "host-1-4242", until: ISODate(...), next: ISODate(...)}, ...],
     running: [{holder: "host-2-77", until: ISODate(...), freed: ISODate(...)}, ...]}

**Rate** ``N/period``: the gate has N *lanes*. A worker *leases* lanes (``holder``, until
``until``, renewed while it has use for them) and starts tasks on them without asking
anyone: each start on a lane is a claim the server takes only while its clock is within
``[next, until]`` of that lane (a condition on ``$$NOW`` in the claim itself), and the
lane's next start is then the claim's time plus the period. Starts on one lane are at
least a period apart, so no window of ``period`` holds more than N starts, whatever the
workers' clocks say. A lane given back records its ``next``; a lane whose lease lapsed
(its worker died) opens at ``until + period``, after any start its holder could have made.

**max_running** M: M running *slots*, leased the same way; a worker runs at most one task
per slot it holds, from before the claim until the run's outcome is written, and claims
only within the slot's lease, so at no instant do more than M runs of the gate hold an
entry. A dead worker's slots lapse with its lease.

So a worker writes the gate when it takes, renews (every ``LEASE / 3``) or gives back
lanes and slots, never per task: a limited name costs about what an unlimited one does.
Lanes and slots are dealt round-robin over the live workers (``dealt``), so workers
never compete for them; writes are conditional on each lane and slot they touch as read.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from taskrunner.errors import InvalidTask
from taskrunner.models import UtcDatetime, first_error, parse_duration

LEASE = 30.0
"""Seconds a worker holds lanes and slots without renewing them (renewed every third of
it): how long a dead worker's share of a limit stays unused."""
IDLE = LEASE
"""Seconds a worker keeps lanes and slots it has no task for before giving them back.
Nobody else takes a live worker's lanes, so keeping them costs only renewals; giving
them back stops those for gates that went quiet (one per ``limit_by`` value)."""
MARGIN = 0.002
"""Seconds past a lane's next start, beyond the error bound of this worker's estimate of
the server's clock, before claiming on it (the server's clock counts milliseconds): a
claim that comes too early is refused."""
FENCE = 2.0
"""Seconds before a running slot's lease ends, by the worker's clock, at which a run on
it stops unless the lease was renewed: another worker may take the slot once it ends,
and the worker's estimate of the server's clock and its last write may be that late."""
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(.+?)\s*$")


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``limit`` starts in any window of ``period`` seconds."""

    limit: int
    period: float

    def __str__(self) -> str:
        return f"{self.limit}/{self.period:g}s"


def parse_rate(text: object, field: str = "rate_limit") -> Rate:
    """``"100/m"``, ``"50/s"``, ``"10/5s"``, ``"1000/h"``: starts per period."""
    match = _RATE.match(text) if isinstance(text, str) else None
    try:
        if match is None:
            raise ValueError
        unit = match.group(2)
        period = parse_duration(unit if unit[0].isdigit() else f"1{unit}")
        limit = int(match.group(1))
    except ValueError:
        raise InvalidTask(field, f"must be N/period like '100/m', '50/s' or '10/5s', got {text!r}") from None
    if not 1 <= limit <= 10_000 or not 0.01 <= period <= 86_400 * 7:
        raise InvalidTask(field, f"needs 1 .. 10000 starts per 0.01 s .. 7 d, got {text!r}")
    return Rate(limit, period)


def check_max_running(value: object, field: str = "max_running") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidTask(field, f"must be a whole number of at least 1, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Limit:
    """A task name's fleet-wide limits: declared in code, overridden by operators."""

    rate: Rate | None = None
    max_running: int | None = None
    limit_by: str | None = None

    def __bool__(self) -> bool:
        return self.rate is not None or self.max_running is not None

    def describe(self) -> str:
        parts = [
            f"rate {self.rate}" if self.rate else "",
            f"max_running {self.max_running}" if self.max_running else "",
        ]
        text = ", ".join(p for p in parts if p) or "none"
        return f"{text} per {self.limit_by}" if self.limit_by and self else text


def gate_id(name: str, limit_by: str | None, params: Any) -> str:
    """The gate of a task: its name, or its name and the JSON of its ``limit_by`` value."""
    if limit_by is None:
        return name
    value = params.get(limit_by) if isinstance(params, Mapping) else None
    return f"{name}#{json.dumps(value, sort_keys=True, default=str)}"


class _Leased(BaseModel):
    """A lane or slot: ``holder`` has it until ``until`` unless it renews."""

    model_config = ConfigDict(extra="ignore")

    holder: str | None = None
    until: UtcDatetime | None = None
    freed: UtcDatetime = EPOCH
    """When it was last given back (or made)."""

    def free(self, now: datetime) -> bool:
        return self.holder is None or self.until is None or self.until <= now


class Lane(_Leased):
    """``holder`` may start tasks on it until ``until``; a free lane opens at ``next``."""

    next: UtcDatetime = EPOCH

    def opens(self, period: float) -> datetime:
        """When a new holder may start on it: after its last start, and after anything a
        holder whose lease lapsed could have started."""
        if self.holder is None or self.until is None:
            return self.next
        return max(self.next, self.until + timedelta(seconds=period))


class Slot(_Leased):
    """A running slot: ``holder`` runs one task at a time on it until ``until``."""


class GateDoc(BaseModel):
    """One stored gate (see the module docstring)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    id: str = Field(alias="_id")
    name: str = ""
    shape: str | None = None
    """``"<lanes>/<slots>"``: writes of single lanes and slots expect it unchanged."""
    lanes: list[Lane] = Field(default_factory=list)
    running: list[Slot] = Field(default_factory=list)

    @classmethod
    def read(cls, doc: Mapping[str, Any] | None, gate: str, name: str) -> tuple[GateDoc, str | None]:
        """The stored gate (a fresh one when absent) and what was wrong with it, if anything:
        an unreadable gate starts over rather than stopping the name."""
        if doc is None:
            return cls.model_validate({"_id": gate, "name": name}), None
        try:
            return cls.model_validate(doc), None
        except ValidationError as exc:
            # Overwritten whole by the next write, which expects the shape it saw.
            shape = doc.get("shape")
            fresh = cls.model_validate(
                {"_id": gate, "name": name, "shape": shape if isinstance(shape, str) else None}
            )
            return fresh, first_error(exc)

    def shape_now(self) -> str:
        return f"{len(self.lanes)}/{len(self.running)}"

    def started_within_period(self, now: datetime) -> int:
        """Lanes with a start in the last period (a lane's ``next`` is its last start plus
        the period): the rate used right now, out of ``len(lanes)``."""
        return sum(lane.next > now for lane in self.lanes)


@dataclass(slots=True)
class HeldLane:
    """A lane this worker leases: its next start and the lease's end (server times)."""

    next: datetime
    until: datetime
    permit: str | None = None
    """The permit using it right now (a claim on its way)."""
    leaving: bool = False
    """Being given back: it starts nothing more."""
    stale: bool = False
    """Held when the gate's limits changed: it starts nothing more and goes back once
    free (the new limits may deal it to another worker)."""
    ready: float = 0.0
    """When to claim on it, by this worker's estimate of server time: its next start plus
    the estimate's error bound and ``MARGIN``, which the server's clock has then passed
    (a claim is never refused for coming early, and none waits longer than that: a lane
    claimed a reply's time late would lose that time every period)."""


@dataclass(slots=True)
class HeldSlot:
    until: datetime
    run: str | None = None
    """The run holding it, from its claim until its outcome is written."""
    permit: str | None = None
    leaving: bool = False
    """Being given back: it starts nothing more."""
    stale: bool = False
    """Held when the gate's limits changed: it starts nothing more and goes back once
    free, so a lowered max_running counts the runs still on such slots."""
    fenced: bool = False
    """Its lease ended without a renewal and its run was told to stop."""


@dataclass(frozen=True, slots=True)
class Permit:
    """Leave to start one task of ``gate`` within ``[start, until]`` (server time) on
    this worker's lane ``lane`` and running slot ``slot`` (None: the gate has none)."""

    id: str
    gate: str
    start: datetime
    until: datetime
    lane: int | None
    slot: int | None
    throttled: bool = False
    """Its start is a throttle's end (``RateLimited``), which the server's clock may not
    have reached when this worker's estimate says it has: a claim refused then came early."""


@dataclass(slots=True)
class GateLease:
    """What one worker holds of one gate, and when it last had a use for it."""

    lanes: dict[int, HeldLane] = field(default_factory=dict)
    slots: dict[int, HeldSlot] = field(default_factory=dict)
    wanted: float = 0.0
    """Until when this worker has a use for it: a task of the gate was queued, asked, or
    will look again (its estimate of server time)."""
    retry: float = 0.0
    """Asking the gate for more before this gives nothing new."""
    misses: int = 0
    starved: bool = False
    """The last ask got nothing while this worker holds nothing of the gate."""

    def __bool__(self) -> bool:
        return bool(self.lanes or self.slots)

    def retire(self, lanes: frozenset[int], slots: frozenset[int]) -> None:
        """The gate's limits changed: what is held other than these lanes and slots (those
        the new limits deal to this worker) starts nothing more (``stale``)."""
        for i, lane in self.lanes.items():
            lane.stale = lane.stale or i not in lanes
        for j, slot in self.slots.items():
            slot.stale = slot.stale or j not in slots

    def retiring(self) -> bool:
        """Whether a stale lane or slot is held (it goes back once free)."""
        return any(h.stale for h in self.lanes.values()) or any(h.stale for h in self.slots.values())

    def renew_at(self) -> float | None:
        untils = [h.until for h in self.lanes.values()] + [h.until for h in self.slots.values()]
        return min(untils).timestamp() - LEASE * 2 / 3 if untils else None

    def permits(self, gate: str, limit: Limit, want: int, now: datetime) -> list[Permit]:
        """Up to ``want`` permits open at ``now``: a lane whose next start has come (when
        the gate has a rate) and a free slot (when it has max_running), each used once."""
        lanes, slots = self._open_lanes(limit, now), self._free_slots(limit, now)
        permits: list[Permit] = []
        while len(permits) < want:
            if (limit.rate and not lanes) or (limit.max_running and not slots):
                break
            i, j = (lanes.pop(0) if limit.rate else None), (slots.pop(0) if limit.max_running else None)
            lane, slot = (
                (self.lanes[i] if i is not None else None),
                (self.slots[j] if j is not None else None),
            )
            ends = [*([lane.until] if lane else []), *([slot.until] if slot else [])]
            permit = Permit(uuid.uuid4().hex, gate, lane.next if lane else EPOCH, min(ends), i, j)
            if lane is not None:
                lane.permit = permit.id
            if slot is not None:
                slot.permit = permit.id
            permits.append(permit)
        return permits

    def open(self, limit: Limit, now: datetime) -> bool:
        """Whether a permit could start now."""
        lanes_ok = not limit.rate or bool(self._open_lanes(limit, now))
        return lanes_ok and (not limit.max_running or bool(self._free_slots(limit, now)))

    def _free_slots(self, limit: Limit, now: datetime) -> list[int]:
        """Slots within the limit in force that could start a run now."""
        size = limit.max_running or 0
        return [
            j
            for j, s in self.slots.items()
            if j < size
            and s.run is None
            and s.permit is None
            and not (s.stale or s.leaving)
            and s.until > now
        ]

    def _open_lanes(self, limit: Limit, now: datetime) -> list[int]:
        """Lanes within the rate in force whose next start has come."""
        if not limit.rate:
            return []
        at, size = now.timestamp(), limit.rate.limit
        open_ = [
            i
            for i, h in self.lanes.items()
            if i < size
            and h.permit is None
            and not (h.leaving or h.stale)
            and h.ready <= at
            and h.until > now
        ]
        return sorted(open_, key=lambda i: self.lanes[i].ready)

    def opens_at(self, limit: Limit, waiting: int, now: datetime) -> list[float]:
        """When each of ``waiting`` tasks may find an open lane (its k-th opening, lanes
        reused every period, leases renewed meanwhile), or nothing without lanes. Waiting
        tasks sleep until then: waking them sooner costs CPU and finds nothing."""
        if not limit.rate:
            return []
        period, now_s = limit.rate.period, now.timestamp()
        # A lane with a claim on its way opens a period after that claim's reply at the
        # earliest, so about a period from now.
        times = sorted(
            h.ready if h.permit is None else max(h.ready, now_s) + period
            for i, h in self.lanes.items()
            if i < limit.rate.limit and not h.stale
        )
        out: list[float] = []
        for k in range(waiting if times else 0):
            out.append(times[k % len(times)] + period * (k // len(times)))
        return out

    def used(
        self, permit: Permit, started: datetime | None, period: float, run: str | None, margin: float
    ) -> None:
        """The claim with ``permit`` started at ``started`` (None: it claimed nothing); its
        lane opens again a period later, claimed on ``margin`` seconds after that by this
        worker's estimate of server time (its error bound and ``MARGIN``)."""
        lane = self.lanes.get(permit.lane) if permit.lane is not None else None
        if lane is not None and lane.permit == permit.id:
            lane.permit = None
            if started is not None:
                lane.next = max(lane.next, started + timedelta(seconds=period))
                lane.ready = max(lane.ready, lane.next.timestamp() + margin)
        slot = self.slots.get(permit.slot) if permit.slot is not None else None
        if slot is not None and slot.permit == permit.id:
            slot.permit = None
            slot.run = run if started is not None else None

    def finished(self, run: str) -> bool:
        for slot in self.slots.values():
            if slot.run == run:
                slot.run = None
                return True
        return False

    def slot_of(self, run: str) -> HeldSlot | None:
        """The running slot ``run`` holds, if this lease still has it."""
        return next((slot for slot in self.slots.values() if slot.run == run), None)

    def usable_slots(self, limit: Limit) -> bool:
        """Whether it holds a slot that can start runs under ``limit`` (now or once free)."""
        return any(j < (limit.max_running or 0) and not s.stale for j, s in self.slots.items())


@dataclass(slots=True)
class Write:
    """A conditional write of a gate: every ``expect`` path (dotted, with array indexes)
    must hold its value (None: null or missing), then ``changes`` are set. Writes of
    different lanes and slots commute, so workers rarely get in each other's way."""

    expect: dict[str, Any]
    changes: dict[str, Any]
    create: bool = False


@dataclass(slots=True)
class Change:
    """A gate being changed by one worker: the document as read, the working copy, and
    which lanes and slots the write must carry."""

    seen: GateDoc
    work: GateDoc
    lanes: set[int] = field(default_factory=set)
    slots: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, seen: GateDoc) -> Change:
        return cls(seen, seen.model_copy(deep=True))

    def write(self) -> Write | None:
        """The write this change needs (None: nothing changed). A new shape rewrites the
        whole document, expecting every lane and slot as seen: a lease renewed meanwhile
        must not be turned back."""
        seen, work = self.seen, self.work
        if seen.shape is None or seen.shape != work.shape_now():
            work.shape = work.shape_now()
            full = work.model_dump(mode="python", exclude={"id"})
            every = range(len(seen.lanes)), range(len(seen.running))
            return Write(self._expect(*every), full, create=seen.shape is None)
        changes = {f"lanes.{i}": work.lanes[i].model_dump() for i in sorted(self.lanes)}
        changes |= {f"running.{j}": work.running[j].model_dump() for j in sorted(self.slots)}
        return Write(self._expect(self.lanes, self.slots), changes) if changes else None

    def _expect(self, lanes: Iterable[int], slots: Iterable[int]) -> dict[str, Any]:
        """Each lane's holder, lease and next start as seen (a lane given back changes only
        its next start), each slot's holder and lease."""
        expect = dict[str, Any](shape=self.seen.shape)
        for i in lanes:
            expect.update({f"lanes.{i}.{k}": v for k, v in self.seen.lanes[i].model_dump().items()})
        for j in slots:
            slot = self.seen.running[j]
            expect.update({f"running.{j}.holder": slot.holder, f"running.{j}.until": slot.until})
        return expect


def resize(gate: GateDoc, limit: Limit, now: datetime) -> None:
    """N lanes for a rate of N, M slots for max_running M. Fewer drops free ones from the
    end only (indexes are how holders know their lanes): the workers holding the last
    ones start nothing on them under the smaller limit and give them back once free."""
    wanted = limit.rate.limit if limit.rate else 0
    while len(gate.lanes) < wanted:
        gate.lanes.append(Lane(freed=now))
    while len(gate.lanes) > wanted and gate.lanes[-1].free(now):
        gate.lanes.pop()
    slots = limit.max_running or 0
    while len(gate.running) < slots:
        gate.running.append(Slot(freed=now))
    while len(gate.running) > slots and gate.running[-1].free(now):
        gate.running.pop()


def take(
    change: Change,
    limit: Limit,
    worker: str,
    now: datetime,
    mine: tuple[frozenset[int], frozenset[int]],
    margin: float = MARGIN,
) -> tuple[dict[int, HeldLane], dict[int, HeldSlot]]:
    """GateLease the lanes and slots dealt to this worker (``mine``, see ``dealt``) that are
    free, until ``now + LEASE``. Only those: a worker with more tasks than its lanes start
    leaves them to the other workers, which take them on with their own lanes, so lanes
    never change hands while their workers live. ``margin``: see ``HeldLane.ready``."""
    gate, until = change.work, lease_end(now)
    resize(gate, limit, now)
    period = limit.rate.period if limit.rate else 0.0
    held: dict[int, HeldLane] = {}
    for i in sorted(mine[0]):
        if i < _size(limit.rate) and gate.lanes[i].free(now):
            opens = gate.lanes[i].opens(period)
            gate.lanes[i] = Lane(holder=worker, until=until, next=opens, freed=gate.lanes[i].freed)
            held[i] = HeldLane(opens, until, ready=opens.timestamp() + margin)
            change.lanes.add(i)
    free_slots = [j for j, slot in enumerate(gate.running[: limit.max_running or 0]) if slot.free(now)]
    # Slots past a lowered limit still held (by runs from before the change) count: no
    # more than max_running slots are held at once.
    room = (limit.max_running or 0) - sum(not slot.free(now) for slot in gate.running)
    got: dict[int, HeldSlot] = {}
    for j in [j for j in free_slots if j in mine[1]][: max(0, room)]:
        gate.running[j] = Slot(holder=worker, until=until, freed=gate.running[j].freed)
        got[j] = HeldSlot(until)
        change.slots.add(j)
    return held, got


def lease_end(now: datetime) -> datetime:
    """``now + LEASE`` to the millisecond, as the server stores it: writes expect it back."""
    end = now + timedelta(seconds=LEASE)
    return end.replace(microsecond=end.microsecond // 1000 * 1000)


def _size(rate: Rate | None) -> int:
    return rate.limit if rate else 0


def renew(change: Change, lease: GateLease, worker: str, now: datetime) -> None:
    """Extend the lease of every lane and slot ``lease`` holds that the gate still names
    this worker the holder of; forget the others (their lease lapsed and someone took
    them, or they were given back). Only this worker writes its own id, so a later
    ``until`` than it knows is its own renewal whose reply was lost: still its own."""
    gate, until = change.work, lease_end(now)
    for i, held in list(lease.lanes.items()):
        if i < len(gate.lanes) and gate.lanes[i].holder == worker:
            gate.lanes[i] = Lane(holder=worker, until=until, next=held.next, freed=gate.lanes[i].freed)
            change.lanes.add(i)
        else:
            del lease.lanes[i]
    for j in list(lease.slots):
        if j < len(gate.running) and gate.running[j].holder == worker:
            gate.running[j] = Slot(holder=worker, until=until, freed=gate.running[j].freed)
            change.slots.add(j)
        else:
            del lease.slots[j]


def release(
    change: Change, lease: GateLease, worker: str, now: datetime, lanes: set[int], slots: set[int]
) -> None:
    """Give back these lanes and slots of ``lease`` that the gate still names this worker
    the holder of (see ``renew``); a lane records its next start."""
    gate = change.work
    for i in lanes & set(lease.lanes):
        held = lease.lanes.pop(i)
        if i < len(gate.lanes) and gate.lanes[i].holder == worker:
            gate.lanes[i] = Lane(next=held.next, freed=now)
            change.lanes.add(i)
    for j in slots & set(lease.slots):
        lease.slots.pop(j)
        if j < len(gate.running) and gate.running[j].holder == worker:
            gate.running[j] = Slot(freed=now)
            change.slots.add(j)


def dealt(gate: str, size: int, worker: str, peers: list[str]) -> frozenset[int]:
    """The lanes (or slots) of ``gate`` dealt to ``worker`` among the live ``peers``
    (itself included): round-robin over the sorted peers from a start that depends on the
    gate, so shares differ by at most one, gates with few lanes do not all go to the same
    worker, and every worker computes the same split without talking to the others."""
    order = _dealing_order(gate, [*peers, worker])
    return frozenset(i for i in range(size) if order[i % len(order)] == worker)


def dealt_to(gate: str, limit: Limit, peers: list[str]) -> list[str] | None:
    """The workers dealt both a lane and a slot of ``gate`` (what a start needs), when
    the limit is smaller than the fleet; None when every worker gets some. Only they
    should own the gate's tasks: the others could never start them."""
    sizes = [size for size in (limit.rate.limit if limit.rate else None, limit.max_running) if size]
    order = _dealing_order(gate, peers)
    return order[: min(sizes)] if sizes and min(sizes) < len(order) else None


def _dealing_order(gate: str, peers: list[str]) -> list[str]:
    """The sorted workers, rotated to start at a place that depends on the gate."""
    order = sorted(set(peers))
    start = int.from_bytes(hashlib.blake2b(gate.encode(), digest_size=4).digest(), "big") % len(order)
    return order[start:] + order[:start]
