"""Commands on tasks: publish, show, list, wait, cancel, retry, purge."""

from __future__ import annotations

import enum
import json
import shlex
import warnings
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

from taskrunner.cli.app import app, command
from taskrunner.cli.options import AppRef, Connection, call, connected, fail, seconds
from taskrunner.errors import NoLiveWorkerWarning, WaitTimeout

if TYPE_CHECKING:
    from taskrunner.models import Task
    from taskrunner.runner import TaskRunner

Key = Annotated[str, typer.Argument(metavar="KEY", help="Task key.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the task as JSON.")]


def _duration(help_text: str) -> Any:
    """An option taking a duration (90, 1.5s, 30m, 2h, 7d), in seconds."""
    return typer.Option(parser=seconds, metavar="DURATION", help=help_text)


class StateChoice(enum.StrEnum):
    """``TaskState``'s values, without importing the models for ``--help``."""

    WAITING = "WAITING"
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAIL = "FAIL"
    CANCELED = "CANCELED"


class FinishedState(enum.StrEnum):
    success = "success"
    fail = "fail"
    canceled = "canceled"


def _parse_params(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"params: not valid JSON ({exc})")


@command(app)
@connected()
def publish(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Handler name.")],
    params: Annotated[
        str | None,
        typer.Option(
            metavar="JSON",
            help="Params as a JSON object (default {}); checked against the handler's model with --app.",
        ),
    ] = None,
    key: Annotated[str | None, typer.Option(help="Idempotency key (generated if absent).")] = None,
    priority: Annotated[int | None, typer.Option(help="Higher runs first (default 0).")] = None,
    delay: Annotated[
        float | None, _duration("Wait this long (server time) before the task may start.")
    ] = None,
    run_at: Annotated[
        datetime | None, typer.Option(metavar="ISO8601", help="Not before this time (UTC if naive).")
    ] = None,
    concurrency: Annotated[int | None, typer.Option(help="Distinct workers that must succeed.")] = None,
    max_failures: Annotated[int | None, typer.Option(help="Failed runs before the task is FAIL.")] = None,
    local_retries: Annotated[int | None, typer.Option(help="In-process retries per run.")] = None,
    retry_backoff: Annotated[float | None, _duration("Delay before a retry.")] = None,
    ping_interval: Annotated[float | None, _duration("Time between a run's heartbeats.")] = None,
    ping_timeout: Annotated[
        float | None, _duration("Time without a heartbeat before another worker takes over.")
    ] = None,
    worker_id: Annotated[
        list[str] | None, typer.Option(metavar="ID", help="Only this worker may run it (repeatable).")
    ] = None,
    run_timeout: Annotated[
        float | None,
        _duration(
            "How long each handler call may run before it fails (the task option timeout; --timeout is the server's)."
        ),
    ] = None,
    after: Annotated[
        list[str] | None,
        typer.Option(metavar="KEY", help="Run after this task succeeded (repeatable; WAITING until then)."),
    ] = None,
    run_on_upstream_failure: Annotated[
        bool,
        typer.Option(
            help="With --after: run once every upstream finished, even if one failed (else canceled)."
        ),
    ] = False,
    update_pending: Annotated[
        bool, typer.Option(help="Update a task no worker has started: only the options given here.")
    ] = False,
    republish_finished: Annotated[bool, typer.Option(help="Start a finished key afresh.")] = False,
    allow_unknown: Annotated[
        bool, typer.Option(help="With --app: publish a name the app has no handler for.")
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Do not warn when no live worker has a --worker-id (it is about to start)."
        ),
    ] = False,
    app_ref: AppRef = None,
    *,
    connection: Connection,
) -> None:
    """Publish a task and print its key (with --app or TASKRUNNER_APP, its params are validated first)."""
    from taskrunner.cli import render

    options = {
        "concurrency": concurrency,
        "max_failures": max_failures,
        "local_retries": local_retries,
        "retry_backoff": retry_backoff,
        "ping_interval": ping_interval,
        "ping_timeout": ping_timeout,
        "worker_ids": worker_id or None,
        "timeout": run_timeout,
    }
    given: dict[str, Any] = {k: v for k, v in options.items() if v is not None}

    async def publish_one(runner: TaskRunner) -> Task:
        with warnings.catch_warnings():
            if force:  # the operator means it: a worker with that id is about to start
                warnings.simplefilter("ignore", NoLiveWorkerWarning)
            return await runner.publish(
                name,
                None if params is None else _parse_params(params),
                key=key,
                priority=priority,
                delay=delay,
                run_at=run_at,
                after=after,
                on_upstream_failure="run" if run_on_upstream_failure else None,
                update_pending=update_pending,
                republish_finished=republish_finished,
                allow_unknown=allow_unknown,
                **given,
            )

    task = call(connection, publish_one, app_ref)
    if not task.created:
        render.stderr().print(
            f"task {task.key!r} already exists (state {task.state}); not created", markup=False
        )
    print(task.key)


