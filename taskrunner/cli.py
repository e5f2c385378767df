"""The ``taskrunner`` command. Each command calls the public coroutine a user would.

Every error ends in ``fail()``: one line on stderr naming the problem, exit code 1
(typer reports bad arguments with exit code 2; ``wait`` exits 3 when --within passes).
The reference is docs/cli.md.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar
from zoneinfo import ZoneInfo

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from taskrunner import fields as f
from taskrunner.errors import TaskRunnerError, WaitTimeout
from taskrunner.gates import Limit
from taskrunner.limits import ALL, LimitState
from taskrunner.models import Task, TaskState, TaskStats, WorkerInfo, parse_duration
from taskrunner.redact import redact
from taskrunner.runner import DEFAULT_URI, TaskRunner
from taskrunner.schedules import ScheduleView

if TYPE_CHECKING:
    from taskrunner.observe import WorkerObserver
    from taskrunner.roundtrips import RoundTripCounter
    from taskrunner.worker import Worker

T = TypeVar("T")


class LogFormatChoice(enum.StrEnum):
    json = "json"
    console = "console"


class DiscoveryChoice(enum.StrEnum):
    stream = "stream"
    poll = "poll"


app = typer.Typer(help="Background tasks as readable MongoDB documents.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)  # fmt: skip
out = Console(highlight=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)


@app.callback()
def _measure_terminal() -> None:
    """Every command measures the terminal as it starts: a Console reads COLUMNS once, when
    built, and a process may run several commands (tests, embedding) with different widths."""
    global out, err
    out = Console(highlight=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True)


MongoUri = Annotated[
    str | None,
    typer.Option("--mongo-uri", envvar="TASKRUNNER_MONGO_URI", help=f"MongoDB URI (default {DEFAULT_URI})."),
]
Database = Annotated[
    str | None, typer.Option(envvar="TASKRUNNER_DATABASE", help=f"Database (default {f.DEFAULT_DATABASE}).")
]
Collection = Annotated[
    str | None,
    typer.Option(envvar="TASKRUNNER_COLLECTION", help=f"Task collection (default {f.DEFAULT_COLLECTION})."),
]
Timeout = Annotated[float, typer.Option(envvar="TASKRUNNER_TIMEOUT", help="Seconds to wait for the server.")]
AppRef = Annotated[
    str | None, typer.Option("--app", envvar="TASKRUNNER_APP", help="MODULE:OBJECT of a TaskRunner.")
]


def fail(message: str) -> NoReturn:
    err.print(f"error: {redact(message)}", markup=False)
    raise typer.Exit(1)


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(coro)
    except TaskRunnerError as exc:
        fail(str(exc))


def make_runner(
    uri: str | None, database: str | None, collection: str | None, timeout: float, app_ref: str | None = None
) -> TaskRunner:
    """The app's runner (its handlers and connection) or a bare one; options given win."""
    if app_ref is None:
        return TaskRunner(uri, database=database or f.DEFAULT_DATABASE,
                          collection=collection or f.DEFAULT_COLLECTION, timeout=timeout)  # fmt: skip
    from taskrunner.loader import load_app

    try:
        app_runner = load_app(app_ref)
    except TaskRunnerError as exc:
        fail(str(exc))
    return app_runner.copy(mongo_uri=uri, database=database, collection=collection, timeout=timeout)


async def _closing(runner: TaskRunner, coro: Coroutine[Any, Any, T]) -> T:
    try:
        return await coro
    finally:
        await runner.close()


