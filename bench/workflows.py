"""Workflows' cost per task: a fan-out, a fan-in and small graphs against independent tasks.

Cases, each run on a fresh collection of one embedded server (``taskrunner dev-server
--port 0``) with fresh workers, all in one run so that the control is measured beside them:

    control    N independent ``noop`` tasks
    fan_out    1 -> N: one task, then N tasks that run after it
    fan_in     N -> 1: N tasks, then one that runs after all of them (its ctx.upstream holds N)
    diamonds   N // 12 graphs of 1 -> 10 -> 1, for scale: many small flows side by side

W workers of C slots run them, either in this process (``--modes inprocess``: ``Worker``
objects, each its own client with a ``RoundTripCounter``) or as ``taskrunner worker``
processes (``--modes processes``, bench/apps.py, ``TASKRUNNER_COUNT_ROUNDTRIPS=1``: each
logs its commands when it stops). The publisher has a counter of its own. Per case:

    tasks                        documents published (N + 1, N, or 12 per graph)
    publish_s                    the publish call (storing, and linking upstreams to dependents)
    seconds                      first claimed_at to last finished_at (server times, from the documents)
    ms_per_task                  seconds / tasks
    worker_commands_per_task     every worker command from start to stop / tasks (start-up,
                                 idle beats and shutdown amortized over N, as bench/throughput.py)
    publisher_commands_per_task  the publish call's commands / tasks
    commands_per_task            the sum of both
    ratio_ms, ratio_commands     the case's figure / the control's

    uv run python bench/workflows.py [--tasks 10000] [--workers 2] [--concurrency 10]
                                     [--modes inprocess,processes] [--cases control,fan_in]
                                     [--smoke] [--results PATH]

Prints one JSON line per mode (config {"mode", "workers", "concurrency", "tasks"}), the
cases under ``cases``. With N = 10,000 a mode takes many minutes on a small machine (the
embedded server stores a few hundred documents a second); ``--smoke`` runs N = 24 with
one worker.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from apps import app
from common import add_common_args, emit
from processes import Processes, dev_server, stop_and_count, wait_until

from taskrunner import TaskRunner
from taskrunner.engine.worker import Worker
from taskrunner.models import TaskState
from taskrunner.observability.logs import configure_logging
from taskrunner.observability.roundtrips import RoundTripCounter
from taskrunner.store.mongo import MongoStore

MODES = ("inprocess", "processes")
MIDDLE = 10
"""Middle steps of each 1 -> 10 -> 1 graph."""
Spec = dict[str, Any]


def control(n: int) -> list[Spec]:
    return [{"name": "noop", "key": f"t{i:05}"} for i in range(n)]


def fan_out(n: int) -> list[Spec]:
    return [
        {"name": "noop", "key": "root"},
        *({"name": "noop", "key": f"d{i:05}", "after": ["root"]} for i in range(n)),
    ]


def fan_in(n: int) -> list[Spec]:
    ups = [f"u{i:05}" for i in range(n)]
    return [*({"name": "noop", "key": k} for k in ups), {"name": "noop", "key": "sink", "after": ups}]


def diamonds(n: int) -> list[Spec]:
    specs: list[Spec] = []
    for g in range(max(1, n // (MIDDLE + 2))):
        root, middle = f"g{g:04}/a", [f"g{g:04}/m{k}" for k in range(MIDDLE)]
        specs.append({"name": "noop", "key": root})
        specs.extend({"name": "noop", "key": k, "after": [root]} for k in middle)
        specs.append({"name": "noop", "key": f"g{g:04}/z", "after": middle})
    return specs


CASES: dict[str, Callable[[int], list[Spec]]] = {
    "control": control,
    "fan_out": fan_out,
    "fan_in": fan_in,
    "diamonds": diamonds,
}


class InProcess:
    """W ``Worker`` objects in this process, each with its own counting client."""

    def __init__(self, uri: str, collection: str, workers: int, concurrency: int) -> None:
        self.counters = [RoundTripCounter() for _ in range(workers)]
        self.fleet = [
            Worker(
                app.copy(store=MongoStore.connect(uri, collection=collection, event_listeners=[counter])),
                worker_id=f"w{i}",
                concurrency=concurrency,
            )
            for i, counter in enumerate(self.counters)
        ]
        self.running = [asyncio.create_task(w.run()) for w in self.fleet]

    async def stop(self) -> Counter[str]:
        for worker in self.fleet:
            worker.stop()
        await asyncio.gather(*self.running)
        total: Counter[str] = Counter()
        for counter in self.counters:
            total.update(counter.snapshot())
        return total


class WorkerProcesses:
    """W ``taskrunner worker`` processes counting their commands (logged as they stop)."""

    def __init__(self, procs: Processes, case: str, collection: str, workers: int, concurrency: int) -> None:
        self.procs = procs
        self.names = [f"{case}-w{i}" for i in range(workers)]
        env = {"TASKRUNNER_COUNT_ROUNDTRIPS": "1", "TASKRUNNER_COLLECTION": collection}
        for name in self.names:
            procs.worker(name, "--concurrency", str(concurrency), env=env)

    async def stop(self) -> Counter[str]:
        commands, _ = await stop_and_count(self.procs, self.names)
        return commands


async def run_case(
    uri: str, procs: Processes | None, case: str, n: int, workers: int, concurrency: int
) -> dict[str, Any]:
    """Publish the case's graph to its own collection and run it to the end."""
    specs = CASES[case](n)
    counter = RoundTripCounter()
    runner = TaskRunner(store=MongoStore.connect(uri, collection=case, event_listeners=[counter]))
    try:
        await runner.init()
        fleet = (
            InProcess(uri, case, workers, concurrency)
            if procs is None
            else WorkerProcesses(procs, case, case, workers, concurrency)
        )

        async def registered() -> bool:
            return len(await runner.workers()) >= workers

        await wait_until(registered, 120, f"{workers} workers to register", interval=0.1)
        counter.reset()
        start = time.monotonic()
        await runner.publish_many(specs)
        publish_s = time.monotonic() - start
        published = counter.total()

        async def done() -> bool:
            return await runner.store.count(state=TaskState.SUCCESS) >= len(specs)

        await wait_until(done, max(300.0, 0.5 * len(specs)), f"{case}: {len(specs)} tasks", interval=0.5)
        worker_commands = await fleet.stop()
        tasks = await runner.store.find(state=TaskState.SUCCESS)
    finally:
        await runner.close()
    first = min(w.claimed_at for t in tasks for w in t.workers)
    last = max(w.finished_at for t in tasks for w in t.workers if w.finished_at is not None)
    seconds = (last - first).total_seconds()
    count = len(specs)
    return {
        "tasks": count,
        "publish_s": round(publish_s, 3),
        "seconds": round(seconds, 3),
        "ms_per_task": round(1000 * seconds / count, 3),
        "worker_commands_per_task": round(sum(worker_commands.values()) / count, 3),
        "worker_commands_per_task_by_command": {
            k: round(v / count, 3) for k, v in sorted(worker_commands.items())
        },
        "publisher_commands_per_task": round(published / count, 3),
        "commands_per_task": round((sum(worker_commands.values()) + published) / count, 3),
    }


