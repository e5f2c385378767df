"""Recurring schedules: declared in code, stored in ``<collection>.schedules``, fired by workers.

Every worker whose app declares a schedule fires it; nothing elects a leader. A tick's
task has the key ``<schedule id>@<tick, UTC ISO 8601>``, so when several workers fire
the same tick the idempotent publish keeps one task. To spare the server, the
schedule's owner (rendezvous hash over the live workers that declare it, as for tasks)
fires at the tick and the others one second later per rank, each after reading the
schedule document: a tick already recorded there is not published again. A worker that
dies between publishing and recording leaves a tick the next one publishes again, which
returns the existing task. Ticks are computed from the server's clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from taskrunner.errors import InvalidSchedule
from taskrunner.models import NewTask, Task, Unreadable, UtcDatetime, first_error, invalid_task
from taskrunner.observability.logs import get_logger
from taskrunner.schedules.recurrence import (
    CATCH_UPS,
    CatchUp,
    Recurrence,
    duration,
    iso,
    parse,
    tick_key,
)

log = get_logger("taskrunner.schedules")
DEFAULT_GRACE = 5.0  # seconds after its time a tick still counts as on time (not missed)
MIN_EVERY = timedelta(seconds=1)
"""The shortest ``every``: the finest tick a cron expression names (its seconds field), and
the scheduler's step (workers back each other up a second apart, each after reading the
schedule). Work due more often than that is a loop in a handler or a worker, not a schedule."""


class Schedule(BaseModel):
    """A schedule as declared in code (``TaskRunner.schedule``); its definition fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1)
    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    priority: int = 0
    options: dict[str, Any] = Field(default_factory=dict)
    cron: str | None = None
    every: float | None = None
    """Seconds between ticks (``every=`` as a number in the document)."""
    timezone: str = "UTC"
    catch_up: CatchUp = "latest"
    max_catch_up: int = Field(10, ge=1)
    jitter: float = Field(0.0, ge=0)
    grace: float = Field(DEFAULT_GRACE, gt=0)

    @property
    def recurrence(self) -> Recurrence:
        return parse(cron=self.cron, every=self.every, timezone=self.timezone)

    def definition(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if k != "id"}

    def task(self, tick: datetime) -> NewTask:
        """The tick's task; jitter delays it by a fraction of ``jitter`` that the key decides,
        so workers racing for one tick publish the same run time."""
        key = tick_key(self.id, tick)
        spread = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest()) / 2**32
        return self._task(key, tick + timedelta(seconds=self.jitter * spread))

    def triggered(self, now: datetime) -> NewTask:
        """The task ``trigger`` publishes: due now, keyed ``<id>@trigger-<now>``."""
        return self._task(f"{self.id}@trigger-{iso(now)}", None)

    def _task(self, key: str, run_at: datetime | None) -> NewTask:
        return NewTask.model_validate(
            {
                "key": key,
                "name": self.name,
                "params": self.params,
                "priority": self.priority,
                "options": self.options,
                "run_at": run_at,
            }
        )


class ScheduleState(Schedule):
    """A schedule document as stored: the definition last declared plus its state."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    id: str = Field(alias="_id", min_length=1)
    paused: bool = False
    next_at: UtcDatetime | None = None
    last_tick: UtcDatetime | None = None
    last_key: str | None = None
    created_at: UtcDatetime | None = None
    updated_at: UtcDatetime | None = None
    declared_at: UtcDatetime | None = None
    resumed_at: UtcDatetime | None = None

    @classmethod
    def read(cls, doc: Mapping[str, Any]) -> ScheduleState | Unreadable:
        """The document, or what is wrong with it (edited by hand)."""
        try:
            state = cls.model_validate(doc)
            state.recurrence  # noqa: B018 - validates cron, every and timezone
        except ValidationError as exc:
            return Unreadable.of(doc, first_error(exc))
        except InvalidSchedule as exc:
            return Unreadable.of(doc, str(exc))
        return state

    def since(self) -> datetime | None:
        """Ticks after this one are due: the last fired, or the (re)start of the schedule."""
        marks = [t for t in (self.last_tick, self.resumed_at, self.created_at) if t is not None]
        return max(marks) if marks else None


class ScheduleView(BaseModel):
    """What ``taskrunner schedules`` shows of one stored schedule."""

    id: str
    schedule: ScheduleState | None = None
    unreadable: Unreadable | None = None
    """Why the stored document cannot be read (edited by hand), if it cannot."""
    orphaned: bool = False
    """No live worker declares it (removed from the code, or no worker is up): it never
    fires, and it is never deleted silently."""
    next_at: list[UtcDatetime] = Field(default_factory=list)
    """The next fire times; none while the schedule is paused (its ticks never fire)."""
    last_task: Task | None = None


def declare(
    *,
    name: str,
    schedule_id: str | None,
    cron: str | None,
    every: timedelta | float | None,
    timezone: str,
    params: dict[str, Any],
    priority: int,
    options: Mapping[str, Any],
    catch_up: str,
    max_catch_up: int,
    jitter: timedelta | float | None,
    grace: timedelta | float,
) -> Schedule:
    """Validate a declaration; every error is an ``InvalidSchedule`` naming the field."""
    recurrence = parse(cron=cron, every=every, timezone=timezone)
    if recurrence.every is not None and recurrence.every < MIN_EVERY:
        raise InvalidSchedule(
            "every",
            f"must be at least 1 s, not {recurrence.every.total_seconds():g} s: ticks are whole"
            " seconds at their finest (as a cron seconds field), so a faster schedule would only"
            " publish a stream of tasks",
        )
    if catch_up not in CATCH_UPS:
        raise InvalidSchedule("catch_up", f"must be one of {', '.join(CATCH_UPS)}, not {catch_up!r}")
    if isinstance(max_catch_up, bool) or not isinstance(max_catch_up, int) or max_catch_up < 1:
        raise InvalidSchedule("max_catch_up", f"must be a whole number >= 1, not {max_catch_up!r}")
    spec = {
        "id": schedule_id if schedule_id is not None else name,
        "name": name,
        "params": params,
        "priority": priority,
        "options": dict(options),
        "cron": recurrence.cron,
        "every": recurrence.every.total_seconds() if recurrence.every else None,
        "timezone": timezone,
        "catch_up": catch_up,
        "max_catch_up": max_catch_up,
        "jitter": _seconds("jitter", jitter or 0),
        "grace": _seconds("grace", grace),
    }
    try:
        return Schedule.model_validate(spec)
    except ValidationError as exc:
        raise invalid_task(exc, cls=InvalidSchedule) from None


def _seconds(field: str, value: timedelta | float) -> float:
    seconds = duration(field, value).total_seconds()
    if seconds < 0:
        raise InvalidSchedule(field, f"must be a duration >= 0, not {value!r}")
    return seconds
