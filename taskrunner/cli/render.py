"""How commands print: rich tables that never cut a value, and JSON that rich never touches.

A table cell folds onto more lines in a narrow terminal; when stdout is not a terminal
(a pipe, a file) tables are as wide as their content, so ``grep`` and ``less -S`` see
whole values, and no line ends in the spaces rich pads a grid's cells with. JSON goes to
stdout with ``print``: valid whatever the width.
"""

from __future__ import annotations

import io
import json
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO, cast
from zoneinfo import ZoneInfo

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from taskrunner.limits.state import ALL
from taskrunner.models import EntryState, StoredTask, Task, TaskState, TaskStats, WorkerInfo
from taskrunner.schedules.model import ScheduleView
from taskrunner.workflows.levels import levels
from taskrunner.workflows.model import FlowView

PIPED_WIDTH = 10_000  # no line limit: rich needs a number
LISTED = 20
"""Keys ``show`` lists of a task's upstreams, dependents and waits before saying how many more."""
CELL_KEYS = 3
"""Keys a table cell lists before saying how many more (a fan-in's ``after`` may hold 10,000)."""
GRAPH_LEVELS = 50
"""Levels ``flow`` draws; the rest is one line (``--json`` has every step)."""
LEVEL_KEYS = 3
"""A level of at most this many steps names each; a larger one counts its steps by name."""
LEVEL_NAMES = 5
"""Names a level counts its steps by before saying how many more names."""


def stdout() -> Console:
    """A console measured now: a process may run several commands with different widths."""
    if sys.stdout.isatty():
        return Console(highlight=False, emoji=False)
    trimmed = cast("TextIO", TrimmedLines(sys.stdout))  # a TextIOBase, which typeshed's IO[str] is not
    return Console(file=trimmed, highlight=False, emoji=False, width=PIPED_WIDTH)


class TrimmedLines(io.TextIOBase):
    """Output to a pipe: each line without trailing spaces (a grid pads every line to its widest)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        self._out.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        self._out.write(self._partial)  # a line rich left open: kept as written
        self._partial = ""
        self._out.flush()

    def isatty(self) -> bool:
        return False


def stderr() -> Console:
    return Console(stderr=True, highlight=False, emoji=False, soft_wrap=True)


def print_json(text: str) -> None:
    """JSON as is: rich would wrap long lines and break it."""
    print(text, flush=True)


def text(value: object) -> Text:
    """A table cell shown verbatim (keys and messages may contain rich markup)."""
    return Text(str(value))


def table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[object]], *, whole: Iterable[str] = ()
) -> Table:
    """A table whose cells fold rather than end in '…' when the terminal is narrow.

    ``whole`` columns (states, counts, times) are never folded: they are as wide as
    their widest cell, and the free-text columns fold around them.
    """
    cells = [[str(value) for value in row] for row in rows]
    keep = set(whole)
    result = Table(title=title)
    for i, column in enumerate(columns):
        widest = max((len(row[i]) for row in cells), default=0) if column in keep else None
        result.add_column(
            column, overflow="fold", min_width=None if widest is None else max(widest, len(column))
        )
    for row in cells:
        result.add_row(*map(Text, row))
    return result


def print_table(console: Console, shown: Table) -> None:
    """The table, or one block of ``column  value`` lines per row when it cannot fit the terminal."""
    unbounded = console.options.update_width(
        PIPED_WIDTH
    )  # measured within the console's width, it always fits
    if Measurement.get(console, unbounded, shown).minimum <= console.width:
        console.print(shown)
        return
    console.print(Text(str(shown.title or ""), style="bold"))
    columns = [(str(c.header), list(c.cells)) for c in shown.columns]
    for i in range(shown.row_count):
        block = Table.grid(padding=(0, 2))
        block.add_column(no_wrap=True)
        block.add_column(overflow="fold")
        for header, cells in columns:
            block.add_row(Text(header, style="bold"), cells[i])
        console.print(block, "")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def spaced_json(value: Any) -> str:
    """JSON with a space after each comma and colon, so a narrow terminal wraps it between values."""
    return json.dumps(value, default=str)


def ago(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    seconds = max((now - moment).total_seconds(), 0.0)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"


def progress(value: Any) -> str:
    """``{fraction, message}`` from ``ctx.progress`` as '40% message'."""
    if not isinstance(value, dict):
        return "-" if value is None else str(value)
    fraction, message = value.get("fraction"), value.get("message")
    shown = f"{fraction:.0%}" if isinstance(fraction, int | float) else "?"
    return f"{shown} {message}" if message else shown


def task_summary(task: Task) -> Table:
    """Key, name, state, counters, times, params and options of one task."""
    summary = Table.grid(padding=(0, 2))
    summary.add_column(no_wrap=True)
    summary.add_column(overflow="fold")
    rows = [
        ("key", task.key),
        ("name", task.name),
        ("state", task.state.value),
        ("priority", str(task.priority)),
        ("failures", f"{task.failures} of {task.options.max_failures}"),
        ("created", str(task.created_at)),
        ("run at", str(task.run_at)),
        ("claimable at", str(task.claimable_at or "-")),
        ("params", spaced_json(task.params)),
        ("options", spaced_json(task.options.model_dump(mode="json"))),
    ]
    rows += workflow_rows(task)
    # A document written by hand: why no worker runs it (marked), or what does not read;
    # or why a workflow canceled it (UpstreamFailed, FlowFailed).
    if task.error is not None:
        rows.append(("error", f"{task.error.type}: {task.error.message}"))
    if task.unreadable is not None:
        rows.append(("unreadable", task.unreadable.problem))
    for label, value in rows:
        summary.add_row(Text(label, style="bold"), text(value))
    return summary


def clock(moment: datetime | None) -> str:
    """A time of day (UTC) for table cells; ``--json`` has the full timestamps."""
    return "-" if moment is None else moment.astimezone(UTC).strftime("%H:%M:%S")


def entries_table(task: Task) -> Table:
    """One row per worker entry of a task."""
    columns = (
        "worker",
        "run",
        "state",
        "attempt",
        "progress",
        "claimed",
        "expires",
        "finished",
        "result / error",
    )
    rows = [
        (
            w.worker_id,
            w.run_id[:8],
            w.state.value,
            w.attempt,
            progress(w.progress),
            clock(w.claimed_at),
            clock(w.expires_at),
            clock(w.finished_at),
            f"{w.error.type}: {w.error.message}" if w.error else spaced_json(w.result),
        )
        for w in task.workers
    ]
    return table(
        "workers (times UTC)",
        columns,
        rows,
        whole=("run", "state", "attempt", "claimed", "expires", "finished"),
    )


def print_task(console: Console, task: Task) -> None:
    console.print(task_summary(task))
    if task.workers:
        print_table(console, entries_table(task))


def some(keys: Sequence[str], shown: int = CELL_KEYS) -> str:
    """``keys`` joined, at most ``shown`` of them, then how many more."""
    if len(keys) <= shown:
        return ", ".join(keys) or "-"
    return f"{', '.join(keys[:shown])} and {len(keys) - shown} more"


def state_counts(tasks: Iterable[StoredTask]) -> str:
    """``3 SUCCESS, 2 WAITING``: how many of ``tasks`` are in each state, in ``TaskState``'s order."""
    counts = Counter(task.state for task in tasks)
    return ", ".join(f"{counts[state]} {state.value}" for state in TaskState if counts[state])


