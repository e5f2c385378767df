"""Tracing's cost: worker CPU per task with tracing off, with the OpenTelemetry API only, and on.

Levels, run side by side in every round (each on a fresh collection of one embedded server,
``taskrunner dev-server --port 0``, with a fresh worker):

    off      opentelemetry not importable (as without the ``otel`` extra)
    api      the API installed, no SDK tracer provider (a library user who traces nothing)
    on       an SDK tracer provider, every span sampled, a BatchSpanProcessor whose exporter
             discards the spans (taskrunner's cost, not an exporter's)
    console  (only if asked) as ``on``, with the SDK's console exporter writing to /dev/null

One worker of C slots runs N ``noop`` tasks (bench/apps.py), either in this process
(``--modes inprocess``: a ``Worker`` object; the tasks are published before it starts, and
this process's CPU time counts from its start to the last task's end) or as a ``taskrunner
worker`` process (``--modes processes``; its CPU time, from /proc, counts from its
registration to the last task's end: start-up is not counted). Per level, medians of
``--rounds`` rounds:

    cpu_ms_per_task      worker CPU time (user + system) / N
    spans_per_task       spans exported / N (in-process only; 1 with tracing on: the run's)
    seconds              first claimed_at to last finished_at (server times)
    ratio_cpu            the level's cpu_ms_per_task / off's

    uv run python bench/tracing.py [--tasks 2000] [--concurrency 10] [--rounds 5]
                                   [--modes inprocess,processes] [--levels off,api,on] [--hog]
                                   [--smoke] [--results PATH]

``--hog`` keeps both cores busy beside it (two spinning processes), as bench/versus.py does.
Prints one JSON line per mode (config {"mode", "concurrency", "tasks", "rounds", "hog"}),
the levels under ``levels``. ``--smoke`` runs N = 20, one round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from apps import app
from common import add_common_args, emit
from processes import Processes, dev_server, wait_until
from versus import cpu_hog

from taskrunner import TaskRunner
from taskrunner.engine.worker import Worker
from taskrunner.models import TaskState
from taskrunner.observability import tracing
from taskrunner.observability.logs import configure_logging
from taskrunner.store.mongo import MongoStore

MODES = ("inprocess", "processes")
LEVELS = ("off", "api", "on", "console")
CLOCK_TICK = os.sysconf("SC_CLK_TCK")

# A worker process at a tracing level: ``python -c WORKER LEVEL worker ARGS``.
WORKER = """
import os, sys
level = sys.argv[1]
if level == "off":
    sys.modules["opentelemetry"] = None  # import opentelemetry raises ImportError
