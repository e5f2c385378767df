"""Claim attempts per successful claim when 16 idle workers see the same events.

Starts the embedded server, N in-process workers (each with its own client), then
publishes tasks one at a time with a pause, so every worker is idle when each
insert event arrives (the worst case for a stampede). Prints one JSON line and
appends it to bench/results.jsonl.

    uv run python bench/claim_storm.py [--workers 16] [--tasks 40] [--gap 0.15] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from taskrunner import MongoStore, TaskContext, TaskRunner
from taskrunner.embedded import EmbeddedServer
from taskrunner.logs import configure_logging
from taskrunner.store.base import Claim
from taskrunner.worker import Worker

RESULTS = Path(__file__).with_name("results.jsonl")


class CountingStore(MongoStore):
    """A MongoStore that counts claim round trips and successful claims."""

    attempts = 0
    claims = 0

    async def claim(self, worker_id: str, **kwargs: Any) -> Claim | None:
        CountingStore.attempts += 1
        claim = await super().claim(worker_id, **kwargs)
        CountingStore.claims += claim is not None
        return claim


async def storm(workers: int, tasks: int, gap: float) -> dict[str, Any]:
    async with EmbeddedServer() as server:
        app = TaskRunner(server.uri, collection="storm")

        @app.task("noop")
        async def noop(params: dict[str, Any], ctx: TaskContext) -> None:
            return None

        await app.init()
        fleet = [
            Worker(
                app.copy(store=CountingStore.connect(server.uri, collection="storm")), worker_id=f"w{i:02}"
            )
            for i in range(workers)
        ]
        running = [asyncio.create_task(w.run()) for w in fleet]
        await asyncio.sleep(3)  # registry beats: every worker knows its peers
        latencies = []
        for i in range(tasks):
            published = await app.publish("noop", key=f"t{i}")
            while (task := await app.get(f"t{i}")).attempts == 0:
                await asyncio.sleep(0.005)
            latencies.append((task.workers[0].claimed_at - published.created_at).total_seconds())
            await asyncio.sleep(gap)
        for w in fleet:
            w.stop()
        await asyncio.gather(*running)
    return {
        "bench": "claim_storm", "workers": workers, "tasks": tasks,
        "claim_attempts": CountingStore.attempts, "claims": CountingStore.claims,
        "attempts_per_claim": round(CountingStore.attempts / max(CountingStore.claims, 1), 3),
        "pickup_p50_ms": round(1000 * statistics.median(latencies), 1),
        "pickup_max_ms": round(1000 * max(latencies), 1),
        "machine": f"{platform.machine()} {platform.python_version()}", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--gap", type=float, default=0.15)
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON lines file to append to")
    args = parser.parse_args()
    configure_logging("console", "error")
    result = asyncio.run(storm(args.workers, args.tasks, args.gap))
    line = json.dumps(result)
    print(line)
    with args.results.open("a") as out:
        out.write(line + "\n")


if __name__ == "__main__":
    main()
