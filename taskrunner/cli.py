"""The ``taskrunner`` command. Each command calls the public coroutine a user would.

Every error ends in ``fail()``: one line on stderr naming the problem, exit code 1
(typer reports bad arguments with exit code 2).
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import signal
import sys
from collections.abc import Coroutine
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from taskrunner import fields as f
from taskrunner.errors import TaskRunnerError
from taskrunner.models import Task
from taskrunner.redact import redact
from taskrunner.runner import DEFAULT_URI, TaskRunner

if TYPE_CHECKING:
    from taskrunner.worker import Worker

T = TypeVar("T")


class LogFormatChoice(enum.StrEnum):
    json = "json"
    console = "console"


app = typer.Typer(help="Background tasks as readable MongoDB documents.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)  # fmt: skip
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
    mongo_uri: MongoUri = None,
    database: Database = None,
    collection: Collection = None,
    timeout: Timeout = 5.0,
) -> None:
    """Create the task collection's indexes (idempotent)."""
    runner = make_runner(mongo_uri, database, collection, timeout)
    run(_closing(runner, runner.init(validator=validator)))
    out.print(f"initialised {runner.database}.{runner.collection}: indexes {', '.join(f.INDEXES)}"
              + (" and validator" if validator else ""))  # fmt: skip


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
    update_pending: Annotated[bool, typer.Option(help="Update a task no worker has started.")] = False,
    republish_finished: Annotated[bool, typer.Option(help="Start a finished key afresh.")] = False,
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
               "worker_ids": worker_id or None}  # fmt: skip
    task = run(_closing(runner, runner.publish(
        name, _parse_params(params), key=key, priority=priority, delay=delay, run_at=run_at,
        update_pending=update_pending, republish_finished=republish_finished,
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
    for column in ("worker", "run", "state", "attempt", "claimed", "expires", "finished", "result / error"):
        table.add_column(column)
    for w in task.workers:
        outcome = f"{w.error.type}: {w.error.message}" if w.error else json.dumps(w.result)
        table.add_row(w.worker_id, w.run_id[:8], w.state.value, str(w.attempt), str(w.claimed_at),
                      str(w.expires_at), str(w.finished_at or "-"), outcome)  # fmt: skip
    return table


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
    try:
        process = Worker(runner, concurrency=concurrency, worker_id=worker_id, shutdown_timeout=shutdown_timeout,
                         poll_interval=poll_interval, beat_interval=beat_interval)  # fmt: skip
    except TaskRunnerError as exc:
        fail(str(exc))
    run(_closing(runner, _run_until_signalled(process)))


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
    from taskrunner.embedded import serve

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
    from taskrunner.demo import run_demo

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
