"""Schedules without a server: tick times (cron, intervals, DST), catch-up, declarations, firing on a memory store."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from taskrunner import TaskContext, TaskRunner, Unreadable
from taskrunner.errors import InvalidSchedule, InvalidTask
from taskrunner.schedules.recurrence import due, parse, tick_key
from taskrunner.schedules.scheduler import Scheduler
from taskrunner.store.memory import MemoryStore

PARIS = "Europe/Paris"
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=UTC)


def test_a_wall_clock_time_skipped_by_dst_does_not_fire() -> None:
    """02:30 does not exist in Paris on 2026-03-29 (clocks go 02:00 -> 03:00): that day has no 02:30 task."""
    daily = parse(cron="30 2 * * *", every=None, timezone=PARIS)
    assert daily.upcoming(utc(2026, 3, 27, 12), 3) == [
        utc(2026, 3, 28, 1, 30),
        utc(2026, 3, 30, 0, 30),
        utc(2026, 3, 31, 0, 30),
    ]


def test_a_wall_clock_time_repeated_by_dst_fires_once() -> None:
    """02:30 happens twice in Paris on 2026-10-25 (clocks go 03:00 -> 02:00): it fires once, at the first."""
    daily = parse(cron="30 2 * * *", every=None, timezone=PARIS)
    assert daily.upcoming(utc(2026, 10, 24, 12), 2) == [utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]
    half_hourly = parse(cron="*/30 * * * *", every=None, timezone=PARIS)
    ticks = half_hourly.upcoming(utc(2026, 10, 24, 23, 45), 5)
    assert ticks == [
        utc(2026, 10, 25, 0, 0),
        utc(2026, 10, 25, 0, 30),
        utc(2026, 10, 25, 2, 0),
        utc(2026, 10, 25, 2, 30),
        utc(2026, 10, 25, 3, 0),
    ]
    # Looking back from inside the repeated hour's second pass finds its first pass.
    assert half_hourly.latest(utc(2026, 10, 25, 1, 10)) == utc(2026, 10, 25, 0, 30)


def test_six_fields_start_with_seconds_and_intervals_align_on_the_epoch() -> None:
    """A leading sixth field is seconds; every=N ticks on multiples of N seconds since 1970 (UTC)."""
    assert parse(cron="*/20 * * * * *", every=None).upcoming(T0, 2) == [
        T0 + timedelta(seconds=20),
        T0 + timedelta(seconds=40),
    ]
    every = parse(cron=None, every=timedelta(seconds=7))
    assert all(int(t.timestamp()) % 7 == 0 for t in every.upcoming(T0, 5))
    assert tick_key("report", utc(2026, 1, 1, 0, 5)) == "report@2026-01-01T00:05:00Z"


@pytest.mark.parametrize(
    ("catch_up", "expected"),
    [("latest", [T0]), ("all", [T0 - timedelta(minutes=n) for n in (2, 1, 0)]), ("none", [])],
)
def test_catch_up_after_downtime(catch_up: Any, expected: list[datetime]) -> None:
    """An hour without workers: "latest" fires the last missed tick, "all" up to max_catch_up, "none" nothing."""
    minutely = parse(cron="* * * * *", every=None)
    now = T0 + timedelta(seconds=30)
    assert (
        due(minutely, since=T0 - timedelta(hours=1), now=now, catch_up=catch_up, max_catch_up=3, grace=5)
        == expected
    )


def test_on_time_ticks_all_fire_whatever_the_policy() -> None:
    """Ticks within the grace period are not missed: each fires, also with catch_up="none"."""
    secondly = parse(cron=None, every=timedelta(seconds=1))
    fired = due(secondly, since=T0, now=T0 + timedelta(seconds=3), catch_up="none", max_catch_up=1, grace=5)
    assert fired == [T0 + timedelta(seconds=n) for n in (1, 2, 3)]


class ReportParams(BaseModel):
    day: int


def app() -> TaskRunner:
    runner = TaskRunner(store=MemoryStore())

    @runner.task("report")
    async def report(params: ReportParams, ctx: TaskContext) -> None:
        pass

    return runner


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "* * *"}, "cron"),
        ({}, "cron"),
        ({"cron": "* * * * *", "every": 5}, "cron"),
        ({"every": 0}, "every"),
        ({"every": timedelta(seconds=-1)}, "every"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "timezone"),
        ({"every": 5, "catch_up": "sometimes"}, "catch_up"),
        ({"every": 5, "max_catch_up": 0}, "max_catch_up"),
        ({"every": 5, "jitter": -1}, "jitter"),
    ],
)
def test_bad_declarations_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    """Each invalid schedule declaration raises InvalidSchedule naming the field, before anything is stored."""
    with pytest.raises(InvalidSchedule) as caught:
        app().schedule("report", params={"day": 1}, **kwargs)
    assert caught.value.field == field, caught.value


def test_every_is_at_least_one_second() -> None:
    """``every`` below 1 s (the finest tick a cron expression names, and the scheduler's
    step) is refused naming ``every`` and the bound; 1 s is accepted."""
    runner = app()
    for fast in (0.001, 0.999, timedelta(milliseconds=500)):
        with pytest.raises(InvalidSchedule, match=r"^every: .*at least 1 s") as caught:
            runner.schedule("report", every=fast, params={"day": 1})
        assert caught.value.field == "every"
    assert runner.schedules == {}
    assert runner.schedule("report", every=1, params={"day": 1}).every == 1.0


def test_a_second_schedule_with_the_same_id_is_refused() -> None:
    """Declaring a schedule id twice raises InvalidSchedule naming ``id`` (the first keeps
    firing, unchanged); a second schedule of one task needs its own id."""
    runner = app()
    first = runner.schedule("report", every=60, params={"day": 1})
    with pytest.raises(InvalidSchedule, match=r"^id: schedule 'report' is already declared") as caught:
        runner.schedule("report", cron="0 * * * *", params={"day": 2})
    assert caught.value.field == "id"
    with pytest.raises(InvalidSchedule, match="already declared"):
        runner.schedule("report", id="report", every=30, params={"day": 3})
    other = runner.schedule("report", id="report-hourly", cron="0 * * * *", params={"day": 2})
    assert runner.schedules == {"report": first, "report-hourly": other}


def test_params_and_options_are_checked_at_declaration() -> None:
    """A schedule's params must fit the handler's model and its options must exist."""
    with pytest.raises(InvalidTask, match=r"params\.day"):
        app().schedule("report", every=60, params={"day": "monday"})
    with pytest.raises(InvalidTask, match=r"options\.bogus"):
        app().schedule("report", every=60, params={"day": 1}, bogus=1)  # type: ignore[call-arg]  # untyped caller


def test_jitter_is_the_same_for_every_worker() -> None:
    """A tick's run time is its time plus a share of jitter that its key decides, so racing workers agree."""
    schedule = app().schedule("report", every=60, params={"day": 1}, jitter=timedelta(seconds=30))
    first, again = schedule.task(T0), schedule.task(T0)
    assert first.run_at == again.run_at and first.run_at is not None
    assert T0 <= first.run_at <= T0 + timedelta(seconds=30)
    assert first.key == f"report@{T0.isoformat().replace('+00:00', 'Z')}"


