"""Heartbeat cost vs in-flight runs: task-collection writes per ping interval.

Starts the embedded server in-process and one in-process worker (concurrency 50,
its own client with a ``RoundTripCounter``), publishes K long sleeping tasks
(``ping_interval`` 0.5 s, ``ping_timeout`` 3 s), waits until all K are RUNNING,
then counts for a window (4 s) the worker's write commands on the tasks
collection: ``findAndModify`` (one ping per run) and ``update`` (a bulk ping of
every run at once), both, since the engine may use either. Nothing else writes
there during the window: every task is claimed and none finishes before it ends.
``writes_per_interval`` = writes / (window / ping_interval): K when each run pings
on its own, about 1 with one shared heartbeat write per worker and interval.
``statements_per_interval`` counts the documents those writes address (update
statements; one per findAndModify), so it stays about K either way.
``--in-flight`` takes a comma list: one JSON line per K (config ``{"in_flight": K,
"ping_interval": 0.5}``), appended to bench/results.jsonl.

    uv run python bench/heartbeat.py --in-flight 1,10,50 [--window 4] [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

from common import add_common_args, emit, int_list
from pymongo import monitoring

from taskrunner import TaskContext, TaskRunner, TaskState
from taskrunner.dev.server import EmbeddedServer
from taskrunner.engine.worker import Worker
from taskrunner.observability.logs import configure_logging
from taskrunner.observability.roundtrips import RoundTripCounter
from taskrunner.store.mongo import MongoStore

COLLECTION = "heartbeat"
PING_INTERVAL, PING_TIMEOUT = 0.5, 3.0
WRITES = ("findAndModify", "update")


class StatementCounter(monitoring.CommandListener):
    """Documents addressed by writes on the tasks collection: an update's statements, 1 per findAndModify."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.statements = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        name = event.command_name
        if name not in WRITES or event.command.get(name) != COLLECTION:
            return
        n = len(event.command.get("updates") or []) if name == "update" else 1
        with self._lock:
            self.statements += n

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        return None

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        return None

    def reset(self) -> int:
        with self._lock:
            n, self.statements = self.statements, 0
            return n


async def all_running(app: TaskRunner, k: int, within: float) -> None:
    deadline = time.monotonic() + within
    while await app.store.count(state=TaskState.RUNNING) < k:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {k} tasks RUNNING after {within} s")
        await asyncio.sleep(0.02)


async def measure(k: int, window: float, concurrency: int) -> dict[str, Any]:
    async with EmbeddedServer() as server:
        app = TaskRunner(server.uri, collection=COLLECTION)

        @app.task("sleep")
        async def sleep(params: dict[str, Any], ctx: TaskContext) -> None:
            await asyncio.sleep(params["seconds"])

        await app.init()
        counter, statements = RoundTripCounter(), StatementCounter()
        store = MongoStore.connect(server.uri, collection=COLLECTION, event_listeners=[counter, statements])
        worker = Worker(app.copy(store=store), worker_id="hb", concurrency=concurrency)
        running = asyncio.create_task(worker.run())
        # Long enough to outlast claiming (K claims) and the window: no finish write is counted.
        seconds = 10 + 2 * window
        await app.publish_many(
            [
                {
                    "name": "sleep",
                    "params": {"seconds": seconds},
                    "key": f"t{i:03}",
                    "ping_interval": PING_INTERVAL,
                    "ping_timeout": PING_TIMEOUT,
                }
                for i in range(k)
            ]
        )
        await all_running(app, k, within=30)
        counter.reset()
        statements.reset()
        await asyncio.sleep(window)
        by_target = counter.by_target()
        counted = statements.reset()
        worker.stop()
        await running
        await app.close()
    writes = {name: by_target.get((name, COLLECTION), 0) for name in WRITES}
    intervals = window / PING_INTERVAL
    total = sum(writes.values())
    return {
        "heartbeat_writes": total,
        "writes_by_command": writes,
        "intervals": intervals,
        "writes_per_interval": round(total / intervals, 2),
        "statements": counted,
        "statements_per_interval": round(counted / intervals, 2),
        "window_s": window,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int_list, default=[1, 10, 50], help="comma list of K")
    parser.add_argument("--window", type=float, default=4.0, help="seconds of counting")
    parser.add_argument("--concurrency", type=int, default=50, help="the worker's slots (>= every K)")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.in_flight, args.window = [2], 1.0
    if max(args.in_flight) > args.concurrency:
        parser.error("--in-flight values must not exceed --concurrency")
    configure_logging("console", "error")
    for k in args.in_flight:
        figures = asyncio.run(measure(k, args.window, args.concurrency))
        emit(
            "heartbeat",
            {"in_flight": k, "ping_interval": PING_INTERVAL},
            figures,
            results=args.results,
            smoke=args.smoke,
        )


if __name__ == "__main__":
    main()
