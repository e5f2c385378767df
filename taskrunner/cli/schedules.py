"""``taskrunner schedules``: list stored schedules; pause, resume or trigger one.

The group takes the connection options before its subcommand
(``taskrunner schedules --mongo-uri URI pause ID``), or from the environment.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from taskrunner.cli.app import app, command, typer_app
from taskrunner.cli.options import Connection, call, connected

if TYPE_CHECKING:
    from taskrunner.runner import TaskRunner

T = TypeVar("T")
ScheduleId = Annotated[str, typer.Argument(metavar="ID", help="Schedule id.")]

schedules_app = typer_app(
    help="Recurring schedules: without a command, list the stored ones; or pause, resume, trigger one.",
    invoke_without_command=True,
)
app.add_typer(schedules_app, name="schedules")


@schedules_app.callback()
@connected()
def schedules_command(
    context: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="One schedule per line as JSON.")] = False,
    *,
    connection: Connection,
) -> None:
    """Stored schedules: expression, next 3 fire times in the schedule's zone, last task, paused, orphaned."""
    context.obj = connection
    if context.invoked_subcommand is not None:
        return
    from taskrunner.cli import render

    views = call(connection, lambda runner: runner.schedule_overview())
    if as_json:
        for view in views:
            render.print_json(view.model_dump_json())
    else:
        console = render.stdout()
        console.print(
            render.schedules_table(views) if views else "no schedules (workers store their app's at start)"
        )


def _action(context: typer.Context, action: Callable[[TaskRunner], Awaitable[T]]) -> T:
    """Run one schedule coroutine with the group's connection options."""
    connection: Connection = context.obj
    return call(connection, action)


@command(schedules_app, "pause")
def schedules_pause(context: typer.Context, schedule_id: ScheduleId) -> None:
    """Stop firing a schedule (ticks while paused never fire); running tasks are not touched."""
    _action(context, lambda runner: runner.pause_schedule(schedule_id))
    print(f"paused schedule {schedule_id}")


@command(schedules_app, "resume")
def schedules_resume(context: typer.Context, schedule_id: ScheduleId) -> None:
    """Fire a paused schedule again from its next tick."""
    _action(context, lambda runner: runner.resume_schedule(schedule_id))
    print(f"resumed schedule {schedule_id}")


@command(schedules_app, "trigger")
def schedules_trigger(context: typer.Context, schedule_id: ScheduleId) -> None:
    """Publish the schedule's task now, once (key ID@trigger-<server time>); its ticks are unchanged."""
    task = _action(context, lambda runner: runner.trigger_schedule(schedule_id))
    print(task.key)
