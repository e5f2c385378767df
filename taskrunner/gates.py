"""Fleet-wide limits per task name: the arithmetic of a *gate* (docs/limits.md).

A gate is one task name, or one value of its ``limit_by`` params field. Its document in
``<collection>.gates`` holds what every worker needs to start tasks of it within limits::

    {_id: 'call_api#"acme"', name: "call_api", version: 812, updated_at: ISODate(...),
     lanes: [{at: ISODate(...), prev: ISODate(...), holder: "9f2c..", from: ISODate(...),
              until: ISODate(...), hold: ISODate(...)}, ...],
     running: [{id: "77ab..", worker: "host-1-4242", until: ISODate(...)}, ...],
     throttled_until: ISODate(...)}

**Rate** ``N/period``: the gate has N *lanes*. A lane's ``at`` is the earliest time it may
start a task; a start at ``c`` moves it to ``c + period``. A worker takes a *permit*
on a lane (``holder``): the claim may start within ``[from, until]`` only, a condition
the server checks at ``$$NOW`` in the claim itself. While the claim is unsettled the lane
is at ``until + period``; the worker then settles it to ``c + period`` (or back to ``prev``
when it claimed nothing). Starts on one lane are at least ``period`` apart, so no window of
``period`` holds more than N starts: exact, whatever the workers' clocks say, and a lane
waits for no one but its last start.

**max_running** M: the ``running`` slots, at most M, each taken with the permit before the
claim and given back after the run's outcome is written, so at no instant do more than M
runs of the gate hold an entry. A slot lapses at its ``until`` unless its worker renews
it (a dead worker's slots free themselves, like its leases).

Workers change the document by compare-and-set on ``version``: read (or reuse the reply
of their last write), compute here, write only if nobody wrote in between.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from taskrunner.errors import InvalidTask
from taskrunner.models import UtcDatetime, first_error, parse_duration

SLACK = 2.0
"""Seconds after a permit's ``from`` within which its claim must reach the server. Long,
because a settled lane never waits for it; only a worker that dies holding the permit
delays its lane, by ``SLACK + period``."""
HOLD = 0.5
"""Seconds after ``until`` by which the holder settles its lane (it does within moments of
its claim); later, others take the lane as it stands, which counts a claim at ``until``."""
HORIZON = 1.0
"""How far ahead a permit may start: a worker waits no longer than this on a permit."""
EARLY = 0.5
"""How far before the asking worker's estimate of now a permit for a free lane opens, so
a claim is not refused because that estimate ran ahead of the server's clock."""
SLOT_POLL = 0.5
"""Seconds before asking again for a running slot: slots free when runs end, unannounced."""
IDLE = 0.5
"""Seconds a lane or slot stays unused before a worker past its fair share may take it."""
SLOT_LEASE = 30.0
"""Seconds a running slot lives without renewal (a dead worker's slots free after it)."""
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


class Lane(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    at: UtcDatetime = EPOCH
    prev: UtcDatetime | None = None
    holder: str | None = None
    from_: UtcDatetime | None = Field(None, alias="from")
    until: UtcDatetime | None = None
    hold: UtcDatetime | None = None

    def free(self) -> None:
        self.holder = self.from_ = self.until = self.hold = self.prev = None


class Slot(BaseModel):
    """A running slot: ``id`` is the permit holding it (None: free since ``freed``)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    worker: str | None = None
    until: UtcDatetime | None = None
    freed: UtcDatetime = EPOCH

    def free(self, now: datetime) -> None:
        self.id, self.worker, self.until, self.freed = None, None, None, now


class GateDoc(BaseModel):
    """One stored gate (see the module docstring)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    id: str = Field(alias="_id")
    name: str = ""
    shape: str | None = None
    """``"<lanes>/<slots>"``: writes of single lanes and slots expect it unchanged."""
    lanes: list[Lane] = Field(default_factory=list)
    running: list[Slot] = Field(default_factory=list)
    throttled_until: UtcDatetime | None = None

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


@dataclass(frozen=True, slots=True)
class Permit:
    """Leave to start one task of ``gate`` in ``[start, until]`` (server time)."""

    id: str
    gate: str
    start: datetime
    until: datetime
    lane: bool
    slot: bool


@dataclass(slots=True)
class Settlement:
    """What a worker reports at its next write: permits used (claim time) or not (None),
    running slots to give back, slots to renew."""

    used: dict[str, datetime | None] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    renew: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.used or self.released or self.renew)

    def merge(self, other: Settlement) -> None:
        self.used.update(other.used)
        self.released |= other.released
        self.renew |= other.renew