DEPENDENTS_COUNTED = 1000
"""Tasks that run after a task ``show`` reads to count them (it lists the first ``render.LISTED``)."""


@command(app)
@connected()
def show(key: Key, as_json: AsJson = False, *, connection: Connection) -> None:
    """Show one task: summary, options, every worker entry, what it runs after and what runs after it."""
    from taskrunner.cli import render

    if as_json:
        task = call(connection, lambda runner: runner.get(key))
        render.print_json(task.model_dump_json(indent=2))
        return
    task, upstream, dependents = call(connection, lambda runner: _with_relations(runner, key))
    console = render.stdout()
    render.print_task(console, task)
    render.print_relations(console, task, upstream, dependents, DEPENDENTS_COUNTED)


async def _with_relations(runner: TaskRunner, key: str) -> tuple[Task, dict[str, Task], list[Task]]:
    """The task, the tasks it runs after (by key) and those that run after it."""
    task = await runner.get(key)
    upstream = await runner.upstream(key) if task.after else {}
    dependents = await runner.dependents(key, limit=DEPENDENTS_COUNTED) if task.dependents else []
    return task, upstream, dependents


@command(app, "list")
@connected()
def list_command(
    state: Annotated[
        StateChoice | None, typer.Option(case_sensitive=False, help="Only tasks in this state.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Only tasks of this handler name.")] = None,
    worker_id: Annotated[str | None, typer.Option("--worker", help="Only tasks this worker claimed.")] = None,
    flow: Annotated[
        str | None, typer.Option(metavar="ID", help="Only the steps and compensations of this flow.")
    ] = None,
    limit: Annotated[int, typer.Option(min=0, help="At most this many tasks (0: all).")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="One task per line as JSON.")] = False,
    *,
    connection: Connection,
) -> None:
    """List tasks, oldest first."""
    from taskrunner.cli import render
    from taskrunner.models import TaskState

    wanted = None if state is None else TaskState(state.value)
    if flow is None:
        tasks = call(
            connection,
            lambda runner: runner.list_tasks(state=wanted, name=name, worker_id=worker_id, limit=limit),
        )
    else:
        tasks = call(connection, lambda runner: _flow_tasks(runner, flow))
        tasks = [
            task
            for task in tasks
            if (wanted is None or task.state is wanted)
            and (name is None or task.name == name)
            and (worker_id is None or any(w.worker_id == worker_id for w in task.workers))
        ][: limit or None]
    if as_json:
        for task in tasks:
            render.print_json(task.model_dump_json())
    else:
        render.print_table(render.stdout(), render.tasks_table(tasks)) if tasks else print("no tasks match")


async def _flow_tasks(runner: TaskRunner, flow: str) -> list[Task]:
    """A flow's steps and compensations, oldest first; none for a flow id nobody used."""
    from taskrunner.errors import FlowNotFound

    try:
        view = await runner.get_flow(flow)
    except FlowNotFound:
        return []
    return sorted([*view.steps, *view.compensations], key=lambda task: task.created_at)