def workflow_rows(task: StoredTask) -> list[tuple[str, str]]:
    """The summary's lines on the task's place in a workflow (none for a task of its own)."""
    rows = []
    if task.flow is not None:
        rows.append(("flow", task.flow))
    if task.after:
        policy = f"on upstream failure: {task.on_upstream_failure}"
        rows.append(("after", f"{plural(len(task.after), 'task')}; {policy}"))
    if task.state is TaskState.WAITING:
        rows.append(("waiting on", some(task.waiting_on, LISTED)))
    if task.canceled_by:
        rows.append(("canceled by", some(task.canceled_by, LISTED)))
    if task.compensate is not None:
        rows.append(("compensate", f"{task.compensate.name} {spaced_json(task.compensate.params)}"))
    if task.compensates is not None:
        rows.append(("compensates", task.compensates))
    return rows


def upstream_table(task: StoredTask, upstream: Mapping[str, StoredTask]) -> Table:
    """The first ``LISTED`` tasks ``task`` runs after, with their states (a purged one: not stored)."""
    rows = [
        (key, found.name, found.state.value) if (found := upstream.get(key)) else (key, "-", "not stored")
        for key in task.after[:LISTED]
    ]
    counts = state_counts(upstream.values())
    title = f"runs after {plural(len(task.after), 'task')}" + (f": {counts}" if counts else "")
    if len(task.after) > LISTED:
        title += f" (the first {LISTED})"
    return table(title, ("key", "name", "state"), rows, whole=("state",))


def dependents_table(dependents: Sequence[StoredTask], counted: int) -> Table:
    """The first ``LISTED`` tasks that run after a task, of ``dependents`` (read up to ``counted``)."""
    total = str(len(dependents)) if len(dependents) < counted else f"{counted} or more"
    title = f"tasks that run after it: {total}" + (
        f" (the first {LISTED})" if len(dependents) > LISTED else ""
    )
    rows = [(t.key, t.name, t.state.value) for t in dependents[:LISTED]]
    return table(title, ("key", "name", "state"), rows, whole=("state",))