@dataclass(slots=True)
class Grant:
    permits: list[Permit]
    retry_at: datetime | None
    """When asking again may give more (None: nothing was missing)."""


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
    throttle: bool = False

    @classmethod
    def of(cls, seen: GateDoc) -> Change:
        return cls(seen, seen.model_copy(deep=True))

    def write(self) -> Write | None:
        """The write this change needs (None: nothing changed)."""
        seen, work = self.seen, self.work
        if seen.shape is None or seen.shape != work.shape_now():
            work.shape = work.shape_now()
            full = work.model_dump(by_alias=True, mode="python", exclude={"id"})
            return Write({"shape": seen.shape}, full, create=seen.shape is None)
        expect: dict[str, Any] = {"shape": seen.shape}
        changes: dict[str, Any] = {}
        for i in sorted(self.lanes):
            expect[f"lanes.{i}.holder"], expect[f"lanes.{i}.at"] = seen.lanes[i].holder, seen.lanes[i].at
            changes[f"lanes.{i}"] = work.lanes[i].model_dump(by_alias=True)
        for j in sorted(self.slots):
            expect[f"running.{j}.id"], expect[f"running.{j}.freed"] = (
                seen.running[j].id,
                seen.running[j].freed,
            )
            changes[f"running.{j}"] = work.running[j].model_dump()
        if self.throttle:
            expect["throttled_until"], changes["throttled_until"] = seen.throttled_until, work.throttled_until
        return Write(expect, changes) if changes else None


def settle(change: Change, settlement: Settlement, rate: Rate | None, now: datetime) -> None:
    """Apply a worker's report: used lanes move to their start plus the period, unused ones
    back to where they were; its slots of unused permits and finished runs are freed."""
    gate = change.work
    period = timedelta(seconds=rate.period) if rate else timedelta(0)
    for i, lane in enumerate(gate.lanes):
        if lane.holder is None or lane.holder not in settlement.used:
            continue
        started = settlement.used[lane.holder]
        lane.at = started + period if started is not None else (lane.prev or EPOCH)
        lane.free()
        change.lanes.add(i)
    gone = settlement.released | {p for p, started in settlement.used.items() if started is None}
    for j, slot in enumerate(gate.running):
        if slot.id is not None and slot.id in gone:
            slot.free(now)
            change.slots.add(j)
        elif slot.id is not None and slot.id in settlement.renew and slot.until is not None:
            slot.until = max(slot.until, now + timedelta(seconds=SLOT_LEASE))
            change.slots.add(j)


def resize(gate: GateDoc, limit: Limit, now: datetime) -> None:
    """N lanes for a rate of N, M slots for max_running M. Fewer lanes drop the free ones
    that free earliest, fewer slots the free ones (never a held one, so a smaller limit may
    take a moment to apply)."""
    wanted = limit.rate.limit if limit.rate else 0
    while len(gate.lanes) < wanted:
        gate.lanes.append(Lane())
    extra = len(gate.lanes) - wanted
    if extra > 0:
        free = sorted((lane for lane in gate.lanes if _lane_free(lane, now)), key=lambda lane: lane.at)
        dropped = {id(lane) for lane in free[:extra]}
        gate.lanes = [lane for lane in gate.lanes if id(lane) not in dropped]
    slots = limit.max_running or 0
    while len(gate.running) < slots:
        gate.running.append(Slot())
    extra = len(gate.running) - slots
    if extra > 0:
        free_slots = [slot for slot in gate.running if _slot_free(slot, now)][:extra]
        gate.running = [slot for slot in gate.running if all(slot is not f for f in free_slots)]


def _lane_free(lane: Lane, now: datetime) -> bool:
    """Nobody holds it, or its holder let its hold pass without settling."""
    return lane.holder is None or lane.hold is None or lane.hold <= now


def _slot_free(slot: Slot, now: datetime) -> bool:
    return slot.id is None or slot.until is None or slot.until <= now


