"""The hand-rolled baseline queue on the same server and workload: throughput and pickup latency.

The baseline is the loop many teams write (bench/baseline_worker.py): one process per
worker, plain sync PyMongo, ``find_one_and_update`` PENDING -> RUNNING sorted by
priority and age, ``sleep(0.1)`` when nothing is pending, ``update_one`` to SUCCESS;
no leases, heartbeats, takeover or change streams. It runs on collections of plain
documents (a fresh one per run) in one embedded server (``taskrunner dev-server --port 0``).

- ``throughput`` (one line per W in ``--workers``, config {"system": "baseline",
  "workers": W, "concurrency": 1}, like bench/throughput.py's lines): starts W
  processes, waits until each is ready, inserts N ``noop`` documents with one
  ``insert_many``, waits until all are SUCCESS. Time = last ``finished_at`` - first
  ``claimed_at`` (server times, ``$currentDate``). Round trips per task = the commands
  the processes' PyMongo listeners counted (printed when SIGTERM stops them) / N,
  including their idle polling.
- ``pickup`` (config {"mode": "baseline-poll-100ms", "workers": 1}, like
  bench/pickup.py's lines): one process; ``stamp`` documents inserted one at a time,
  the client's ``time.time()`` read just before each insert, the next one after the
  previous is SUCCESS plus ``gap`` and a random part of the 100 ms poll (so inserts
  fall at random phases of the poll cycle). Latency = handler start - insert time.

    uv run python bench/baseline.py [--bench throughput|pickup|both] [--workers 1,2,4]
                                    [--tasks 300] [--pickup-tasks 200] [--gap 0.1]
                                    [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from typing import Any

from common import add_common_args, emit, int_list
from pickup import figures
from processes import BENCH_DIR, Processes, dev_server, stop_and_count, wait_until
from pymongo import AsyncMongoClient
from throughput import throughput_figures

DATABASE, COLLECTION = "baseline", "baseline"
CLAIM_INDEX = [("state", 1), ("priority", -1), ("created_at", 1)]
IDLE_SLEEP = 0.1
JOBS = {
    "findAndModify": "claim",
    "update": "run_writes",
}  # as taskrunner.observability.roundtrips.JOBS names them
Doc = dict[str, Any]


def start_workers(procs: Processes, uri: str, collection: str, workers: int) -> list[str]:
    names = [f"b{i}" for i in range(workers)]
    for name in names:
        command = [
            sys.executable,
            str(BENCH_DIR / "baseline_worker.py"),
            uri,
            collection,
            name,
            "--idle-sleep",
            str(IDLE_SLEEP),
        ]
        procs.start(name, command)
    return names


async def wait_ready(procs: Processes, names: list[str]) -> None:
    async def ready() -> bool:
        return all(procs.events(name, "ready") for name in names)

    await wait_until(ready, 60, "baseline workers to start", interval=0.05)


def document(name: str, key: str) -> Doc:
    return {"key": key, "name": name, "state": "PENDING", "priority": 0, "created_at": time.time()}


async def throughput(uri: str, workers: int, tasks: int) -> dict[str, Any]:
    collection_name = f"{COLLECTION}_w{workers}"
    with Processes(uri, collection_name) as procs:
        client: AsyncMongoClient[Doc] = AsyncMongoClient(uri, tz_aware=True)
        collection = client[DATABASE][collection_name]
        try:
            await collection.create_index(CLAIM_INDEX)  # what such a team adds for its claim query
            names = start_workers(procs, uri, collection_name, workers)
            await wait_ready(procs, names)
            await collection.insert_many([document("noop", f"t{i:05}") for i in range(tasks)])

            async def all_done() -> bool:
                return await collection.count_documents({"state": "SUCCESS"}) >= tasks

            await wait_until(all_done, 120, f"{tasks} baseline tasks", interval=0.1)
            docs = await collection.find({}, {"claimed_at": 1, "finished_at": 1}).to_list()
            counts = (await stop_and_count(procs, names))[0]
        finally:
            await client.close()
    seconds = (max(d["finished_at"] for d in docs) - min(d["claimed_at"] for d in docs)).total_seconds()
    jobs: Counter[str] = Counter()
    for command, n in counts.items():
        jobs[JOBS.get(command, "other")] += n
    return throughput_figures(tasks, seconds, counts, jobs)


async def one_pickup(collection: Any, key: str) -> float:
    """Insert one ``stamp`` document; its pickup latency in seconds."""
    published = time.time()
    await collection.insert_one(document("stamp", key))

    async def result() -> float | None:
        doc = await collection.find_one({"key": key, "state": "SUCCESS"}, {"result": 1})
        return None if doc is None else float(doc["result"])

    # Polled gently: the stamp, not this loop, times the pickup, and reads load the server.
    return float(await wait_until(result, 30, f"{key} to run", interval=0.05)) - published


async def pickup(uri: str, tasks: int, gap: float) -> list[float]:
    collection_name = f"{COLLECTION}_pickup"
    with Processes(uri, collection_name) as procs:
        client: AsyncMongoClient[Doc] = AsyncMongoClient(uri, tz_aware=True)
        collection = client[DATABASE][collection_name]
        try:
            await collection.create_index(CLAIM_INDEX)
            names = start_workers(procs, uri, collection_name, 1)
            await wait_ready(procs, names)
            await one_pickup(collection, "warmup")
            latencies = []
            for i in range(tasks):
                await asyncio.sleep(gap + random.uniform(0, IDLE_SLEEP))
                latencies.append(await one_pickup(collection, f"t{i:05}"))
        finally:
            await client.close()
    return latencies


def run(args: argparse.Namespace) -> None:
    """Every requested run on one server (a fresh collection each), one JSON line each."""
    with dev_server() as uri:
        if args.bench in ("throughput", "both"):
            for workers in args.workers:
                result = asyncio.run(throughput(uri, workers, args.tasks))
                config = {"system": "baseline", "workers": workers, "concurrency": 1}
                emit("throughput", config, result, results=args.results, smoke=args.smoke)
        if args.bench in ("pickup", "both"):
            latencies = asyncio.run(pickup(uri, args.pickup_tasks, args.gap))
            config = {"mode": "baseline-poll-100ms", "workers": 1}
            emit("pickup", config, figures(latencies), results=args.results, smoke=args.smoke)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", choices=["throughput", "pickup", "both"], default="both")
    parser.add_argument("--workers", type=int_list, default=[1, 2, 4], help="comma-separated, e.g. 1,2,4")
    parser.add_argument("--tasks", type=int, default=300, help="per throughput run, as bench/throughput.py")
    parser.add_argument("--pickup-tasks", type=int, default=200)
    parser.add_argument(
        "--gap", type=float, default=0.1, help="pickup: seconds between a task's end and the next"
    )
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.tasks, args.pickup_tasks = [1], 20, 5
    run(args)


if __name__ == "__main__":
    main()
