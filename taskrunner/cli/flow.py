"""Commands on the flow of tasks: pause, resume, limit (applied by workers within a second)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from taskrunner.cli.app import app, command
from taskrunner.cli.options import Connection, call, connected, fail

if TYPE_CHECKING:
    from taskrunner.limits.state import LimitView
    from taskrunner.runner import TaskRunner

Name = Annotated[str | None, typer.Argument(metavar="NAME", help="Task name.")]


def _pause_target(name: str | None, every: bool) -> str:
    from taskrunner.limits.state import ALL

    if name is None and every:
        return ALL
    if name is None or every:
        fail("give a task NAME or --all (not both)")
    return name


Force = Annotated[
    bool,
    typer.Option(
        "--force", help="Do not check that a live worker serves NAME (no warning): e.g. ahead of a deploy."
    ),
]


@command(app, "pause")
@connected()
def pause_command(
    name: Name = None,
    every: Annotated[bool, typer.Option("--all", help="Pause every task name.")] = False,
    force: Force = False,
    *,
    connection: Connection,
) -> None:
    """Stop workers claiming tasks of NAME (or of every name) within a second; running tasks finish, publishing goes on."""
    from taskrunner.limits.state import ALL

    target = _pause_target(name, every)
    call(connection, lambda runner: runner.pause(target, force=force))
    print("paused: every task name" if target == ALL else f"paused: {target}")


@command(app, "resume")
@connected()
def resume_command(
    name: Name = None,
    every: Annotated[bool, typer.Option("--all", help="Lift every pause.")] = False,
    *,
    connection: Connection,
) -> None:
    """Let workers claim NAME again (--all: lift every pause, of any name and the global one)."""
    from taskrunner.cli import render
    from taskrunner.limits.state import ALL

    target = _pause_target(name, every)

    async def resume(runner: TaskRunner) -> list[str]:
        await runner.resume(target)
        return await runner.paused()

    still = call(connection, resume)
    print("resumed: every task name" if target == ALL else f"resumed: {target}")
    if ALL in still:
        render.stderr().print("note: every task name is still paused (taskrunner resume --all)")


@command(app, "limit")
@connected()
def limit_command(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Task name.")],
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
    force: Force = False,
    *,
    connection: Connection,
) -> None:
    """Set NAME's fleet-wide limits live (workers apply them within a second); with no option, show them."""

    async def limit(runner: TaskRunner) -> LimitView:
        if rate is not None or max_running is not None or clear:
            await runner.set_limits(name, rate_limit=rate, max_running=max_running, clear=clear, force=force)
        return await runner.limits(name)

    view = call(connection, limit)
    in_force, state = view.in_force, view.stored
    print(f"{name}: {in_force.describe()}")
    overrides = sorted(set(state.model_fields_set) & {"rate_limit", "max_running"}) if state else []
    if overrides:
        print("set by operators: " + ", ".join(overrides) + f" (taskrunner limit {name} --clear drops them)")