def grant(
    change: Change,
    limit: Limit,
    want: int,
    worker: str,
    now: datetime,
    idle_extra: int = 0,
    prefer: frozenset[int] = frozenset(),
) -> Grant:
    """Up to ``want`` permits, none starting later than ``HORIZON``; then up to
    ``idle_extra`` more on lanes and slots nobody took for ``IDLE`` seconds."""
    gate = change.work
    resize(gate, limit, now)
    if gate.throttled_until is not None and gate.throttled_until > now:
        return Grant([], gate.throttled_until)
    horizon, idle = now + timedelta(seconds=HORIZON), now - timedelta(seconds=IDLE)
    lanes = (
        _lanes_by_preference(gate, now, change.lanes, prefer) if limit.rate else [None] * (want + idle_extra)
    )
    slots = [j for j, slot in enumerate(gate.running) if _slot_free(slot, now)]
    random.shuffle(slots)
    permits: list[Permit] = []
    for i in lanes:
        lane = gate.lanes[i] if i is not None else None
        if lane is not None and lane.at > horizon:
            break
        extra = len(permits) >= want
        if len(permits) >= want + idle_extra or (extra and lane is not None and lane.at > idle):
            break
        slot = _pick_slot(gate, slots, limit, idle if extra else None)
        if limit.max_running is not None and slot is None:
            break
        permits.append(_take(change, i, slot, limit, worker, now))
    enough = len(permits) >= want
    return Grant(permits, None if enough else _retry_at(gate, limit, now))


def _lanes_by_preference(
    gate: GateDoc, now: datetime, own: set[int], prefer: frozenset[int]
) -> list[int | None]:
    """Free lanes open now, then those opening later, soonest first. Among equals: lanes
    this write just settled (nobody else can have taken them), then the asking worker's
    preferred lanes (each lane prefers one live worker, so workers asking at once rarely
    reach for the same lane), then the rest in random order."""
    free = [i for i, lane in enumerate(gate.lanes) if _lane_free(lane, now)]
    random.shuffle(free)
    free.sort(key=lambda i: (i not in own, i not in prefer))
    open_now = [i for i in free if gate.lanes[i].at <= now]
    later = sorted((i for i in free if gate.lanes[i].at > now), key=lambda i: gate.lanes[i].at)
    return [*open_now, *later]


def preferred_lanes(gate: str, lanes: int, worker: str, peers: list[str]) -> frozenset[int]:
    """The lanes of ``gate`` that prefer ``worker`` among the live ``peers`` (itself
    included): each lane prefers the peer of highest rendezvous hash, so every worker
    computes the same split without talking to the others."""

    def score(peer: str, lane: int) -> bytes:
        return hashlib.blake2b(f"{gate}:{lane}:{peer}".encode(), digest_size=8).digest()

    return frozenset(i for i in range(lanes) if max(peers, key=lambda p: score(p, i)) == worker)


def _pick_slot(gate: GateDoc, slots: list[int], limit: Limit, idle: datetime | None) -> int | None:
    if limit.max_running is None:
        return None
    for j in slots:
        if idle is None or gate.running[j].freed <= idle:
            slots.remove(j)
            return j
    return None


def _take(change: Change, i: int | None, j: int | None, limit: Limit, worker: str, now: datetime) -> Permit:
    gate, pid = change.work, uuid.uuid4().hex
    lane = gate.lanes[i] if i is not None else None
    start = max(now - timedelta(seconds=EARLY), lane.at if lane is not None else EPOCH)
    until = max(start, now) + timedelta(seconds=SLACK)
    if lane is not None and i is not None and limit.rate is not None:
        lane.prev, lane.holder, lane.from_, lane.until = lane.at, pid, start, until
        lane.hold = until + timedelta(seconds=HOLD)
        lane.at = until + timedelta(seconds=limit.rate.period)
        change.lanes.add(i)
    if j is not None:
        gate.running[j] = Slot(id=pid, worker=worker, until=now + timedelta(seconds=SLOT_LEASE), freed=EPOCH)
        change.slots.add(j)
    return Permit(pid, gate.id, start, until, lane is not None, j is not None)


def _retry_at(gate: GateDoc, limit: Limit, now: datetime) -> datetime:
    """When asking again may give a permit: a free lane coming within the horizon, a held
    one being settled (soon after its start), a slot lapsing; never before ``now``."""
    times: list[datetime] = []
    if limit.rate is not None:
        ahead = timedelta(seconds=max(0.0, limit.rate.period - HORIZON) + 0.05)
        free = [lane.at for lane in gate.lanes if _lane_free(lane, now)]
        held = [
            lane.from_ + ahead for lane in gate.lanes if not _lane_free(lane, now) and lane.from_ is not None
        ]
        if free:
            times.append(min(free) - timedelta(seconds=HORIZON))
        if held:
            times.append(min(held))
    if limit.max_running is not None and not any(_slot_free(s, now) for s in gate.running):
        ends = [s.until for s in gate.running if s.until is not None]
        times.append(min([now + timedelta(seconds=SLOT_POLL), *ends]))
    return max(now, min(times)) if times else now + timedelta(seconds=SLOT_POLL)
