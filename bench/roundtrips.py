"""Worker-side round trips per task, amortized, split by job (claim, run writes, discovery, ...).

Starts the embedded server, N in-process workers (each its own client with a
``RoundTripCounter`` attached), publishes M short no-op tasks in one write, waits
until all are SUCCESS and divides each worker command count by M. Counting starts
after the workers have settled (startup scan, first beats) and stops when the last
task succeeds; startup is reported separately. ``worker_writes_per_task`` is the
figure the engine is held to (docs/benchmarks.md, "Targets"): claims + lease renewals + outcomes (jobs ``claim`` and
``run_writes``); ``roundtrips_per_task`` counts every worker command, discovery and
registry included. Cross-checks with the server's ``serverStatus`` opcounters when
the server has them: ``clients`` counts what every client sent (the workers plus this
script's publishing and polling) the way opcounters do, one per statement of a bulk
write. On the embedded server the change stream's getMores are answered by
taskrunner's bridge, so its ``getmore`` counter does not see them.

    uv run python bench/roundtrips.py [--workers 1,2,4,8] [--tasks 300] [--concurrency 10] [--no-batching]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from typing import Any

from common import add_common_args, emit, int_list
from pymongo import AsyncMongoClient

from taskrunner import TaskContext, TaskRunner
from taskrunner.dev.server import EmbeddedServer
from taskrunner.engine.worker import Worker
from taskrunner.models import TaskState
from taskrunner.observability.logs import configure_logging
from taskrunner.observability.roundtrips import RoundTripCounter
from taskrunner.store.mongo import MongoStore

COLLECTION = "roundtrips"
WORKER_WRITES = ("claim", "run_writes")


async def opcounters(uri: str) -> dict[str, int] | None:
    """The server's opcounters, or None when it does not answer ``serverStatus``."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
    try:
        status = await client.admin.command("serverStatus")
        counters = status.get("opcounters")
        return {k: int(v) for k, v in counters.items()} if isinstance(counters, dict) else None
    except Exception:
        return None
    finally:
        await client.close()


async def measure(workers: int, tasks: int, concurrency: int, batch: int, settle: float) -> dict[str, Any]:
    async with EmbeddedServer() as server:
        own = RoundTripCounter()  # this script's publishing and polling, for the server cross-check
        app = TaskRunner(store=MongoStore.connect(server.uri, collection=COLLECTION, event_listeners=[own]))

        @app.task("noop")
        async def noop(params: dict[str, Any], ctx: TaskContext) -> None:
            return None

        await app.init()
        counters = [RoundTripCounter() for _ in range(workers)]
        fleet = [
            Worker(
                app.copy(store=MongoStore.connect(server.uri, collection=COLLECTION, event_listeners=[c])),
                worker_id=f"w{i:02}",
                concurrency=concurrency,
                batch=batch,
            )
            for i, c in enumerate(counters)
        ]
        running = [asyncio.create_task(w.run()) for w in fleet]
        await asyncio.sleep(settle)  # startup scan, clock sync, first beats: reported apart
        startup = sum((Counter(c.reset()) for c in counters), Counter())
        before = await opcounters(server.uri)
        own.reset()
        start = time.monotonic()
        await app.publish_many([{"name": "noop", "key": f"t{i:05}"} for i in range(tasks)])
        while await app.store.count(state=TaskState.SUCCESS) < tasks:
            await asyncio.sleep(0.02)
        elapsed = time.monotonic() - start
        by_command: Counter[str] = Counter()
        by_job: Counter[str] = Counter()
        statements = Counter(own.statements())
        for c in counters:
            by_command.update(c.snapshot())
            by_job.update(c.by_job())
            statements.update(c.statements())
        bench_total = own.total()
        after = await opcounters(server.uri)
        for w in fleet:
            w.stop()
        await asyncio.gather(*running)
    total = sum(by_command.values())
    if before is None or after is None:
        server_side: Any = "unsupported"
    else:
        delta = {k: after[k] - before.get(k, 0) for k in after}
        server_side = {
            "server": delta,
            "clients": dict(sorted(statements.items())),
            "client_commands": total + bench_total,
        }
    return {
        "tasks": tasks,
        "roundtrips": total,
        "roundtrips_per_task": round(total / tasks, 3),
        "worker_writes_per_task": round(sum(by_job[j] for j in WORKER_WRITES) / tasks, 3),
        "per_task_by_command": {k: round(v / tasks, 3) for k, v in sorted(by_command.items())},
        "per_task_by_job": {k: round(v / tasks, 3) for k, v in sorted(by_job.items())},
        "startup_commands": dict(sorted(startup.items())),
        "server_opcounters_delta": server_side,
        "seconds": round(elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", type=int_list, default=[3], help="comma list: one result per worker count"
    )
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=10, help="slots per worker")
    parser.add_argument("--no-batching", action="store_true", help="claim one task per round trip (batch=1)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds before counting starts")
    add_common_args(parser)
    args = parser.parse_args()
    counts = args.workers
    if args.smoke:
        counts, args.tasks, args.settle = [2], 10, 0.5
    configure_logging("console", "error")
    batch = 1 if args.no_batching else 32
    for workers in counts:
        figures = asyncio.run(measure(workers, args.tasks, args.concurrency, batch, args.settle))
        config = {"workers": workers, "concurrency": args.concurrency, "batching": not args.no_batching}
        emit("roundtrips", config, figures, results=args.results, smoke=args.smoke)


if __name__ == "__main__":
    main()
