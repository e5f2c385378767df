"""What each page shows, read through the runner's public API (one module: the data, no HTML)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from taskrunner.dashboard.snapshots import EXPIRES_IN
from taskrunner.errors import InvalidTask
from taskrunner.limits.gates import GateDoc
from taskrunner.limits.state import LimitState
from taskrunner.models import EntryState, Task, TaskState, Unreadable
from taskrunner.runner import TaskRunner
from taskrunner.store import fields as f
from taskrunner.store.base import Listing, Position, format_position, parse_position

PAGE_SIZE = 50
RECENT = 200  # tasks sampled (newest updated first, by index) for the throughput chart
CHART_MINUTES = 10
FINISHED_RUNS = (EntryState.SUCCESS, EntryState.FAIL)
SORTS = {"created": f.CREATED_AT, "updated": f.UPDATED_AT, "failed": f.FINISHED_AT}
FAILED_ONLY = "failed"  # the sort the failed index serves: FAIL tasks only


@dataclass
class Minute:
    start: datetime
    finished: int = 0
    pickup: list[float] = field(default_factory=list)

    @property
    def latency(self) -> float | None:
        return sum(self.pickup) / len(self.pickup) if self.pickup else None


async def overview(runner: TaskRunner) -> dict[str, Any]:
    stats = await runner.stats()
    by_state: Counter[str] = Counter()
    for counts in stats.counts.values():
        by_state.update(counts)
    workers = await runner.workers()
    recent = (await runner.store.browse(Listing(sort=f.UPDATED_AT, limit=RECENT))).tasks
    now = await runner.store.server_time()
    return {
        "stats": stats,
        "by_state": {state.value: by_state.get(state.value, 0) for state in TaskState},
        "workers": len(workers),
        "minutes": minutes(recent, now),
        "sampled": RECENT,
    }


def minutes(tasks: list[Task], now: datetime) -> list[Minute]:
    """Finished runs and pickup latency per minute over the last ``CHART_MINUTES``."""
    top = now.replace(second=0, microsecond=0)
    chart = [Minute(top - timedelta(minutes=n)) for n in reversed(range(CHART_MINUTES))]
    for task in tasks:
        for index, entry in enumerate(task.workers):
            done = entry.finished_at
            if done is not None and entry.state in FINISHED_RUNS and _within(chart, done):
                _bucket(chart, done).finished += 1
            if index == 0 and _within(chart, entry.claimed_at):
                _bucket(chart, entry.claimed_at).pickup.append(
                    (entry.claimed_at - task.run_at).total_seconds()
                )
    return chart


def _within(chart: list[Minute], at: datetime) -> bool:
    return chart[0].start <= at < chart[-1].start + timedelta(minutes=1)


def _bucket(chart: list[Minute], at: datetime) -> Minute:
    index = int((at - chart[0].start).total_seconds() // 60)
    return chart[min(max(index, 0), len(chart) - 1)]


@dataclass(frozen=True)
class TaskFilter:
    """The task list's query string, checked."""

    state: TaskState | None = None
    name: str | None = None
    prefix: str | None = None
    worker: str | None = None
    sort: str = "created"
    after: Position | None = None

    @classmethod
    def parse(cls, query: dict[str, str]) -> TaskFilter:
        state = query.get("state") or None
        sort = query.get("sort") or "created"
        if state is not None and state not in TaskState.__members__:
            raise InvalidTask("state", f"unknown state {state!r}")
        if sort not in SORTS:
            raise InvalidTask("sort", "sort is created, updated or failed")
        if sort == FAILED_ONLY and state != TaskState.FAIL.value:
            raise InvalidTask("sort", "sort=failed lists failed tasks: add state=FAIL")
        return cls(
            TaskState(state) if state else None,
            query.get("name") or None,
            query.get("prefix") or None,
            query.get("worker") or None,
            sort,
            parse_position(query.get("after")),
        )

    def listing(self) -> Listing:
        return Listing(
            self.state, self.name, self.worker, self.prefix, SORTS[self.sort], self.after, PAGE_SIZE
        )

    def page(self) -> str:
        """The key of this listing's snapshot (``tasks?state=FAIL&sort=created``)."""
        after = format_position(self.after) if self.after else None
        return "tasks?" + urlencode(self.query(after=after))

    def query(self, **changes: str | None) -> dict[str, str]:
        """This filter as query parameters (for links), with ``changes``."""
        params = {"state": self.state.value if self.state else None, "name": self.name}
        params |= {"prefix": self.prefix, "worker": self.worker, "sort": self.sort}
        return {k: v for k, v in (params | changes).items() if v}


