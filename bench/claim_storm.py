"""Claim attempts per successful claim when N idle workers see the same events.

Starts the embedded server, N in-process workers (each with its own client), then
publishes tasks one at a time with a pause, so every worker is idle when each
insert event arrives (the worst case for a stampede). ``--workers`` takes a comma
list: each value runs on a fresh server and prints its own JSON line (config
``{"workers": N}``; figures claims, claim_attempts, attempts_per_claim,
pickup_p50_ms, pickup_max_ms), appended to bench/results.jsonl.

    uv run python bench/claim_storm.py --workers 2,4,8,16 [--tasks 30] [--gap 0.15] [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence
from typing import Any

from common import add_common_args, emit, int_list

from taskrunner import TaskContext, TaskRunner
from taskrunner.dev.server import EmbeddedServer
from taskrunner.engine.worker import Worker
from taskrunner.observability.logs import configure_logging
from taskrunner.store.base import Claim
from taskrunner.store.mongo import MongoStore

COLLECTION = "storm"


class Tally:
    """Claim round trips and successful claims, shared by every worker of one run."""

    def __init__(self) -> None:
        self.attempts = 0
        self.claims = 0


class CountingStore(MongoStore):
    """A MongoStore that counts its claim calls and successful claims into a ``Tally``.

    One ``claim`` or one ``claim_many`` (a batch of due keys) is one attempt.
    """

    tally: Tally

    async def claim(self, worker_id: str, **kwargs: Any) -> Claim | None:
        self.tally.attempts += 1
        claim = await super().claim(worker_id, **kwargs)
        self.tally.claims += claim is not None
        return claim

    async def claim_many(self, worker_id: str, keys: Sequence[str], **kwargs: Any) -> Any:
        self.tally.attempts += 1
        claimed = await super().claim_many(worker_id, keys, **kwargs)
        self.tally.claims += len(claimed.claims)
        return claimed


def counting_store(uri: str, tally: Tally) -> CountingStore:
    store = CountingStore.connect(uri, collection=COLLECTION)
    store.tally = tally
    return store


async def storm(workers: int, tasks: int, gap: float, settle: float) -> dict[str, Any]:
    tally = Tally()
    async with EmbeddedServer() as server:
        app = TaskRunner(server.uri, collection=COLLECTION)

        @app.task("noop")
        async def noop(params: dict[str, Any], ctx: TaskContext) -> None:
            return None

        await app.init()
        fleet = [
            Worker(app.copy(store=counting_store(server.uri, tally)), worker_id=f"w{i:02}")
            for i in range(workers)
        ]
        running = [asyncio.create_task(w.run()) for w in fleet]
        await asyncio.sleep(settle)  # registry beats: every worker knows its peers (ranks need them)
        # Startup claims (each worker's one keyless sweep after its first scan) are not
        # woken by the events this bench is about: reported apart.
        startup, tally.attempts, tally.claims = tally.attempts, 0, 0
        latencies = []
        for i in range(tasks):
            published = await app.publish("noop", key=f"t{i}")
            while (task := await app.get(f"t{i}")).attempts == 0:
                await asyncio.sleep(0.005)
            latencies.append((task.workers[0].claimed_at - published.created_at).total_seconds())
            await asyncio.sleep(gap)  # every worker idle again before the next event
        for w in fleet:
            w.stop()
        await asyncio.gather(*running)
        await app.close()
    return {
        "tasks": tasks,
        "claims": tally.claims,
        "claim_attempts": tally.attempts,
        "startup_attempts": startup,
        "attempts_per_claim": round(tally.attempts / max(tally.claims, 1), 3),
        "pickup_p50_ms": round(1000 * statistics.median(latencies), 1),
        "pickup_max_ms": round(1000 * max(latencies), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int_list, default=[16], help="comma list, e.g. 2,4,8,16")
    parser.add_argument("--tasks", type=int, default=30)
    parser.add_argument("--gap", type=float, default=0.15, help="seconds between publishes")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds for the first registry beats")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.tasks, args.gap, args.settle = [2], 3, 0.05, 0.5
    configure_logging("console", "error")
    for n in args.workers:
        figures = asyncio.run(storm(n, args.tasks, args.gap, args.settle))
        emit("claim_storm", {"workers": n}, figures, results=args.results, smoke=args.smoke)


if __name__ == "__main__":
    main()
