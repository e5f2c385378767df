"""The worker's side task that fires the app's schedules (see ``taskrunner.schedules.model``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import suppress
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from taskrunner.errors import StoreError
from taskrunner.models import Unreadable
from taskrunner.observability import tracing
from taskrunner.observability.logs import get_logger
from taskrunner.observability.redact import redact
from taskrunner.schedules.recurrence import (
    due,
)

if TYPE_CHECKING:
    from taskrunner.engine.outage import Outage
    from taskrunner.store.base import Store

from taskrunner.schedules.model import Schedule, ScheduleState

log = get_logger("taskrunner.schedules")
BACKUP_DELAY = 1.0  # seconds a worker of rank n waits (times n) after a tick before firing it
MAX_SLEEP = 5.0  # the loop looks at the documents at least this often (pause, resume, edits)


class Scheduler:
    """A worker's side task: fire the app's schedules on time, every worker as a backup."""

    def __init__(
        self,
        store: Store,
        schedules: Sequence[Schedule],
        *,
        now: Callable[[], datetime],
        rank: Callable[[str], int],
        fired: Callable[[str, int], None] = lambda schedule_id, count: None,
    ) -> None:
        """``fired(schedule_id, tasks)`` hears of each firing that created tasks (metrics)."""
        self.store, self.schedules = store, {s.id: s for s in schedules}
        self.now, self.rank, self.fired = now, rank, fired
        self._declared = False
        self._reported: dict[str, str] = {}

    async def run(self, stop: asyncio.Event, outage: Outage) -> None:
        """Until ``stop``: declare the schedules, then fire each tick; a server that is away
        is logged once (``outage``) and retried."""
        while not stop.is_set():
            try:
                await self._declare()
                wait = await self.tick()
                outage.ok()
            except StoreError as exc:
                wait = outage.failed(exc)
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)

    async def _declare(self) -> None:
        if self._declared:
            return
        now = self.now()
        for schedule in self.schedules.values():
            await self.store.declare_schedule(schedule, schedule.recurrence.after(now))
        self._declared = True

    async def tick(self) -> float:
        """Fire what is due; returns how long to sleep before looking again."""
        states = await self.store.schedules(list(self.schedules))
        if set(self.schedules) - set(states):
            self._declared = False  # deleted by hand: declared again on the next pass
        waits = [MAX_SLEEP]
        for schedule_id, stored in states.items():
            if isinstance(stored, Unreadable):
                self._report(schedule_id, stored.problem)
                continue
            waits.append(await self._fire(self.schedules[schedule_id], stored))
        return max(0.05, min(waits))

    async def _fire(self, schedule: Schedule, state: ScheduleState) -> float:
        recurrence, now = schedule.recurrence, self.now()
        since = state.since()
        if state.paused or since is None:
            return MAX_SLEEP
        lag = self.rank(schedule.id) * BACKUP_DELAY  # the owner fires first, others back it up
        ticks = due(
            recurrence,
            since=since,
            now=now - timedelta(seconds=lag),
            catch_up=schedule.catch_up,
            max_catch_up=schedule.max_catch_up,
            grace=schedule.grace,
        )
        if ticks:
            tasks = [schedule.task(tick) for tick in ticks]
            published = await tracing.publish(tasks, self.store.publish, schedule=schedule.id)
            fired = ticks[-1]
            recorded = await self.store.record_tick(
                schedule.id, state.last_tick, fired, tasks[-1].key, recurrence.after(now)
            )
            created = [t.key for t in published if t.created]
            if created:
                log.info("schedule fired", schedule=schedule.id, keys=created, recorded=recorded)
                self.fired(schedule.id, len(created))
            since = fired
        upcoming = recurrence.after(max(since, now - timedelta(seconds=lag)))
        return (upcoming - now).total_seconds() + lag

    def _report(self, schedule_id: str, problem: str) -> None:
        if self._reported.get(schedule_id) != problem:
            log.warning(
                "skipping unreadable schedule document", schedule=schedule_id, problem=redact(problem)
            )
            self._reported[schedule_id] = problem
