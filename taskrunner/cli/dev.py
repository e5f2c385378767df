"""Commands for development: ``dev-server`` (the embedded server) and ``demo``."""

from __future__ import annotations

from typing import Annotated

import typer

from taskrunner.cli.app import app, command
from taskrunner.cli.options import fail
from taskrunner.errors import TaskRunnerError


@command(app, "dev-server")
def dev_server(
    host: Annotated[str, typer.Option(envvar="TASKRUNNER_DEV_HOST", help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="TASKRUNNER_DEV_PORT", help="Port to listen on.")] = 27017,
) -> None:
    """Serve an embedded MongoDB-compatible server (mongoeco) until SIGINT/SIGTERM."""
    import asyncio

    from taskrunner.cli import render
    from taskrunner.cli.signals import Signalled, cancelled_by_signal
    from taskrunner.dev.server import serve

    def ready(uri: str) -> None:
        print(uri, flush=True)
        render.stderr().print("embedded MongoDB-compatible server ready; Ctrl-C to stop", markup=False)

    try:
        asyncio.run(cancelled_by_signal(serve(host, port, on_ready=ready), at_once="exiting at once"))
    except Signalled:
        return
    except (RuntimeError, OSError) as exc:
        fail(str(exc))


@command(app)
def demo(
    workers: Annotated[int, typer.Option(min=2, help="Worker processes to start (one is killed).")] = 3,
) -> None:
    """Run everything locally: embedded server, workers, sample tasks, a killed worker's takeover."""
    import asyncio
    import signal

    from taskrunner.cli import render
    from taskrunner.cli.signals import Signalled, cancelled_by_signal
    from taskrunner.dev.demo import run_demo

    at_once = "exiting at once; the demo's workers may outlive it"
    try:
        ok = asyncio.run(
            cancelled_by_signal(run_demo(console=render.stdout(), workers=workers), at_once=at_once)
        )
    except Signalled as stopped:
        if stopped.signum is signal.SIGINT:
            raise KeyboardInterrupt from None
        fail("demo terminated by SIGTERM; workers and server stopped")
    except (TaskRunnerError, OSError) as exc:
        fail(str(exc))
    if not ok:
        raise typer.Exit(1)
