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
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO, cast
from zoneinfo import ZoneInfo

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from taskrunner.limits.state import ALL
from taskrunner.models import EntryState, Task, TaskState, TaskStats, WorkerInfo
from taskrunner.schedules.model import ScheduleView

PIPED_WIDTH = 10_000  # no line limit: rich needs a number


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
    # A document written by hand: why no worker runs it (marked), or what does not read.
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