@command(app, "failed")
@connected()
def failed_command(
    name: Annotated[str | None, typer.Option(help="Only tasks of this handler name.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Tasks per page.")] = 20,
    after: Annotated[
        str | None, typer.Option(metavar="POSITION", help="Start after this position (printed under a page).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One task per line as JSON.")] = False,
    *,
    connection: Connection,
) -> None:
    """Failed tasks (the dead letters), the latest failure first, with each one's error."""
    from taskrunner.cli import render

    page = call(connection, lambda runner: runner.failed(name=name, limit=limit, after=after))
    if as_json:
        for task in page.tasks:
            render.print_json(task.model_dump_json())
    elif page.tasks:
        render.print_table(render.stdout(), render.failed_table(page.tasks))
    else:
        print("no failed tasks" if after is None else "no more failed tasks")
    if page.after is not None:
        again = ["taskrunner failed", *([f"--name {shlex.quote(name)}"] if name else []), f"--limit {limit}"]
        render.stderr().print(f"next page: {' '.join(again)} --after {shlex.quote(page.after)}", markup=False)


@command(app)
@connected()
def cancel(key: Key, *, connection: Connection) -> None:
    """Cancel a PENDING or RUNNING task; running handlers stop at their next heartbeat."""
    task = call(connection, lambda runner: runner.cancel(key))
    print(f"{task.key}: {task.state.value}")


@command(app)
@connected()
def retry(key: Key, *, connection: Connection) -> None:
    """Make a FAIL or CANCELED task claimable again, with a fresh failure budget."""
    task = call(connection, lambda runner: runner.retry(key))
    print(f"{task.key}: {task.state.value}")


@command(app)
@connected()
def purge(
    state: Annotated[
        list[FinishedState],
        typer.Option(
            case_sensitive=False,
            metavar="success|fail|canceled",
            help="Finished state to delete (repeatable).",
        ),
    ],
    older_than: Annotated[
        float,
        typer.Option(parser=seconds, metavar="DURATION", help="Finished at least this long ago: 30s, 7d."),
    ],
    dry_run: Annotated[bool, typer.Option(help="Only count what would be deleted.")] = False,
    *,
    connection: Connection,
) -> None:
    """Delete finished tasks in the given states that finished longer ago than --older-than."""
    from taskrunner.models import TaskState

    states = [TaskState(s.value.upper()) for s in dict.fromkeys(state)]
    count = call(connection, lambda runner: runner.purge(states, older_than, dry_run=dry_run))
    which = "/".join(s.value for s in states)
    print(f"{'would delete' if dry_run else 'deleted'} {count} {which} task{'' if count == 1 else 's'}")


@command(app, "wait")
@connected()
def wait_command(
    key: Key,
    within: Annotated[
        float | None,
        typer.Option(parser=seconds, metavar="DURATION", help="Give up after this long (exit 3)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the finished task as JSON.")] = False,
    *,
    connection: Connection,
) -> None:
    """Wait until a task finishes: exit 0 on SUCCESS, 1 on FAIL or CANCELED, 3 if --within passes."""
    from taskrunner.cli import render
    from taskrunner.models import Task, TaskState

    async def wait(runner: TaskRunner) -> Task | WaitTimeout:
        try:
            return await runner.wait(key, within)
        except WaitTimeout as exc:
            return exc

    task = call(connection, wait)
    if isinstance(task, WaitTimeout):
        state = f" (still {task.task.state.value})" if isinstance(task.task, Task) else ""
        render.stderr().print(f"error: {task}{state}", markup=False)
        raise typer.Exit(3)
    if as_json:
        render.print_json(task.model_dump_json(indent=2))
    else:
        print(*render.outcome_lines(task), sep="\n")
    if task.state is not TaskState.SUCCESS:
        raise typer.Exit(1)
