"""Commands on the collection and the fleet: init, stats, workers, stop-worker."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from taskrunner.cli.app import app, command
from taskrunner.cli.options import Connection, call, connected, fail, seconds
from taskrunner.store import fields as f

if TYPE_CHECKING:
    from taskrunner.runner import TaskRunner
    from taskrunner.store.preflight import ServerCheck


def _retention(text: str) -> float:
    """``--retain-finished``: a duration of at least 1 s, or off/0 (remove the TTL index)."""
    if text.strip().lower() in ("off", "none"):
        return 0.0
    duration = seconds(text)
    if 0 < duration < 1:
        raise typer.BadParameter("must be at least 1s (TTL indexes count whole seconds), or off")
    return duration


@command(app)
@connected()
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
    retain_failed: Annotated[
        float | None,
        typer.Option(
            parser=_retention,
            metavar="DURATION|off",
            help="Keep FAIL and CANCELED tasks this long instead (TTL index of their own); off: as finished ones.",
        ),
    ] = None,
    *,
    connection: Connection,
) -> None:
    """Create the task collection's indexes (idempotent); optionally the validator and retention."""
    from taskrunner.cli import render

    runner, checked = call(
        connection, lambda runner: _init(runner, validator, retain_finished, retain_failed)
    )
    for line in checked.warnings:  # the start-up check's findings (docs/compatibility.md)
        render.stderr().print(f"warning: {line}", markup=False)
    what = f"indexes {', '.join(f.INDEXES)}" + (" and validator" if validator else "")
    print(f"initialised {runner.database}.{runner.collection}: {what}")
    if retain_finished == 0:
        print(f"retention off: no TTL index {f.RETENTION_INDEX}; finished tasks stay until purged")
    elif retain_finished is not None:
        print(
            f"retention: TTL index {f.RETENTION_INDEX} deletes tasks {int(retain_finished)} s after they finish"
        )
    if retain_failed == 0:
        print(
            f"failed retention off: no TTL index {f.FAILED_RETENTION_INDEX}; FAIL and CANCELED tasks are kept"
        )
        print(f"  as finished ones are ({f.RETENTION_INDEX}, if installed, covers every finished task)")
    elif retain_failed is not None:
        print(
            f"failed retention: TTL index {f.FAILED_RETENTION_INDEX} deletes FAIL and CANCELED tasks "
            f"{int(retain_failed)} s after they finish; {f.RETENTION_INDEX}, if installed, covers SUCCESS only"
        )


async def _init(
    runner: TaskRunner, validator: bool, retain_finished: float | None, retain_failed: float | None
) -> tuple[TaskRunner, ServerCheck]:
    checked = await runner.init(
        validator=validator, retain_finished=retain_finished, retain_failed=retain_failed
    )
    return runner, checked


@command(app, "stats")
@connected()
def stats_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print the numbers as JSON.")] = False,
    *,
    connection: Connection,
) -> None:
    """Task counts by name and state, the oldest pending task's age, the last hour's runs."""
    from taskrunner.cli import render

    numbers = call(connection, lambda runner: runner.stats())
    if as_json:
        rate = numbers.failure_rate_last_hour
        render.print_json(json.dumps({**numbers.model_dump(), "failure_rate_last_hour": rate}))
        return
    console = render.stdout()
    render.print_table(console, render.counts_table(numbers))
    for line in render.stats_lines(numbers):
        console.print(render.text(line))


@command(app, "workers")
@connected()
def workers_command(
    as_json: Annotated[bool, typer.Option("--json", help="One worker per line as JSON.")] = False,
    *,
    connection: Connection,
) -> None:
    """Live workers from the registry (a dead worker disappears 5 beats after its last one)."""
    from taskrunner.cli import render

    infos = call(connection, lambda runner: runner.workers())
    if as_json:
        for info in infos:
            render.print_json(info.model_dump_json())
    else:
        render.print_table(render.stdout(), render.workers_table(infos)) if infos else print(
            "no live workers"
        )


@command(app, "stop-worker")
@connected()
def stop_worker(
    worker_id: Annotated[str, typer.Argument(metavar="ID", help="Worker id (see `taskrunner workers`).")],
    *,
    connection: Connection,
) -> None:
    """Ask a live worker to stop gracefully: at its next beat it stops claiming, releases its claims, exits 0."""
    if not call(connection, lambda runner: runner.stop_worker(worker_id)):
        fail(f"no live worker with id {worker_id!r} (see `taskrunner workers`)")
    print(f"stop requested: worker {worker_id} shuts down at its next beat")