async def task_list(runner: TaskRunner, chosen: TaskFilter) -> dict[str, Any]:
    page = await runner.store.browse(chosen.listing())
    after = format_position(page.after) if page.after else None
    return {"tasks": page.tasks, "filter": chosen, "next": chosen.query(after=after) if after else None}


def progress(task: Task) -> float | None:
    """The running entry's progress fraction (0..1), if it reported one."""
    for entry in reversed(task.workers):
        if entry.state is EntryState.RUNNING and isinstance(entry.progress, dict):
            fraction = entry.progress.get("fraction")
            if isinstance(fraction, int | float):
                return float(fraction)
    return None


@dataclass
class RateUse:
    """A rate-limited name's starts in the last period, on its busiest gate (one gate per
    name, or per ``limit_by`` value)."""

    busiest: int = 0
    lanes: int = 0
    gates: int = 0


async def rate_use(runner: TaskRunner, names: list[str]) -> dict[str, RateUse]:
    if not names:
        return {}
    docs = await runner.store.gates(names)
    now = await runner.store.server_time()
    use: dict[str, RateUse] = {}
    for doc in docs:
        gate, problem = GateDoc.read(doc, str(doc.get(f.ID)), str(doc.get(f.NAME)))
        if problem is None and gate.lanes:
            one = use.setdefault(gate.name, RateUse())
            one.busiest = max(one.busiest, gate.started_within_period(now))
            one.lanes, one.gates = max(one.lanes, len(gate.lanes)), one.gates + 1
    return use


@dataclass(frozen=True)
class Throttle:
    """A live ``RateLimited`` hold: on the whole name (``gate`` None) or on one ``limit_by`` gate."""

    until: datetime
    gate: str | None = None


def live_throttles(limits: dict[str, LimitState], now: datetime) -> dict[str, list[Throttle]]:
    """Each name's throttles that still hold at ``now`` (server time), soonest end first: a
    throttle that ended holds nothing back, so the page does not show it."""
    live: dict[str, list[Throttle]] = {}
    for name, state in limits.items():
        found = [Throttle(state.throttled_until)] if state.throttled_until is not None else []
        found += [Throttle(t.until, t.gate) for t in state.throttled_gates]
        holding = sorted((t for t in found if t.until > now), key=lambda t: t.until)
        if holding:
            live[name] = holding
    return live


async def schedules(runner: TaskRunner) -> dict[str, Any]:
    stats = await runner.stats()
    stored = await runner.store.limits()
    now = await runner.store.server_time()
    limits = {name: state for name, state in stored.items() if isinstance(state, LimitState)}
    running = {name: counts.get(TaskState.RUNNING.value, 0) for name, counts in stats.counts.items()}
    throttles = live_throttles(limits, now)
    ends = [held[0].until for held in throttles.values()]
    return {
        "schedules": await runner.schedule_overview(),
        "limits": limits,
        "rate_use": await rate_use(runner, sorted(limits)),
        "unreadable": {name: s.problem for name, s in stored.items() if isinstance(s, Unreadable)},
        "running": running,
        "paused": stats.paused,
        "throttles": throttles,
        # Read again when the first throttle ends, so open tabs drop it then.
        EXPIRES_IN: (min(ends) - now).total_seconds() if ends else None,
    }