elif level in ("on", "console"):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult

    class Discard(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    exporter = ConsoleSpanExporter(out=open(os.devnull, "w")) if level == "console" else Discard()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
from taskrunner.cli import main
sys.argv = ["taskrunner", *sys.argv[2:]]
main()
"""


def specs(n: int) -> list[dict[str, Any]]:
    return [{"name": "noop", "key": f"t{i:05}"} for i in range(n)]


@contextmanager
def in_process_level(level: str) -> Iterator[list[int]]:
    """This process's tracing at ``level`` (taskrunner's cached check, set by hand); yields
    the count of spans exported, complete once the block is left."""
    provider, exported = None, [0]
    tracing.reset()
    if level == "off":
        tracing._absent = True
    elif level in ("on", "console"):
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
            SpanExportResult,
        )

        class Discard(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                exported[0] += len(spans)
                return SpanExportResult.SUCCESS

        class Console(ConsoleSpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                exported[0] += len(spans)
                return super().export(spans)

        sink = open(os.devnull, "w")  # noqa: SIM115 - closed below
        exporter = Console(out=sink) if level == "console" else Discard()
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        tracing._tracer = provider.get_tracer("taskrunner")
    try:
        yield exported
    finally:
        if provider is not None:
            provider.shutdown()
            sink.close()
        tracing.reset()


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


async def all_done(runner: TaskRunner, n: int) -> bool:
    return await runner.store.count(state=TaskState.SUCCESS) >= n


async def span_of_runs(runner: TaskRunner) -> float:
    tasks = await runner.store.find(state=TaskState.SUCCESS, limit=1_000_000)
    first = min(w.claimed_at for t in tasks for w in t.workers)
    last = max(w.finished_at for t in tasks for w in t.workers if w.finished_at is not None)
    return (last - first).total_seconds()


async def in_process(
    uri: str, collection: str, level: str, n: int, concurrency: int
) -> tuple[float, float, int]:
    """Worker CPU seconds, run seconds and spans exported of N tasks run by a ``Worker`` in
    this process."""
    runner = TaskRunner(store=MongoStore.connect(uri, collection=collection))
    try:
        await runner.init()
        await runner.publish_many(specs(n))  # before the worker and the level: not counted
        with in_process_level(level) as exported:
            worker = Worker(
                app.copy(store=MongoStore.connect(uri, collection=collection)), concurrency=concurrency
            )
            start = time.process_time()
            running = asyncio.create_task(worker.run())
            await wait_until(lambda: all_done(runner, n), max(300.0, 0.5 * n), f"{level}: {n} tasks", 0.5)
            cpu = time.process_time() - start
            worker.stop()
            await running
        return cpu, await span_of_runs(runner), exported[0]
    finally:
        await runner.close()


async def in_worker_process(
    procs: Processes, uri: str, collection: str, level: str, n: int, concurrency: int
) -> tuple[float, float, int | None]:
    """Worker CPU seconds and run seconds of N tasks run by a ``taskrunner worker`` process
    (its spans are not counted: None)."""
    runner = TaskRunner(store=MongoStore.connect(uri, collection=collection))
    name = f"{collection}-w"
    try:
        await runner.init()
        command = [sys.executable, "-c", WORKER, level, "worker", "--app", "apps:app", "--worker-id", name]
        procs.start(
            name,
            [*command, "--log-format", "json", "--concurrency", str(concurrency)],
            env={"TASKRUNNER_COLLECTION": collection},
        )

        async def registered() -> bool:
            return len(await runner.workers()) >= 1

        await wait_until(registered, 120, f"{name} to register", interval=0.1)
        pid = procs.group[name].pid
        start = proc_cpu(pid)
        await runner.publish_many(specs(n))
        await wait_until(lambda: all_done(runner, n), max(300.0, 0.5 * n), f"{level}: {n} tasks", 0.5)
        cpu = proc_cpu(pid) - start
        procs.group[name].terminate()
        await procs.wait_exit(name, 30)
        return cpu, await span_of_runs(runner), None
    except Exception:
        print(f"--- {name} ---\n{procs.tail(name)}")
        raise
    finally:
        await runner.close()


async def measure(mode: str, n: int, concurrency: int, rounds: int, levels: list[str]) -> dict[str, Any]:
    samples: dict[str, list[tuple[float, float, int | None]]] = {level: [] for level in levels}
    with dev_server() as uri, Processes(uri, "tracing") as procs:
        for r in range(rounds):
            for level in levels:  # side by side: each round runs every level once
                collection = f"r{r}_{level}"
                if mode == "inprocess":
                    sample = await in_process(uri, collection, level, n, concurrency)
                else:
                    sample = await in_worker_process(procs, uri, collection, level, n, concurrency)
                samples[level].append(sample)
    figures = {level: summary(runs, n) for level, runs in samples.items()}
    base = figures.get("off", {}).get("cpu_ms_per_task")
    for values in figures.values():
        values["ratio_cpu"] = round(values["cpu_ms_per_task"] / base, 3) if base else None
    return {"levels": figures}


def summary(runs: list[tuple[float, float, int | None]], n: int) -> dict[str, Any]:
    cpu = statistics.median(c for c, _, _ in runs)
    seconds = statistics.median(s for _, s, _ in runs)
    spans = [x for _, _, x in runs if x is not None]
    return {
        "cpu_ms_per_task": round(1000 * cpu / n, 4),
        "seconds": round(seconds, 3),
        "cpu_ms_per_task_rounds": [round(1000 * c / n, 4) for c, _, _ in runs],
        "spans_per_task": round(statistics.median(spans) / n, 3) if spans else None,
    }


def choices(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...], flag: str) -> list[str]:
    chosen = [c for c in text.split(",") if c]
    if not chosen or set(chosen) - set(known):
        parser.error(f"{flag} takes {', '.join(known)}, not {text!r}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000, help="N tasks per level and round")
    parser.add_argument("--concurrency", type=int, default=10, help="the worker's slots")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; figures are their medians")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--levels", default="off,api,on", help=f"comma-separated, of {', '.join(LEVELS)}")
    parser.add_argument("--hog", action="store_true", help="keep both cores busy during every run")
    add_common_args(parser)
    args = parser.parse_args()
    modes = choices(parser, args.modes, MODES, "--modes")
    levels = choices(parser, args.levels, LEVELS, "--levels")
    if args.smoke:
        args.tasks, args.rounds = 20, 1
    configure_logging("console", "error")  # the in-process worker logs to this stdout otherwise
    run: Callable[[str], dict[str, Any]] = lambda mode: asyncio.run(  # noqa: E731
        measure(mode, args.tasks, args.concurrency, args.rounds, levels)
    )
    with cpu_hog(args.hog):
        for mode in modes:
            figures = run(mode)
            config = {
                "mode": mode,
                "concurrency": args.concurrency,
                "tasks": args.tasks,
                "rounds": args.rounds,
                "hog": args.hog,
            }
            emit("tracing", config, figures, results=args.results, smoke=args.smoke)


if __name__ == "__main__":
    main()