async def test_racing_schedulers_publish_one_task_per_tick_and_skip_paused_schedules() -> None:
    """Two schedulers on one store fire the same ticks: one task each; while paused, none."""
    runner = app()
    runner.schedule("report", every=1, params={"day": 1})
    clock = [T0 + timedelta(milliseconds=500)]
    store = MemoryStore(clock=lambda: clock[0])
    schedulers = [
        Scheduler(store, list(runner.schedules.values()), now=lambda: clock[0], rank=lambda _: 0)
        for _ in range(2)
    ]
    for scheduler in schedulers:
        await scheduler._declare()
    for _ in range(3):
        clock[0] += timedelta(seconds=1)
        await asyncio.gather(*(s.tick() for s in schedulers))
    keys = sorted(t.key for t in await store.find())
    assert keys == [tick_key("report", T0 + timedelta(seconds=n)) for n in (1, 2, 3)]
    await store.pause_schedule("report", True)
    clock[0] += timedelta(seconds=5)
    await schedulers[0].tick()
    assert len(await store.find()) == 3
    await store.pause_schedule("report", False)
    clock[0] += timedelta(seconds=1)
    await schedulers[1].tick()
    assert sorted(t.key for t in await store.find())[3:] == [
        tick_key("report", clock[0].replace(microsecond=0))
    ]


async def test_a_hand_edited_schedule_document_is_skipped_not_fatal() -> None:
    """A stored schedule with a broken cron is reported and skipped; the scheduler keeps going."""
    runner = app()
    runner.schedule("report", every=1, params={"day": 1})
    store = MemoryStore(clock=lambda: T0)
    scheduler = Scheduler(store, list(runner.schedules.values()), now=lambda: T0, rank=lambda _: 0)
    await scheduler._declare()
    store._schedules["report"]["every"] = "soon"
    assert await scheduler.tick() > 0
    [problem] = (await store.schedules()).values()
    assert isinstance(problem, Unreadable) and "every" in problem.problem


async def test_a_paused_schedule_shows_no_next_fire_times() -> None:
    """`taskrunner schedules` (and the overview behind it) lists no fire times for a paused schedule: none fires."""
    from taskrunner.cli import render

    runner = app()
    runner.schedule("report", every=60, params={"day": 1})
    runner = runner.copy(store=MemoryStore(clock=lambda: T0))
    for schedule in runner.schedules.values():
        await runner.store.declare_schedule(schedule, schedule.recurrence.after(T0))
    [active] = await runner.schedule_overview()
    assert len(active.next_at) == 3
    await runner.pause_schedule("report")
    [paused] = await runner.schedule_overview()
    assert paused.next_at == []
    cells = render._schedule_cells(paused)
    assert (cells[3], cells[5]) == ("-", "paused, orphaned")
