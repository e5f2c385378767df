"""When a schedule fires: cron expressions in a time zone, fixed intervals, and catch-up.

Cron expressions are read by cronsim (5 fields, or 6 with a leading seconds field): it
is typed, dependency-free and matches Debian cron field by field. Its Debian-style DST
handling (running a skipped job after the jump) is not what we promise, so ticks are
computed on naive wall-clock times and mapped to UTC here:

- a wall-clock time that does not exist (the hour skipped when clocks go forward) is
  skipped: no task for it;
- a wall-clock time that occurs twice (clocks go back) fires once, at its first
  occurrence.

``every=`` ticks are multiples of the interval since the Unix epoch (UTC), so every
worker computes the same ticks without talking to the others (BullMQ's ``every``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from taskrunner.errors import InvalidSchedule

CatchUp = Literal["latest", "all", "none"]
CATCH_UPS: tuple[str, ...] = ("latest", "all", "none")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_SEARCH_LIMIT = 100_000  # candidate wall-clock times examined per lookup (a DST gap skips a few)


@dataclass(frozen=True)
class Recurrence:
    """A cron expression in a time zone, or a fixed interval."""

    cron: str | None
    every: timedelta | None
    timezone: str = "UTC"

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    @property
    def expression(self) -> str:
        """How the CLI and the schedule document show it."""
        if self.cron is not None:
            return self.cron
        assert self.every is not None
        return f"every {_seconds(self.every)}s"

    def after(self, t: datetime) -> datetime:
        """The first tick strictly after ``t`` (UTC)."""
        if self.every is not None:
            return EPOCH + ((t - EPOCH) // self.every + 1) * self.every
        for tick in self._walk(t, reverse=False):
            if tick > t:
                return tick
        raise InvalidSchedule("cron", f"{self.cron!r} has no time after {t.isoformat()}")

    def latest(self, t: datetime) -> datetime | None:
        """The last tick at or before ``t`` (UTC), if any."""
        if self.every is not None:
            return EPOCH + ((t - EPOCH) // self.every) * self.every
        return next((tick for tick in self._walk(t, reverse=True) if tick <= t), None)

    def upcoming(self, t: datetime, count: int) -> list[datetime]:
        ticks: list[datetime] = []
        for _ in range(count):
            t = self.after(t)
            ticks.append(t)
        return ticks

    def between(self, since: datetime, until: datetime, limit: int) -> list[datetime]:
        """Up to ``limit`` ticks in ``(since, until]``, the latest ones, oldest first."""
        ticks: list[datetime] = []
        tick = self.latest(until)
        while tick is not None and tick > since and len(ticks) < limit:
            ticks.append(tick)
            tick = self.latest(tick - _US)
        return ticks[::-1]

    def _walk(self, t: datetime, *, reverse: bool) -> Iterator[datetime]:
        """Cron ticks around ``t`` in UTC, from wall-clock candidates in the zone."""
        assert self.cron is not None
        zone = self.zone
        local = t.astimezone(zone)
        start = local.replace(tzinfo=None)
        if reverse:
            if local.fold and _ambiguous(start, zone):
                # t is in the repeated hour's second pass: its first pass is earlier in
                # real time but later on the wall clock, so start from that pass's end.
                start += _offset(start, zone, 0) - _offset(start, zone, 1)
            start = start if start.microsecond else start + _US  # cronsim: strictly before
        candidates = CronSim(self.cron, start, reverse=reverse)
        for _, wall in zip(range(_SEARCH_LIMIT), candidates, strict=False):
            tick = _to_utc(wall, zone)
            if tick is not None:
                yield tick


def parse(*, cron: str | None, every: timedelta | float | None, timezone: str = "UTC") -> Recurrence:
    """Validate a schedule's timing; errors name the field (``cron``, ``every``, ``timezone``)."""
    if (cron is None) == (every is None):
        raise InvalidSchedule("cron", "give exactly one of cron= and every=")
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise InvalidSchedule("timezone", f"unknown time zone {timezone!r}") from None
    if every is not None:
        interval = duration("every", every)
        if interval <= timedelta(0):
            raise InvalidSchedule("every", f"must be a positive duration, not {interval}")
        return Recurrence(None, interval, timezone)
    if not isinstance(cron, str):
        raise InvalidSchedule("cron", f"must be a string, not {type(cron).__name__}")
    try:
        CronSim(cron, datetime(2000, 1, 1))
    except (CronSimError, ValueError, IndexError) as exc:
        raise InvalidSchedule("cron", f"invalid cron expression {cron!r}: {exc}") from None
    return Recurrence(cron.strip(), None, timezone)


def due(
    recurrence: Recurrence,
    *,
    since: datetime,
    now: datetime,
    catch_up: CatchUp,
    max_catch_up: int,
    grace: float,
) -> list[datetime]:
    """The ticks to fire now: ticks in ``(since, now]`` no older than ``grace`` seconds are
    on time and all fire; older ones were missed (no worker was up, or all were stalled)
    and ``catch_up`` decides: the latest of them (only if none is on time), up to
    ``max_catch_up`` of them, or none."""
    limit = max_catch_up if catch_up == "all" else 1
    recent = recurrence.between(max(since, now - timedelta(seconds=grace)), now, 10_000)
    oldest_on_time = recent[0] if recent else now
    missed = recurrence.between(since, oldest_on_time - _US, limit)
    if catch_up == "none" or (catch_up == "latest" and recent):
        missed = []
    return [*missed, *recent]


def tick_key(schedule_id: str, tick: datetime) -> str:
    """The key of a tick's task: ``<schedule id>@<tick, UTC ISO 8601>``."""
    return f"{schedule_id}@{iso(tick)}"


def iso(t: datetime) -> str:
    text = t.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="auto")
    return f"{text}Z"


def _to_utc(wall: datetime, zone: ZoneInfo) -> datetime | None:
    """The first real instant showing ``wall`` in ``zone``; None if it never does."""
    first = wall.replace(tzinfo=zone, fold=0)
    if first.astimezone(UTC).astimezone(zone).replace(tzinfo=None) != wall:
        return None  # in a DST gap
    return first.astimezone(UTC)


def _offset(wall: datetime, zone: ZoneInfo, fold: int) -> timedelta:
    offset = wall.replace(tzinfo=zone, fold=fold).utcoffset()
    assert offset is not None
    return offset


def _ambiguous(wall: datetime, zone: ZoneInfo) -> bool:
    return _offset(wall, zone, 0) != _offset(wall, zone, 1)


def duration(field: str, value: timedelta | float) -> timedelta:
    """A ``timedelta`` or a finite number of seconds, as a ``timedelta``; errors name ``field``."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise InvalidSchedule(field, f"must be a duration or a number of seconds, not {value!r}")
    try:
        return timedelta(seconds=value)
    except OverflowError:
        raise InvalidSchedule(field, f"{value!r} seconds is too long") from None


def _seconds(interval: timedelta) -> str:
    value = interval.total_seconds()
    return str(int(value)) if value == int(value) else str(value)