def print_relations(
    console: Console,
    task: StoredTask,
    upstream: Mapping[str, StoredTask],
    dependents: Sequence[StoredTask],
    counted: int,
) -> None:
    """What ``task`` runs after and what runs after it, as ``show`` prints them under the task."""
    if task.after:
        print_table(console, upstream_table(task, upstream))
    if dependents:
        print_table(console, dependents_table(dependents, counted))


def flow_lines(view: FlowView, by_level: Sequence[Sequence[StoredTask]]) -> list[str]:
    """The flow's state, and how many steps, levels and compensations it has."""
    counts = state_counts(view.steps)
    return [
        f"flow {view.id}: {view.state.value}",
        f"{plural(len(view.steps), 'step')} in {plural(len(by_level), 'level')}"
        + (f" ({counts})" if counts else "")
        + f"; {plural(len(view.compensations), 'compensation')}"
        + (f" ({state_counts(view.compensations)})" if view.compensations else ""),
    ]


def graph_lines(by_level: Sequence[Sequence[StoredTask]]) -> list[str]:
    """The flow drawn as text, one line per level and an arrow between levels: a 1 -> 10 -> 1
    flow reads ``1 step``, ``10 steps``, ``1 step`` down the left."""
    drawn = by_level[:GRAPH_LEVELS]
    labels = [plural(len(level), "step") for level in drawn]
    width = max(map(len, labels), default=0)
    lines: list[str] = []
    for label, level in zip(labels, drawn, strict=True):
        if lines:
            lines.append("  ↓")
        lines.append(f"{label:<{width}}  {level_text(level)}")
    rest = by_level[GRAPH_LEVELS:]
    if rest:
        steps = plural(sum(map(len, rest)), "step")
        lines += ["  ↓", f"... {plural(len(rest), 'more level')} of {steps} (--json has every step)"]
    return lines


def level_text(level: Sequence[StoredTask]) -> str:
    """A few steps by key and state; more, counted by name (``transform (10): 7 SUCCESS, 3 RUNNING``)."""
    if len(level) <= LEVEL_KEYS:
        return ", ".join(f"{task.key} {task.state.value}" for task in level)
    by_name: dict[str, list[StoredTask]] = {}
    for task in level:
        by_name.setdefault(task.name, []).append(task)
    groups = [f"{name} ({len(tasks)}): {state_counts(tasks)}" for name, tasks in by_name.items()]
    more = len(groups) - LEVEL_NAMES
    return "; ".join(groups[:LEVEL_NAMES]) + (f"; and {plural(more, 'more name')}" if more > 0 else "")


def step_note(task: StoredTask) -> str:
    """What a step waits on, or why it failed or was canceled."""
    if task.state is TaskState.WAITING:
        return f"waits on {some(task.waiting_on)}"
    error = task.last_error
    return f"{error.type}: {error.message}" if error else "-"


def steps_table(view: FlowView, by_level: Sequence[Sequence[StoredTask]], limit: int) -> Table:
    """The flow's steps in publish order (the first ``limit``; 0: all), each with its level."""
    level_of = {task.key: n for n, level in enumerate(by_level, 1) for task in level}
    shown = view.steps[:limit] if limit else view.steps
    rows = [(t.key, t.name, t.state.value, level_of[t.key], some(t.after), step_note(t)) for t in shown]
    title = plural(len(view.steps), "step")
    if len(shown) < len(view.steps):
        title += f", the first {len(shown)} (--limit 0: all)"
    columns = ("key", "name", "state", "level", "runs after", "note")
    return table(title, columns, rows, whole=("state", "level"))


def compensations_table(compensations: Sequence[StoredTask]) -> Table:
    """The flow's compensations: each one's key, the step it undoes, its state."""
    rows = [(t.key, t.compensates or "-", t.name, t.state.value, step_note(t)) for t in compensations]
    columns = ("key", "undoes", "name", "state", "note")
    return table(plural(len(compensations), "compensation"), columns, rows, whole=("state",))


def print_flow(console: Console, view: FlowView, limit: int) -> None:
    """``taskrunner flow ID``: state, the graph by level, the steps, the compensations."""
    by_level = levels(view.steps)
    for line in flow_lines(view, by_level):
        console.print(text(line))
    if view.steps:
        console.print(Text("graph: each step runs after steps of the levels above it", style="bold"))
        for line in graph_lines(by_level):
            console.print(text(line))
        print_table(console, steps_table(view, by_level, limit))
    if view.compensations:
        print_table(console, compensations_table(view.compensations))


