"""``taskrunner flow ID``: a flow's state, its graph by level, its steps and compensations."""

from __future__ import annotations

from typing import Annotated

import typer

from taskrunner.cli.app import app, command
from taskrunner.cli.options import Connection, call, connected


@command(app, "flow")
@connected()
def flow_command(
    flow_id: Annotated[str, typer.Argument(metavar="ID", help="Flow id (runner.flow(ID)).")],
    limit: Annotated[int, typer.Option(min=0, help="List at most this many steps (0: all).")] = 100,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the flow (state, every step and compensation) as JSON.")
    ] = False,
    *,
    connection: Connection,
) -> None:
    """Show a flow: its state, its graph by level, its steps (what each runs after and waits on), its compensations."""
    from taskrunner.cli import render

    view = call(connection, lambda runner: runner.get_flow(flow_id))
    if as_json:
        render.print_json(view.model_dump_json(indent=2))
    else:
        render.print_flow(render.stdout(), view, limit)