@app.command()
def init(
    validator: Annotated[bool, typer.Option(help="Also install the $jsonSchema validator.")] = False,
    retain_finished: Annotated[
        float | None,
        typer.Option(
            parser=_retention,
            metavar="DURATION|off",
            help="Delete tasks this long after they finish (TTL index); off removes it.",
        ),
    ] = None,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Create the task collection's indexes (idempotent); optionally the validator and retention."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    run(_closing(runner, runner.init(validator=validator, retain_finished=retain_finished)))
    out.print(f"initialised {runner.database}.{runner.collection}: indexes {', '.join(f.INDEXES)}"
              + (" and validator" if validator else ""), markup=False)  # fmt: skip
    if retain_finished == 0:
        out.print(f"retention off: no TTL index {f.RETENTION_INDEX}; finished tasks stay until purged")
    elif retain_finished is not None:
        seconds = int(retain_finished)
        out.print(f"retention: TTL index {f.RETENTION_INDEX} deletes tasks {seconds} s after they finish")


def _parse_params(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"params: not valid JSON ({exc})")


@app.command()
def publish(
    name: Annotated[str, typer.Argument(help="Handler name.")],
    params: Annotated[str, typer.Option(help="Params as a JSON object.")] = "{}",
    key: Annotated[str | None, typer.Option(help="Idempotency key (generated if absent).")] = None,
    priority: Annotated[int, typer.Option(help="Higher runs first.")] = 0,
    delay: Annotated[float | None, typer.Option(help="Seconds to wait before the task may start.")] = None,
    run_at: Annotated[
        datetime | None, typer.Option(help="Not before this time (ISO 8601, UTC if naive).")
    ] = None,
    concurrency: Annotated[int | None, typer.Option(help="Distinct workers that must succeed.")] = None,
    max_failures: Annotated[int | None, typer.Option(help="Failed runs before the task is FAIL.")] = None,
    local_retries: Annotated[int | None, typer.Option(help="In-process retries per run.")] = None,
    retry_backoff: Annotated[float | None, typer.Option(help="Seconds before a retry.")] = None,
    ping_interval: Annotated[float | None, typer.Option(help="Seconds between heartbeats.")] = None,
    ping_timeout: Annotated[
        float | None, typer.Option(help="Seconds without heartbeat before takeover.")
    ] = None,
    worker_id: Annotated[list[str] | None, typer.Option(help="Allowed worker (repeatable).")] = None,
    run_timeout: Annotated[
        float | None, typer.Option(help="Seconds each handler call may take (task option timeout).")
    ] = None,
    update_pending: Annotated[bool, typer.Option(help="Update a task no worker has started.")] = False,
    republish_finished: Annotated[bool, typer.Option(help="Start a finished key afresh.")] = False,
    allow_unknown: Annotated[
        bool, typer.Option(help="With --app: publish a name the app has no handler for.")
    ] = False,
    app_ref: AppRef = None,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Publish a task and print its key."""
    runner = make_runner(mongo_uri, database, collection, timeout, app_ref)
    options = {"concurrency": concurrency, "max_failures": max_failures, "local_retries": local_retries,
               "retry_backoff": retry_backoff, "ping_interval": ping_interval, "ping_timeout": ping_timeout,
               "worker_ids": worker_id or None, "timeout": run_timeout}  # fmt: skip
    task = run(_closing(runner, runner.publish(
        name, _parse_params(params), key=key, priority=priority, delay=delay, run_at=run_at,
        update_pending=update_pending, republish_finished=republish_finished, allow_unknown=allow_unknown,
        **{k: v for k, v in options.items() if v is not None},
    )))  # fmt: skip
    if not task.created:
        err.print(f"task {task.key!r} already exists (state {task.state}); not created", markup=False)
    print(task.key)


@app.command()
def show(
    key: Annotated[str, typer.Argument(help="Task key.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the task as JSON.")] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Show one task: summary, options and every worker entry."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    task = run(_closing(runner, runner.get(key)))
    if as_json:
        print(task.model_dump_json(indent=2))
    else:
        render_task(task)


def render_task(task: Task) -> None:
    summary = Table.grid(padding=(0, 2))
    summary.add_column(no_wrap=True)
    summary.add_column(overflow="fold")
    rows = [("key", task.key), ("name", task.name), ("state", task.state.value),
            ("priority", str(task.priority)), ("failures", f"{task.failures} of {task.options.max_failures}"),
            ("created", str(task.created_at)), ("run at", str(task.run_at)),
            ("claimable at", str(task.claimable_at or "-")), ("params", json.dumps(task.params)),
            ("options", task.options.model_dump_json())]  # fmt: skip
    for label, value in rows:
        summary.add_row(f"[bold]{label}[/]", value.replace("[", r"\["))
    out.print(summary)
    if task.workers:
        out.print(_entries_table(task))


def _entries_table(task: Task) -> Table:
    table = Table(title="workers")
    for column in ("worker", "run", "state", "attempt", "progress", "claimed", "expires", "finished",
                   "result / error"):  # fmt: skip
        table.add_column(column)
    for w in task.workers:
        outcome = f"{w.error.type}: {w.error.message}" if w.error else json.dumps(w.result, default=str)
        table.add_row(*map(_text, (w.worker_id, w.run_id[:8], w.state.value, w.attempt, _progress(w.progress),
                                   w.claimed_at, w.expires_at, w.finished_at or "-", outcome)))  # fmt: skip
    return table


def _progress(progress: Any) -> str:
    """``{fraction, message}`` from ``ctx.progress`` as '40% message'."""
    if not isinstance(progress, dict):
        return "-" if progress is None else str(progress)
    fraction, message = progress.get("fraction"), progress.get("message")
    shown = f"{fraction:.0%}" if isinstance(fraction, int | float) else "?"
    return f"{shown} {message}" if message else shown


# -- operations: each command is one call of the TaskRunner API --------------------------


class FinishedState(enum.StrEnum):
    success = "success"
    fail = "fail"
    canceled = "canceled"


def _seconds(text: str) -> float:
    """A duration option ('90', '30s', '15m', '12h', '7d', '2w') in seconds."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _retention(text: str) -> float:
    """``--retain-finished``: a duration of at least 1 s, or off/0 (remove the TTL index)."""
    if text.strip().lower() in ("off", "none"):
        return 0.0
    seconds = _seconds(text)
    if 0 < seconds < 1:
        raise typer.BadParameter("must be at least 1s (TTL indexes count whole seconds), or off")
    return seconds


def _text(value: object) -> Text:
    """A table cell shown verbatim (keys and messages may contain rich markup)."""
    return Text(str(value))


def _ago(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    seconds = max((now - moment).total_seconds(), 0.0)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"


@app.command("list")
def list_command(
    state: Annotated[
        TaskState | None, typer.Option(case_sensitive=False, help="Only tasks in this state.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Only tasks of this handler name.")] = None,
    worker_id: Annotated[str | None, typer.Option("--worker", help="Only tasks this worker claimed.")] = None,
    limit: Annotated[int, typer.Option(min=0, help="At most this many tasks (0: all).")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="One task per line as JSON.")] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """List tasks, oldest first."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    tasks = run(_closing(runner, runner.list_tasks(state=state, name=name, worker_id=worker_id, limit=limit)))
    if as_json:
        for task in tasks:
            print(task.model_dump_json())
    else:
        out.print(_tasks_table(tasks) if tasks else "no tasks match")


def _tasks_table(tasks: list[Task]) -> Table:
    table = Table(title=f"{len(tasks)} task{'' if len(tasks) == 1 else 's'}")
    for column in ("key", "name", "state", "priority", "workers", "age", "last error"):
        table.add_column(column, overflow="fold")
    now = datetime.now(UTC)
    for task in tasks:
        error = task.last_error
        entries = ", ".join(f"{w.worker_id} {w.state.value}" for w in task.workers) or "-"
        table.add_row(*map(_text, (task.key, task.name, task.state.value, task.priority, entries,
                                   _ago(task.created_at, now), f"{error.type}: {error.message}" if error else "-")))  # fmt: skip
    return table


@app.command()
def cancel(
    key: Annotated[str, typer.Argument(help="Task key.")],
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Cancel a PENDING or RUNNING task; running handlers stop at their next heartbeat."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    task = run(_closing(runner, runner.cancel(key)))
    print(f"{task.key}: {task.state.value}")


@app.command()
def retry(
    key: Annotated[str, typer.Argument(help="Task key.")],
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Make a FAIL or CANCELED task claimable again, with a fresh failure budget."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    task = run(_closing(runner, runner.retry(key)))
    print(f"{task.key}: {task.state.value}")


@app.command()
def purge(
    state: Annotated[
        list[FinishedState], typer.Option(case_sensitive=False, help="Finished state to delete (repeatable).")
    ],
    older_than: Annotated[
        float,
        typer.Option(parser=_seconds, metavar="DURATION", help="Finished at least this long ago: 30s, 7d."),
    ],
    dry_run: Annotated[bool, typer.Option(help="Only count what would be deleted.")] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Delete finished tasks in the given states that finished longer ago than --older-than."""
    states = [TaskState(s.value.upper()) for s in dict.fromkeys(state)]
    runner = make_runner(mongo_uri, database, collection, timeout)
    count = run(_closing(runner, runner.purge(states, older_than, dry_run=dry_run)))
    which = "/".join(s.value for s in states)
    print(f"{'would delete' if dry_run else 'deleted'} {count} {which} task{'' if count == 1 else 's'}")


@app.command("stats")
def stats_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print the numbers as JSON.")] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Task counts by name and state, the oldest pending task's age, the last hour's runs."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    numbers = run(_closing(runner, runner.stats()))
    if as_json:
        print(json.dumps({**numbers.model_dump(), "failure_rate_last_hour": numbers.failure_rate_last_hour}))
        return
    out.print(_counts_table(numbers))
    oldest = numbers.oldest_pending_seconds
    rate = numbers.failure_rate_last_hour
    out.print(f"running: {numbers.running}; oldest pending: {'-' if oldest is None else f'{oldest:.1f} s'}")
    out.print(f"last hour: {numbers.finished_last_hour} runs finished, {numbers.failed_last_hour} failed"
              + ("" if rate is None else f" ({rate:.0%})"))  # fmt: skip
    if numbers.paused:
        out.print(
            _text("paused: " + ("every task name" if ALL in numbers.paused else ", ".join(numbers.paused)))
        )
    if numbers.unserved:
        names = ", ".join(f"{name} ({count} pending)" for name, count in numbers.unserved.items())
        out.print(_text(f"no live worker serves: {names}"))


def _counts_table(numbers: TaskStats) -> Table:
    table = Table(title="tasks by name and state")
    table.add_column("name")
    for state in TaskState:
        table.add_column(state.value, justify="right")
    for name, counts in sorted(numbers.counts.items()):
        table.add_row(_text(name), *(str(counts.get(s.value, 0)) for s in TaskState))
    return table


@app.command("workers")
def workers_command(
    as_json: Annotated[bool, typer.Option("--json", help="One worker per line as JSON.")] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Live workers from the registry (a dead worker disappears 5 beats after its last one)."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    infos = run(_closing(runner, runner.workers()))
    if as_json:
        for info in infos:
            print(info.model_dump_json())
    else:
        out.print(_workers_table(infos) if infos else "no live workers")


def _workers_table(infos: list[WorkerInfo]) -> Table:
    table = Table(title=f"{len(infos)} live worker{'' if len(infos) == 1 else 's'}")
    for column in (
        "worker",
        "host",
        "pid",
        "started",
        "last beat",
        "in flight",
        "paused",
        "version",
        "status",
    ):
        table.add_column(column, overflow="fold")
    now = datetime.now(UTC)
    for w in infos:
        flight = f"{len(w.running)}/{w.concurrency}" + (f": {', '.join(w.running)}" if w.running else "")
        table.add_row(*map(_text, (w.worker_id, w.host, w.pid, w.started_at.strftime("%Y-%m-%d %H:%M:%S"),
                                   f"{_ago(w.beat_at, now)} ago", flight, ", ".join(w.paused) or "-",
                                   w.version or "-",
                                   "stopping" if w.stop_requested else "running")))  # fmt: skip
    return table


schedules_app = typer.Typer(
    help="Recurring schedules: list, pause, resume, trigger.", invoke_without_command=True
)
app.add_typer(schedules_app, name="schedules")


@schedules_app.callback()
def schedules_command(
    context: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="One schedule per line as JSON.")] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Stored schedules: expression, next 3 fire times in the schedule's zone, last task, paused, orphaned."""
    context.obj = (mongo_uri, database, collection, timeout)
    if context.invoked_subcommand is not None:
        return
    runner = make_runner(mongo_uri, database, collection, timeout)
    views = run(_closing(runner, runner.schedule_overview()))
    if as_json:
        for view in views:
            print(view.model_dump_json())
    else:
        out.print(_schedules_table(views) if views else "no schedules (workers store their app's at start)")


def _schedules_table(views: list[ScheduleView]) -> Table:
    table = Table(title=f"{len(views)} schedule{'' if len(views) == 1 else 's'}")
    for column in ("id", "task", "expression", "next fire times", "last task", "status"):
        table.add_column(column, overflow="fold")
    for view in views:
        status = ["orphaned"] if view.orphaned else []
        if view.schedule is None:
            table.add_row(
                *map(
                    _text, (view.id, "-", "-", "-", "-", ", ".join([*status, f"unreadable: {view.problem}"]))
                )
            )
            continue
        s = view.schedule
        zone = ZoneInfo(s.timezone)
        times = "\n".join(t.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %Z") for t in view.next_at)
        last = (
            f"{s.last_key} ({view.last_task.state.value if view.last_task else 'gone'})"
            if s.last_key
            else "-"
        )
        status = ["paused" if s.paused else "active", *status]
        table.add_row(*map(_text, (s.id, s.name, f"{s.recurrence.expression} ({s.timezone})", times, last,
                                   ", ".join(status))))  # fmt: skip
    return table


def _schedule_action(context: typer.Context, action: Callable[[TaskRunner], Coroutine[Any, Any, T]]) -> T:
    """Run one schedule coroutine on a runner built from the group's connection options."""
    runner = make_runner(*context.obj)
    return run(_closing(runner, action(runner)))


@schedules_app.command("pause")
def schedules_pause(
    context: typer.Context, schedule_id: Annotated[str, typer.Argument(metavar="ID", help="Schedule id.")]
) -> None:
    """Stop firing a schedule (ticks while paused never fire); running tasks are not touched."""
    _schedule_action(context, lambda runner: runner.pause_schedule(schedule_id))
    print(f"paused schedule {schedule_id}")


@schedules_app.command("resume")
def schedules_resume(
    context: typer.Context, schedule_id: Annotated[str, typer.Argument(metavar="ID", help="Schedule id.")]
) -> None:
    """Fire a paused schedule again from its next tick."""
    _schedule_action(context, lambda runner: runner.resume_schedule(schedule_id))
    print(f"resumed schedule {schedule_id}")


@schedules_app.command("trigger")
def schedules_trigger(
    context: typer.Context, schedule_id: Annotated[str, typer.Argument(metavar="ID", help="Schedule id.")]
) -> None:
    """Publish the schedule's task now, once (key ID@trigger-<server time>); its ticks are unchanged."""
    task = _schedule_action(context, lambda runner: runner.trigger_schedule(schedule_id))
    print(task.key)


def _pause_target(name: str | None, every: bool) -> str:
    if name is None and every:
        return ALL
    if name is None or every:
        fail("give a task NAME or --all (not both)")
    return name


@app.command("pause")
def pause_command(
    name: Annotated[str | None, typer.Argument(help="Task name.")] = None,
    every: Annotated[bool, typer.Option("--all", help="Pause every task name.")] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Stop workers claiming tasks of NAME (or of every name) within a second; running tasks finish, publishing goes on."""
    target = _pause_target(name, every)
    runner = make_runner(mongo_uri, database, collection, timeout)
    run(_closing(runner, runner.pause(target)))
    print("paused: every task name" if target == ALL else f"paused: {target}")


@app.command("resume")
def resume_command(
    name: Annotated[str | None, typer.Argument(help="Task name.")] = None,
    every: Annotated[bool, typer.Option("--all", help="Lift every pause.")] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Let workers claim NAME again (--all: lift every pause, of any name and the global one)."""
    target = _pause_target(name, every)
    runner = make_runner(mongo_uri, database, collection, timeout)

    async def resume() -> list[str]:
        await runner.resume(target)
        return await runner.paused()

    still = run(_closing(runner, resume()))
    print("resumed: every task name" if target == ALL else f"resumed: {target}")
    if ALL in still:
        err.print("note: every task name is still paused (taskrunner resume --all)")


@app.command("limit")
def limit_command(
    name: Annotated[str, typer.Argument(help="Task name.")],
    rate: Annotated[
        str | None,
        typer.Option(
            help="Most starts per sliding window across all workers: 10/s, 100/m, 5/10s; off lifts it."
        ),
    ] = None,
    max_running: Annotated[
        int | None, typer.Option(help="Most runs at once across all workers; 0 lifts it.", min=0)
    ] = None,
    clear: Annotated[
        bool, typer.Option(help="Drop operators' limits: the code's declaration applies.")
    ] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Set NAME's fleet-wide limits live (workers apply them within a second); with no option, show them."""
    runner = make_runner(mongo_uri, database, collection, timeout)

    async def limit() -> tuple[Limit, LimitState | None]:
        if rate is not None or max_running is not None or clear:
            await runner.limit(name, rate_limit=rate, max_running=max_running, clear=clear)
        return await runner.limits(name)

    in_force, state = run(_closing(runner, limit()))
    print(f"{name}: {in_force.describe()}")
    overrides = sorted(set(state.model_fields_set) & {"rate_limit", "max_running"}) if state else []
    if overrides:
        print("set by operators: " + ", ".join(overrides) + f" (taskrunner limit {name} --clear drops them)")


@app.command("stop-worker")
def stop_worker(
    worker_id: Annotated[str, typer.Argument(help="Worker id (see `taskrunner workers`).")],
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Ask a live worker to stop gracefully: at its next beat it stops claiming, releases its claims, exits 0."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    if not run(_closing(runner, runner.stop_worker(worker_id))):
        fail(f"no live worker with id {worker_id!r} (see `taskrunner workers`)")
    print(f"stop requested: worker {worker_id} shuts down at its next beat")


@app.command("wait")
def wait_command(
    key: Annotated[str, typer.Argument(help="Task key.")],
    within: Annotated[
        float | None,
        typer.Option(parser=_seconds, metavar="DURATION", help="Give up after this long (exit 3)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the finished task as JSON.")] = False,
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Wait until a task finishes: exit 0 on SUCCESS, 1 on FAIL or CANCELED, 3 if --within passes."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    try:
        task = asyncio.run(_closing(runner, runner.wait(key, within)))
    except WaitTimeout as exc:
        state = f" (still {exc.task.state.value})" if isinstance(exc.task, Task) else ""
        err.print(f"error: {exc}{state}", markup=False)
        raise typer.Exit(3) from None
    except TaskRunnerError as exc:
        fail(str(exc))
    if as_json:
        print(task.model_dump_json(indent=2))
    else:
        _print_outcome(task)
    if task.state is not TaskState.SUCCESS:
        raise typer.Exit(1)


def _print_outcome(task: Task) -> None:
    print(f"{task.key}: {task.state.value}")
    if task.state is TaskState.SUCCESS:
        print(f"results: {json.dumps(task.results, default=str)}")
    elif task.last_error is not None:
        print(f"last error: {task.last_error.type}: {task.last_error.message}")


@app.command()
def worker(
    app_ref: Annotated[
        str, typer.Option("--app", envvar="TASKRUNNER_APP", help="MODULE:OBJECT of a TaskRunner.")
    ],
    concurrency: Annotated[
        int, typer.Option(envvar="TASKRUNNER_CONCURRENCY", help="Handlers in flight.")
    ] = 10,
    worker_id: Annotated[
        str | None,
        typer.Option(
            envvar="TASKRUNNER_WORKER_ID", help="Worker id (default: host-pid-random, fresh per start)."
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(envvar="TASKRUNNER_SHUTDOWN_TIMEOUT", help="Seconds handlers may finish after SIGTERM."),
    ] = 0.5,
    poll_interval: Annotated[
        float,
        typer.Option(envvar="TASKRUNNER_POLL_INTERVAL", help="Seconds between scans without change streams."),
    ] = 5.0,
    discovery: Annotated[
        DiscoveryChoice,
        typer.Option(
            envvar="TASKRUNNER_DISCOVERY",
            help="stream: change streams (polling only if the server has none); poll: always scan.",
        ),
    ] = DiscoveryChoice.stream,
    batch: Annotated[
        int,
        typer.Option(
            envvar="TASKRUNNER_BATCH",
            min=1,
            help="Most tasks one claim round trip takes when slots are free.",
        ),
    ] = 32,
    beat_interval: Annotated[
        float,
        typer.Option(
            envvar="TASKRUNNER_BEAT_INTERVAL", help="Seconds between registry beats (entry lives 5x)."
        ),
    ] = 2.0,
    log_format: Annotated[
        LogFormatChoice, typer.Option(envvar="TASKRUNNER_LOG_FORMAT")
    ] = LogFormatChoice.console,
    log_level: Annotated[
        str, typer.Option(envvar="TASKRUNNER_LOG_LEVEL", help="debug|info|warning|error.")
    ] = "info",
    metrics_port: Annotated[
        int | None,
        typer.Option(
            envvar="TASKRUNNER_METRICS_PORT",
            min=0,
            max=65535,
            help="Serve Prometheus metrics on this port (needs the metrics extra; 0: any free port).",
        ),
    ] = None,
    metrics_host: Annotated[
        str,
        typer.Option(
            envvar="TASKRUNNER_METRICS_HOST",
            help="Address the metrics endpoint binds (all interfaces by default).",
        ),
    ] = "0.0.0.0",
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 10.0,
) -> None:
    """Run tasks: claim, heartbeat and finish them until SIGTERM/SIGINT (twice: exit at once)."""
    from taskrunner.logs import configure_logging
    from taskrunner.worker import Worker

    try:
        configure_logging(log_format.value, log_level)
    except ValueError as exc:
        fail(str(exc))
    runner = make_runner(mongo_uri, database, collection, timeout, app_ref)
    runner, counter = _count_roundtrips(runner)
    observer = None if metrics_port is None else _metrics_observer(metrics_port, metrics_host, runner)
    try:
        process = Worker(runner, concurrency=concurrency, worker_id=worker_id, shutdown_timeout=shutdown_timeout,
                         poll_interval=poll_interval, beat_interval=beat_interval, observer=observer,
                         batch=batch, discovery=discovery.value)  # fmt: skip
    except TaskRunnerError as exc:
        fail(str(exc))
    try:
        run(_closing(runner, _run_until_signalled(process)))
    finally:
        if counter is not None:
            import structlog

            counts = counter.snapshot()
            structlog.get_logger("taskrunner.worker").info(
                "round trips",
                worker_id=process.worker_id,
                total=sum(counts.values()),
                commands=counts,
                jobs=counter.by_job(),
                change_events=counter.events(),
            )


def _count_roundtrips(runner: TaskRunner) -> tuple[TaskRunner, RoundTripCounter | None]:
    """With TASKRUNNER_COUNT_ROUNDTRIPS=1, give the runner a store that counts its commands."""
    from taskrunner import roundtrips

    if not roundtrips.enabled():
        return runner, None
    from taskrunner.store.mongo import MongoStore

    counter = roundtrips.RoundTripCounter()
    store = MongoStore.connect(runner.mongo_uri, database=runner.database, collection=runner.collection,
                               timeout=runner.timeout, event_listeners=[counter])  # fmt: skip
    return runner.copy(store=store), counter


def _metrics_observer(port: int, host: str, runner: TaskRunner) -> WorkerObserver:
    """Start the Prometheus endpoint and return the observer that feeds it (docs/metrics.md)."""
    import structlog

    try:
        from taskrunner.metrics import PrometheusObserver, serve_metrics
    except ImportError as exc:
        fail(f"--metrics-port: {exc}")
    observer = PrometheusObserver(tasks=runner.registry.names())
    try:
        server, _ = serve_metrics(port, host=host)
    except OSError as exc:
        fail(f"--metrics-port: cannot serve metrics on {host}:{port}: {exc}")
    structlog.get_logger("taskrunner.metrics").info(
        "serving metrics", host=host, port=server.server_port, path="/metrics"
    )
    return observer


async def _run_until_signalled(process: Worker) -> None:
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            err.print("second signal: exiting at once; leases expire and other workers take over")
            os._exit(1)
        process.stop()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    await process.run()


@app.command("dev-server")
def dev_server(
    host: Annotated[str, typer.Option(envvar="TASKRUNNER_DEV_HOST", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="TASKRUNNER_DEV_PORT", help="Port to listen on.")] = 27017,
) -> None:
    """Serve an embedded MongoDB-compatible server (mongoeco) until SIGINT/SIGTERM."""
    from taskrunner.dev.server import serve

    def ready(uri: str) -> None:
        print(uri, flush=True)
        err.print("embedded MongoDB-compatible server ready; Ctrl-C to stop", markup=False)

    try:
        asyncio.run(serve(host, port, on_ready=ready))
    except (RuntimeError, OSError) as exc:
        fail(str(exc))


@app.command()
def demo(
    workers: Annotated[int, typer.Option(min=2, help="Worker processes to start (one is killed).")] = 3,
) -> None:
    """Run everything locally: embedded server, workers, sample tasks, a killed worker's takeover."""
    from taskrunner.dev.demo import run_demo

    try:
        ok = asyncio.run(run_demo(console=out, workers=workers))
    except (TaskRunnerError, OSError) as exc:
        fail(str(exc))
    if not ok:
        raise typer.Exit(1)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
