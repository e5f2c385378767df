"""Fleet-wide limits: precision, and what a limited name costs the server per task.

W ``taskrunner worker`` processes (counting their round trips) run N no-op tasks,
published in chunks of 100 as fast as the server takes them, four times, side by side on one dev server: with ``taskrunner limit noop --rate R`` in force,
without any limit, and with ``--max-running M`` (tasks sleeping ``--hold`` seconds).
From the task documents (server times) it reports the most starts any window of the
rate's period holds (the promise: never more than the limit), the achieved rate while
the backlog lasts (starts / (last - first + period)), the most runs at once under
max_running (never more than M), and server commands per task of each run (every
command of every worker, from start to stop), in all and per job.

    uv run python bench/ratelimit.py [--workers 8] [--tasks 2000] [--rate 50/s]
                                     [--max-running 3] [--hog] [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import time
from collections import Counter
from typing import Any

from common import add_common_args, emit
from processes import Processes, dev_server, stop_and_count, wait_until
from versus import cpu_hog

from taskrunner import Task, TaskRunner, TaskState
from taskrunner.gates import parse_rate


async def run_once(
    uri: str, collection: str, args: argparse.Namespace, limit: dict[str, Any]
) -> dict[str, Any]:
    """Run the tasks on ``args.workers`` processes with ``limit`` set on their name."""
    name = "sleep" if "max_running" in limit else "noop"
    params = {"seconds": args.hold} if name == "sleep" else {}
    tasks = args.tasks if name == "noop" else args.held_tasks
    with Processes(uri, collection) as procs:
        async with TaskRunner(uri, collection=collection) as runner:
            await runner.init()
            if limit:
                await runner.limit(name, **limit)
            names = [f"w{i}" for i in range(args.workers)]
            for worker in names:
                procs.worker(worker, env={"TASKRUNNER_COUNT_ROUNDTRIPS": "1"})

            async def registered() -> bool:
                return len(await runner.workers()) >= args.workers

            await wait_until(registered, 120, f"{args.workers} workers to register", interval=0.1)
            await asyncio.sleep(3)  # every worker has read the registry and its limits
            started = time.monotonic()
            for first in range(0, tasks, 100):  # small chunks: a big write into a busy dev server stalls it
                batch = range(first, min(first + 100, tasks))
                await runner.publish_many([{"name": name, "key": f"t{i}", "params": params} for i in batch])
                await asyncio.sleep(0.1)

            async def done() -> bool:
                return await runner.store.count(state=TaskState.SUCCESS) >= tasks

            await wait_until(done, 900, f"{tasks} tasks", interval=0.2)
            elapsed = time.monotonic() - started
            found = await runner.list_tasks(name=name, limit=tasks + 10)
            commands, jobs = await stop_and_count(procs, names)
            gates = Counter[str]()
            for worker in names:
                for event in procs.events(worker, "gate round trips"):
                    gates.update({k: v for k, v in event.items() if isinstance(v, int)})
    return {
        "tasks": found,
        "commands": sum(commands.values()),
        "jobs": dict(jobs),
        "gates": dict(gates),
        "seconds": round(elapsed, 2),
    }


def most_in_window(starts: list[float], period: float) -> int:
    """The most starts any half-open window ``[t, t + period)`` holds (t at each start)."""
    return max(bisect.bisect_left(starts, s + period) - i for i, s in enumerate(starts))


def most_at_once(tasks: list[Task]) -> int:
    edges = sorted(
        (t, step)
        for task in tasks
        for e in task.workers
        if e.finished_at
        for t, step in ((e.claimed_at.timestamp(), 1), (e.finished_at.timestamp(), -1))
    )
    running = best = 0
    for _, step in edges:
        running += step
        best = max(best, running)
    return best


def _per_task(jobs: dict[str, int], tasks: int) -> dict[str, float]:
    return {job: round(count / tasks, 3) for job, count in sorted(jobs.items())}


def _task_bound(jobs: dict[str, int]) -> int:
    return sum(jobs.get(job, 0) for job in ("claim", "run_writes", "gates"))


async def measure(uri: str, args: argparse.Namespace, run: int) -> dict[str, Any]:
    rate = parse_rate(args.rate)
    with cpu_hog(args.hog):
        limited = await run_once(uri, f"rl_{run}_limited", args, {"rate_limit": args.rate})
        free = await run_once(uri, f"rl_{run}_free", args, {})
        capped = await run_once(uri, f"rl_{run}_capped", args, {"max_running": args.max_running})
        held_free = await run_once(uri, f"rl_{run}_held", args, {"max_running": 0})
    starts = sorted(e.claimed_at.timestamp() for t in limited["tasks"] for e in t.workers)
    free_starts = sorted(e.claimed_at.timestamp() for t in free["tasks"] for e in t.workers)
    achieved = len(starts) / (starts[-1] - starts[0] + rate.period) * rate.period
    unlimited = len(free_starts) / (free_starts[-1] - free_starts[0] + rate.period) * rate.period
    per_task = limited["commands"] / args.tasks
    free_per_task = free["commands"] / args.tasks
    capped_per_task = capped["commands"] / args.held_tasks
    held_per_task = held_free["commands"] / args.held_tasks
    return {
        "max_starts_per_window": most_in_window(starts, rate.period),
        "limit": rate.limit,
        "achieved_per_period": round(achieved, 2),
        "achieved_share": round(achieved / rate.limit, 3),
        "unlimited_per_period": round(unlimited, 2),
        "max_starts_per_window_unlimited": most_in_window(free_starts, rate.period),
        "commands_per_task_limited": round(per_task, 2),
        "commands_per_task_unlimited": round(free_per_task, 2),
        "commands_ratio": round(per_task / free_per_task, 3),
        "gate_commands_per_task": round(limited["jobs"].get("gates", 0) / args.tasks, 3),
        # Commands that scale with tasks (claims, outcome writes, gate writes, renewals
        # included), free of the heartbeats and waits a longer run adds.
        "task_commands_ratio": round(_task_bound(limited["jobs"]) / _task_bound(free["jobs"]), 3),
        "gate_counts": limited["gates"],
        "max_running": args.max_running,
        "most_running_at_once": most_at_once(capped["tasks"]),
        "most_running_at_once_unlimited": most_at_once(held_free["tasks"]),
        "commands_per_task_capped": round(capped_per_task, 2),
        "commands_per_task_uncapped": round(held_per_task, 2),
        # Per job (claim, run_writes, gates scale with tasks; registry, limits, clock and
        # discovery's waits with time and workers), to tell the limit's cost from a longer run.
        "jobs_per_task": {
            "limited": _per_task(limited["jobs"], args.tasks),
            "unlimited": _per_task(free["jobs"], args.tasks),
            "capped": _per_task(capped["jobs"], args.held_tasks),
            "uncapped": _per_task(held_free["jobs"], args.held_tasks),
        },
        "seconds": {
            "limited": limited["seconds"],
            "unlimited": free["seconds"],
            "capped": capped["seconds"],
            "uncapped": held_free["seconds"],
        },
    }


async def main(args: argparse.Namespace) -> None:
    with dev_server() as uri:
        for run in range(args.rounds):
            figures = await measure(uri, args, run)
            config = {
                "workers": args.workers,
                "tasks": args.tasks,
                "rate": args.rate,
                "hog": args.hog,
                "max_running": args.max_running,
                "held_tasks": args.held_tasks,
                "hold": args.hold,
            }
            emit("ratelimit", config, figures, results=args.results, smoke=args.smoke)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rate", default="50/s")
    parser.add_argument("--max-running", type=int, default=3)
    parser.add_argument("--held-tasks", type=int, default=200, help="tasks of the max_running runs")
    parser.add_argument("--hold", type=float, default=0.05, help="seconds each max_running task sleeps")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hog", action="store_true", help="keep both cores busy during every run")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.tasks, args.rate, args.held_tasks = 2, 40, "20/s", 10
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