def tasks_table(tasks: list[Task]) -> Table:
    now = datetime.now(UTC)
    rows = [
        (
            task.key,
            task.name,
            task.state.value,
            task.priority,
            ", ".join(f"{w.worker_id} {w.state.value}" for w in task.workers) or "-",
            ago(task.created_at, now),
            f"{task.last_error.type}: {task.last_error.message}" if task.last_error else "-",
        )
        for task in tasks
    ]
    columns = ("key", "name", "state", "priority", "workers", "age", "last error")
    return table(plural(len(tasks), "task"), columns, rows, whole=("state", "priority", "age"))


def failed_table(tasks: list[Task]) -> Table:
    """The dead-letter view: when each failed, its failed runs, the last run's worker and the error."""
    now = datetime.now(UTC)
    rows = [
        (
            task.key,
            task.name,
            f"{ago(task.finished_at, now)} ago" if task.finished_at else "-",
            task.failures,
            next((w.worker_id for w in reversed(task.workers) if w.state is EntryState.FAIL), "-"),
            f"{task.last_error.type}: {task.last_error.message}" if task.last_error else "-",
        )
        for task in tasks
    ]
    columns = ("key", "name", "failed", "failures", "worker", "error")
    return table(plural(len(tasks), "failed task"), columns, rows, whole=("failed", "failures"))


def counts_table(numbers: TaskStats) -> Table:
    rows = [
        (name, *(counts.get(s.value, 0) for s in TaskState))
        for name, counts in sorted(numbers.counts.items())
    ]
    states = [s.value for s in TaskState]
    result = table("tasks by name and state", ["name", *states], rows, whole=states)
    for column in result.columns[1:]:
        column.justify = "right"
    return result


def stats_lines(numbers: TaskStats) -> list[str]:
    """The lines under the counts table: running, oldest pending, last hour, paused, unserved."""
    oldest, rate = numbers.oldest_pending_seconds, numbers.failure_rate_last_hour
    lines = [
        f"running: {numbers.running}; oldest pending: {'-' if oldest is None else f'{oldest:.1f} s'}",
        f"last hour: {numbers.finished_last_hour} runs finished, {numbers.failed_last_hour} failed"
        + ("" if rate is None else f" ({rate:.0%})"),
    ]
    if numbers.paused:
        lines.append("paused: " + ("every task name" if ALL in numbers.paused else ", ".join(numbers.paused)))
    if numbers.unserved:
        names = ", ".join(f"{name} ({count} pending)" for name, count in numbers.unserved.items())
        lines.append(f"no live worker serves: {names}")
    for pinned in numbers.pinned_away:
        more = ", ..." if pinned.tasks > len(pinned.keys) else ""
        lines.append(
            f"pinned to no live worker: {plural(pinned.tasks, 'task')} with worker_ids "
            f"{', '.join(pinned.worker_ids)} ({', '.join(pinned.keys)}{more})"
        )
    return lines


def workers_table(infos: list[WorkerInfo]) -> Table:
    now = datetime.now(UTC)
    rows = [
        (
            w.worker_id,
            w.host,
            w.pid,
            w.started_at.strftime("%Y-%m-%d %H:%M:%S"),
            f"{ago(w.beat_at, now)} ago",
            f"{len(w.running)}/{w.concurrency}" + (f": {', '.join(w.running)}" if w.running else ""),
            ", ".join(w.paused) or "-",
            w.version or "-",
            "stopping" if w.stop_requested else "running",
        )
        for w in infos
    ]
    columns = ("worker", "host", "pid", "started", "last beat", "in flight", "paused", "version", "status")
    return table(plural(len(infos), "live worker"), columns, rows, whole=("pid", "last beat", "status"))


def schedules_table(views: list[ScheduleView]) -> Table:
    columns = ("id", "task", "expression", "next fire times", "last task", "status")
    return table(plural(len(views), "schedule"), columns, map(_schedule_cells, views))


def _schedule_cells(view: ScheduleView) -> tuple[str, ...]:
    status = ["orphaned"] if view.orphaned else []
    if view.schedule is None:
        return (view.id, "-", "-", "-", "-", ", ".join([*status, f"unreadable: {view.unreadable}"]))
    s = view.schedule
    zone = ZoneInfo(s.timezone)
    times = "\n".join(t.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %Z") for t in view.next_at) or "-"
    last = f"{s.last_key} ({view.last_task.state.value if view.last_task else 'gone'})" if s.last_key else "-"
    status = ["paused" if s.paused else "active", *status]
    return (s.id, s.name, f"{s.recurrence.expression} ({s.timezone})", times, last, ", ".join(status))


def outcome_lines(task: Task) -> list[str]:
    """``KEY: STATE`` and the results or the last error, as ``wait`` prints them."""
    lines = [f"{task.key}: {task.state.value}"]
    if task.state is TaskState.SUCCESS:
        lines.append(f"results: {json.dumps(task.results, default=str)}")
    elif task.last_error is not None:
        lines.append(f"last error: {task.last_error.type}: {task.last_error.message}")
    return lines
