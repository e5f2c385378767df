"""Pickup latency: from publish to handler start, with one idle ``taskrunner worker`` process.

Starts the embedded server (``taskrunner dev-server --port 0``) and one worker process
(``--concurrency 4``) running bench/apps.py, waits until a warm-up task has run, then
publishes ``stamp`` tasks one at a time: the client reads ``time.time()`` just before
each ``publish``, waits until the task is SUCCESS (the handler returns ``time.time()``
at its start, same machine, same clock), and pauses before the next one, so every
task reaches an idle worker. Latency = handler start - publish time; ``to_claim_p50_ms``
is the median server part of it (the document's ``claimed_at - created_at``).

Modes: ``stream`` (the default: ``--discovery stream``, change streams) and
``polling`` (``--discovery poll``: the worker scans every ``--poll-interval``
seconds). In polling mode the pause is ``gap`` plus a random part of one poll
interval, so publish times fall at random phases of the scan cycle instead of locking
onto it; latency is then bounded by the interval (mean about interval / 2).

    uv run python bench/pickup.py [--mode stream|polling] [--tasks 200] [--gap 0.1]
                                  [--poll-interval 1.0] [--smoke] [--results PATH]

Full runs: stream 200 tasks (about 30 s), polling 60 tasks at 1.0 s (about 70 s).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from common import add_common_args, emit, percentile
from processes import Processes, dev_server, wait_until

from taskrunner import TaskRunner
from taskrunner.models import Task, TaskState

COLLECTION = "pickup"


async def finished(runner: TaskRunner, key: str) -> Task | None:
    """The task once it succeeded, else None."""
    task = await runner.get(key)
    if task.state.finished and task.state is not TaskState.SUCCESS:
        raise RuntimeError(f"{key} ended {task.state.value}: {task.last_error}")
    return task if task.state is TaskState.SUCCESS else None


async def one(runner: TaskRunner, key: str, within: float) -> tuple[float, float]:
    """Publish one ``stamp`` task; its pickup latency and the server's part of it (seconds).

    The server's part is ``claimed_at - created_at`` (server times, millisecond precision):
    change event delivery, the worker's claim decision and its claim write.
    """
    published = time.time()
    await runner.publish("stamp", key=key)
    # Polled gently: the stamp, not this loop, times the pickup, and reads load the server.
    task = await wait_until(lambda: finished(runner, key), within, f"{key} to run", interval=0.05)
    to_claim = (task.workers[0].claimed_at - task.created_at).total_seconds()
    return float(task.results[0]) - published, to_claim


async def measure(uri: str, procs: Processes, args: argparse.Namespace) -> list[tuple[float, float]]:
    runner = TaskRunner(uri, collection=COLLECTION)
    try:
        await runner.init()
        discovery = "poll" if args.mode == "polling" else "stream"
        procs.worker(
            "w0", "--concurrency", "4", "--discovery", discovery, "--poll-interval", str(args.poll_interval)
        )
        # Warm-up: the worker is up and its discovery follows the collection.
        await one(runner, "warmup", 30 + 2 * args.poll_interval)
        within = 10 + 2 * args.poll_interval
        latencies = []
        for i in range(args.tasks):
            jitter = random.uniform(0, args.poll_interval) if args.mode == "polling" else 0.0
            await asyncio.sleep(args.gap + jitter)
            latencies.append(await one(runner, f"t{i:05}", within))
        return latencies
    finally:
        await runner.close()


def figures(latencies: list[float], to_claim: list[float] | None = None) -> dict[str, Any]:
    """Percentiles and every latency (ms); with ``to_claim``, the median server part too."""
    ms = [1000 * s for s in latencies]
    result: dict[str, Any] = {
        "tasks": len(ms),
        "p50_ms": round(percentile(ms, 50), 1),
        "p90_ms": round(percentile(ms, 90), 1),
        "p99_ms": round(percentile(ms, 99), 1),
        "max_ms": round(max(ms), 1),
        "latencies_ms": [round(v, 1) for v in ms],
    }
    if to_claim is not None:
        result["to_claim_p50_ms"] = round(1000 * statistics.median(to_claim), 1)
    return result


async def main_async(args: argparse.Namespace) -> list[tuple[float, float]]:
    with dev_server() as uri, Processes(uri, COLLECTION) as procs:
        try:
            return await measure(uri, procs, args)
        except Exception:
            print(procs.tail("w0"))
            raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["stream", "polling"], default="stream")
    parser.add_argument("--tasks", type=int, help="default 200 (stream), 60 (polling)")
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between a task's end and the next")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="the worker's --poll-interval")
    add_common_args(parser)
    args = parser.parse_args()
    if args.tasks is None:
        args.tasks = 200 if args.mode == "stream" else 60
    if args.smoke:
        # Polling tasks take about a poll interval each: fewer of them.
        args.tasks, args.poll_interval = (5 if args.mode == "stream" else 3), min(args.poll_interval, 0.5)
    latencies, to_claim = zip(*asyncio.run(main_async(args)), strict=True)
    config = {"mode": args.mode, "poll_interval": args.poll_interval}
    emit("pickup", config, figures(list(latencies), list(to_claim)), results=args.results, smoke=args.smoke)


if __name__ == "__main__":
    main()