def with_ratios(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each case's ms and commands per task as a multiple of the control's (if it ran)."""
    base = cases.get("control")
    if base is None:
        return cases
    for figures in cases.values():
        for figure, ratio in (("ms_per_task", "ratio_ms"), ("commands_per_task", "ratio_commands")):
            figures[ratio] = round(figures[figure] / base[figure], 2) if base[figure] else None
    return cases


async def measure(mode: str, n: int, workers: int, concurrency: int, cases: Sequence[str]) -> dict[str, Any]:
    with dev_server() as uri, Processes(uri, "control") as procs:  # each case sets its collection
        results: dict[str, dict[str, Any]] = {}
        for case in cases:
            try:
                results[case] = await run_case(
                    uri, procs if mode == "processes" else None, case, n, workers, concurrency
                )
            except Exception:
                for name in procs.names:
                    print(f"--- {name} ---\n{procs.tail(name)}")
                raise
    return {"cases": with_ratios(results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000, help="N: the fan's width and the control's size")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=10, help="slots per worker")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated, of {', '.join(CASES)} (ratios need control)",
    )
    add_common_args(parser)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}, not {args.modes!r}")
    cases = [c for c in args.cases.split(",") if c]
    if not cases or set(cases) - set(CASES):
        parser.error(f"--cases takes {', '.join(CASES)}, not {args.cases!r}")
    if args.smoke:
        args.tasks, args.workers = 24, 1
    configure_logging("console", "error")  # in-process workers log to this stdout otherwise
    for mode in modes:
        figures = asyncio.run(measure(mode, args.tasks, args.workers, args.concurrency, cases))
        config = {"mode": mode, "workers": args.workers, "concurrency": args.concurrency, "tasks": args.tasks}
        emit("workflows", config, figures, results=args.results, smoke=args.smoke)


if __name__ == "__main__":
    main()
