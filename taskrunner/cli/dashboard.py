"""``taskrunner dashboard``: the web dashboard (needs the ``dashboard`` extra)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from taskrunner.cli.app import app, command
from taskrunner.cli.options import AppRef, Connection, connected, fail


@command(app)
@connected()
def dashboard(
    connection: Connection,
    host: Annotated[str, typer.Option(help="Address to bind (anything but loopback warns).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    allow_actions: Annotated[
        bool,
        typer.Option(
            "--allow-actions",
            help="Allow cancel, retry, purge, pause, stop and trigger to browsers that present "
            "the token ($TASKRUNNER_DASHBOARD_TOKEN, else made up and printed).",
        ),
    ] = False,
    app_ref: AppRef = None,
) -> None:
    """Serve a live web view of tasks, workers, schedules and limits until Ctrl-C."""
    import asyncio

    try:
        from taskrunner.dashboard import serve_dashboard
    except ImportError as exc:
        fail(f"the dashboard needs its extra: pip install 'taskrunner[dashboard]' ({exc})")
    runner = connection.runner(app_ref)
    token = os.environ.get("TASKRUNNER_DASHBOARD_TOKEN") or None

    async def serve() -> None:
        try:
            await serve_dashboard(runner, host=host, port=port, allow_actions=allow_actions, token=token)
        finally:
            await runner.close()

    try:
        asyncio.run(serve())
    except OSError as exc:
        fail(str(exc))
