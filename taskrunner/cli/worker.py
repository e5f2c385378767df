"""``taskrunner worker``: run tasks until SIGTERM/SIGINT (another one a second later: exit at once)."""

from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from taskrunner import worker_defaults as defaults
from taskrunner.cli.app import app, command
from taskrunner.cli.options import Connection, connected, fail, run, seconds
from taskrunner.errors import TaskRunnerError

if TYPE_CHECKING:
    from taskrunner.engine.observe import WorkerObserver
    from taskrunner.engine.worker import Worker
    from taskrunner.observability.roundtrips import RoundTripCounter
    from taskrunner.runner import TaskRunner


class LogFormatChoice(enum.StrEnum):
    json = "json"
    console = "console"


class DiscoveryChoice(enum.StrEnum):
    stream = "stream"
    poll = "poll"


DEFAULT_DISCOVERY = DiscoveryChoice(defaults.DISCOVERY)


@command(app)
@connected(timeout=10.0)
def worker(
    app_ref: Annotated[
        str,
        typer.Option(
            "--app",
            envvar="TASKRUNNER_APP",
            metavar="MODULE:OBJECT",
            help="Your TaskRunner, whose handlers this worker runs (the current directory first on sys.path).",
        ),
    ],
    concurrency: Annotated[
        int, typer.Option(envvar="TASKRUNNER_CONCURRENCY", help="Handlers in flight.")
    ] = defaults.CONCURRENCY,
    worker_id: Annotated[
        str | None,
        typer.Option(
            envvar="TASKRUNNER_WORKER_ID", help="Worker id (default: host-pid-random, fresh per start)."
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            envvar="TASKRUNNER_SHUTDOWN_TIMEOUT",
            parser=seconds,
            metavar="DURATION",
            help="How long running handlers may finish after SIGTERM before their claims are released.",
        ),
    ] = defaults.SHUTDOWN_TIMEOUT,
    poll_interval: Annotated[
        float,
        typer.Option(
            envvar="TASKRUNNER_POLL_INTERVAL",
            parser=seconds,
            metavar="DURATION",
            help="Time between scans for tasks without change streams.",
        ),
    ] = defaults.POLL_INTERVAL,
    discovery: Annotated[
        DiscoveryChoice,
        typer.Option(
            envvar="TASKRUNNER_DISCOVERY",
            help="stream: change streams (polling only if the server has none); poll: always scan.",
        ),
    ] = DEFAULT_DISCOVERY,
    batch: Annotated[
        int,
        typer.Option(
            envvar="TASKRUNNER_BATCH",
            min=1,
            help="Most tasks one claim round trip takes when slots are free.",
        ),
    ] = defaults.BATCH,
    beat_interval: Annotated[
        float,
        typer.Option(
            envvar="TASKRUNNER_BEAT_INTERVAL",
            parser=seconds,
            metavar="DURATION",
            help="Time between registry beats (an entry lives 5 beats).",
        ),
    ] = defaults.BEAT_INTERVAL,
    drain: Annotated[
        bool,
        typer.Option(
            "--drain",
            envvar="TASKRUNNER_DRAIN",
            help="Exit once nothing runs here and nothing is claimable now (tasks due later stay).",
        ),
    ] = False,
    log_format: Annotated[
        LogFormatChoice,
        typer.Option(
            envvar="TASKRUNNER_LOG_FORMAT",
            help="console: one readable line per event; json: one JSON object per line, for log stores.",
        ),
    ] = LogFormatChoice.console,
    log_level: Annotated[
        str,
        typer.Option(
            envvar="TASKRUNNER_LOG_LEVEL",
            metavar="LEVEL",
            help="Least level logged: debug, info, warning, error.",
        ),
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
    *,
    connection: Connection,
) -> None:
    """Run tasks: claim, heartbeat and finish them until SIGTERM/SIGINT (another one a second later or more: exit at once)."""
    from taskrunner.observability.logs import configure_logging

    try:
        configure_logging(log_format.value, log_level)
    except ValueError as exc:
        fail(str(exc))
    end_tracing = _configure_tracing()
    runner, counter = count_roundtrips(connection.runner(app_ref))
    observer = None if metrics_port is None else _metrics_observer(metrics_port, metrics_host, runner)
    try:
        process = _make_worker(
            runner,
            observer,
            concurrency=concurrency,
            worker_id=worker_id,
            shutdown_timeout=shutdown_timeout,
            poll_interval=poll_interval,
            beat_interval=beat_interval,
            batch=batch,
            discovery=discovery.value,
            drain=drain,
        )
    except TaskRunnerError as exc:
        fail(str(exc))
    try:
        run(_run_until_signalled(runner, process))
    finally:
        if counter is not None:
            _log_roundtrips(process.worker_id, counter)
        if end_tracing is not None:
            end_tracing()  # exports the spans still buffered


def _configure_tracing() -> Callable[[], None] | None:
    """The OpenTelemetry SDK from the OTEL_* variables, when they ask for it and the otel
    extra is installed (docs/observability.md); returns what flushes it at exit."""
    import os

    from taskrunner.observability.logs import get_logger
    from taskrunner.observability.tracing import configure_sdk

    try:
        end = configure_sdk()
    except Exception as exc:  # an exporter that cannot load: say so and run untraced
        get_logger("taskrunner.tracing").error("could not configure OpenTelemetry tracing", error=str(exc))
        return None
    if end is not None:
        get_logger("taskrunner.tracing").info("tracing on", exporter=os.environ.get("OTEL_TRACES_EXPORTER"))
    return end


def _make_worker(runner: TaskRunner, observer: WorkerObserver | None, **options: Any) -> Worker:
    """The one place the command builds its ``Worker``: the same ``WorkerOptions`` model
    that ``Worker`` and ``TaskRunner.run_worker`` take (a bad value names the option)."""
    from taskrunner.engine.worker import Worker
    from taskrunner.worker_options import WorkerOptions

    return Worker(runner, WorkerOptions(**options), observer=observer)


async def _run_until_signalled(runner: TaskRunner, process: Worker) -> None:
    """Run until stopped; signals stay handled while the store closes (a duplicate of the
    stop signal, as ``uv run`` forwards one, must not interrupt the cleanup)."""
    from taskrunner.cli.signals import stop_signals

    with stop_signals(
        lambda signum: _stopping(process, signum),
        at_once="exiting at once; leases expire and other workers take over",
    ):
        try:
            await process.run()
        finally:
            await runner.close()


def _stopping(process: Worker, signum: signal.Signals) -> None:
    process.log.info("stopping gracefully", signal=signum.name)
    process.stop()


def count_roundtrips(runner: TaskRunner) -> tuple[TaskRunner, RoundTripCounter | None]:
    """With TASKRUNNER_COUNT_ROUNDTRIPS=1, give the runner a store that counts its commands."""
    from taskrunner.observability import roundtrips

    if not roundtrips.enabled():
        return runner, None
    from taskrunner.store.mongo import MongoStore

    counter = roundtrips.RoundTripCounter()
    store = MongoStore.connect(
        runner.mongo_uri,
        database=runner.database,
        collection=runner.collection,
        timeout=runner.timeout,
        event_listeners=[counter],
    )
    return runner.copy(store=store), counter


def _log_roundtrips(worker_id: str, counter: RoundTripCounter) -> None:
    from taskrunner.observability.logs import get_logger

    counts = counter.snapshot()
    get_logger("taskrunner.worker").info(
        "round trips",
        worker_id=worker_id,
        total=sum(counts.values()),
        commands=counts,
        jobs=counter.by_job(),
        change_events=counter.events(),
    )


def _metrics_observer(port: int, host: str, runner: TaskRunner) -> WorkerObserver:
    """Start the Prometheus endpoint and return the observer that feeds it (docs/metrics.md)."""
    from taskrunner.observability.logs import get_logger

    try:
        from taskrunner.observability.metrics import PrometheusObserver, serve_metrics
    except ImportError as exc:
        fail(f"--metrics-port: {exc}")
    observer = PrometheusObserver(tasks=runner.handlers.names())
    try:
        server, _ = serve_metrics(port, host=host)
    except OSError as exc:
        fail(f"--metrics-port: cannot serve metrics on {host}:{port}: {exc}")
    get_logger("taskrunner.metrics").info(
        "serving metrics", host=host, port=server.server_port, path="/metrics"
    )
    return observer
