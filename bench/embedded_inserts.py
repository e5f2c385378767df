"""Embedded-server insert cost as the collection grows: seconds per 1,000 inserted task documents.

Starts the embedded server (``taskrunner dev-server --port 0``), creates taskrunner's
collection and indexes (``TaskRunner.init``), then inserts task-shaped documents
(ObjectId ``_id``, unique ``key``) with ``insert_many`` in batches of ``--batch``,
timing the batch that brings the collection to each size of ``--sizes``. Inserting
should cost the same at every size: ``ratio_to_first`` near 1 (a busy machine moves the
absolute figures, less so their ratios); an insert that scans the collection makes the
ratio grow with the size (1,000 documents: 6.9 s, 2,000: 23.6 s before the fix).

    uv run python bench/embedded_inserts.py [--sizes 1000,10000,50000,100000] [--batch 1000]
                                            [--smoke] [--results PATH]

One JSON line (bench "embedded_inserts", config {"batch"}): ``seconds_per_1000`` and
``ratio_to_first`` by size, and ``total_seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import UTC, datetime
from typing import Any

from bson import ObjectId
from common import add_common_args, emit, int_list
from processes import dev_server
from pymongo import AsyncMongoClient

from taskrunner import TaskRunner

COLLECTION = "inserts"


def task_documents(start: int, count: int) -> list[dict[str, Any]]:
    now = datetime.now(UTC)
    return [
        {
            "_id": ObjectId(),
            "key": f"task-{i}",
            "name": "resize",
            "params": {"width": 640, "image": f"img-{i}.png"},
            "state": "PENDING",
            "priority": 0,
            "claimable_at": now,
            "created_at": now,
            "updated_at": now,
            "workers": [],
        }
        for i in range(start, start + count)
    ]


async def seconds_per_1000(uri: str, sizes: list[int], batch: int) -> tuple[dict[int, float], float]:
    """Seconds per 1,000 documents of the batch reaching each size, and the total time."""
    async with TaskRunner(uri, collection=COLLECTION) as runner:
        await runner.init()
    figures: dict[int, float] = {}
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
    async with client:
        tasks = client.taskrunner[COLLECTION]
        began, stored = time.perf_counter(), 0
        for size in sorted(sizes):
            while stored < size:
                count = min(batch, size - stored)
                started = time.perf_counter()
                await tasks.insert_many(task_documents(stored, count))
                stored += count
            figures[size] = (time.perf_counter() - started) / count * 1000
    return figures, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int_list, default=[1000, 10_000, 50_000, 100_000])
    parser.add_argument("--batch", type=int, default=1000)
    add_common_args(parser)
    args = parser.parse_args()
    sizes, batch = ([200, 1000], 100) if args.smoke else (args.sizes, args.batch)
    with dev_server() as uri:
        figures, total = asyncio.run(seconds_per_1000(uri, sizes, batch))
    first = figures[min(figures)]
    emit(
        "embedded_inserts",
        {"batch": batch},
        {
            "seconds_per_1000": {str(size): round(s, 3) for size, s in figures.items()},
            "ratio_to_first": {str(size): round(s / first, 2) for size, s in figures.items()},
            "total_seconds": round(total, 1),
        },
        results=args.results,
        smoke=args.smoke,
    )


if __name__ == "__main__":
    main()
