"""Worker-side round trips per task (claim + heartbeats + finish + discovery + registry), amortized.

Starts the embedded server, N in-process workers (each its own client with a
``RoundTripCounter`` attached), publishes M short no-op tasks in one write, waits
until all are SUCCESS and divides each worker command count by M. Counting starts
after the workers have settled (startup scan, first beats) and stops when the last
task succeeds; startup is reported separately. Cross-checks with the server's
``serverStatus`` opcounters (all clients: the workers' commands plus this
script's publishing and polling, counted with its own listener) when the server
supports it. Prints one JSON line and appends it to bench/results.jsonl.

    uv run python bench/roundtrips.py [--workers 3] [--tasks 300] [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pymongo import AsyncMongoClient

from taskrunner import MongoStore, TaskContext, TaskRunner
from taskrunner.embedded import EmbeddedServer
from taskrunner.fields import REGISTRY_SUFFIX
from taskrunner.logs import configure_logging
from taskrunner.models import TaskState
from taskrunner.roundtrips import RoundTripCounter
from taskrunner.worker import Worker

RESULTS = Path(__file__).with_name("results.jsonl")
COLLECTION = "roundtrips"
REGISTRY = f"{COLLECTION}.{REGISTRY_SUFFIX}"


def category(command: str, target: str) -> str:
    """Which worker job a command belongs to."""
    if target == REGISTRY:
        return "registry"  # beats (findAndModify) and the peer list (find)
    if command == "findAndModify":
        return "claim_ping_finish"
    if command in {"find", "getMore", "aggregate", "killCursors"}:
        return "discovery"  # candidate scans and the change stream
    if command == "hello":
        return "clock"
    return "other"


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


async def measure(workers: int, tasks: int, concurrency: int, settle: float) -> dict[str, Any]:
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
                worker_id=f"w{i:02}", concurrency=concurrency,
            )
            for i, c in enumerate(counters)
        ]  # fmt: skip
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
        by_target: Counter[tuple[str, str]] = Counter()
        for c in counters:
            by_target.update(c.by_target())
        bench_total = own.total()
        after = await opcounters(server.uri)
        for w in fleet:
            w.stop()
        await asyncio.gather(*running)
    by_command: Counter[str] = Counter()
    by_category: Counter[str] = Counter()
    for (command, target), n in by_target.items():
        by_command[command] += n
        by_category[category(command, target)] += n
    total = sum(by_command.values())
    if before is None or after is None:
        server_side: Any = "unsupported"
    else:
        delta = {k: after[k] - before.get(k, 0) for k in after}
        server_side = delta | {
            "total": sum(delta.values()), "client_total": total + bench_total, "workers": total, "bench": bench_total
        }  # fmt: skip
    per_task = {k: round(v / tasks, 3) for k, v in sorted(by_command.items())}
    return {
        "bench": "roundtrips", "workers": workers, "tasks": tasks, "concurrency": concurrency,
        "roundtrips": total, "roundtrips_per_task": round(total / tasks, 3),
        "per_task_by_command": per_task,
        "per_task_by_job": {k: round(v / tasks, 3) for k, v in sorted(by_category.items())},
        "startup_commands": dict(sorted(startup.items())),
        "server_opcounters_delta": server_side, "seconds": round(elapsed, 2),
        "machine": f"{platform.machine()} {platform.python_version()}", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=10, help="slots per worker")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds before counting starts")
    parser.add_argument("--smoke", action="store_true", help="tiny run for CI: 2 workers, 10 tasks")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON lines file to append to")
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.tasks, args.settle = 2, 10, 0.5
    configure_logging("console", "error")
    result = asyncio.run(measure(args.workers, args.tasks, args.concurrency, args.settle))
    line = json.dumps(result)
    print(line)
    with args.results.open("a") as out:
        out.write(line + "\n")


if __name__ == "__main__":
    main()
