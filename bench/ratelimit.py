"""Fleet-wide rate limit precision, and what a limited name costs the server per task.

W ``taskrunner worker`` processes (counting their round trips) run N no-op tasks twice,
side by side on one dev server: once with ``taskrunner limit noop --rate R`` in force,
once without. From the task documents (``claimed_at``, server time) it reports the most
starts any window of the rate's period holds (the limit: never more), the achieved rate
while the backlog lasts (starts / (last - first + period)), and server commands per
task of both runs (each worker's own count, all jobs).

    uv run python bench/ratelimit.py [--workers 8] [--tasks 2000] [--rate 50/s]
                                     [--rounds 1] [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import time
from typing import Any

from common import add_common_args, emit
from processes import Processes, dev_server, stop_and_count, wait_until

from taskrunner import TaskRunner, TaskState
from taskrunner.gates import parse_rate


async def run_once(uri: str, collection: str, workers: int, tasks: int, rate: str | None) -> dict[str, Any]:
    """Run ``tasks`` no-ops on ``workers`` processes (rate-limited if ``rate``)."""
    with Processes(uri, collection) as procs:
        async with TaskRunner(uri, collection=collection) as runner:
            await runner.init()
            if rate is not None:
                await runner.limit("noop", rate_limit=rate)
            names = [f"w{i}" for i in range(workers)]
            for name in names:
                procs.worker(name, env={"TASKRUNNER_COUNT_ROUNDTRIPS": "1"})

            async def registered() -> bool:
                return len(await runner.workers()) >= workers

            async def done() -> bool:
                return await runner.store.count(state=TaskState.SUCCESS) >= tasks

            await wait_until(registered, 120, f"{workers} workers to register", interval=0.1)
            await asyncio.sleep(3)  # every worker has read the registry and its limits
            for first in range(0, tasks, 200):  # chunks: one huge write stalls the dev server
                await runner.publish_many([{"name": "noop", "key": f"t{i}"} for i in range(first, min(first + 200, tasks))])
            started = time.monotonic()
            await wait_until(done, 600, f"{tasks} tasks", interval=0.2)
            elapsed = time.monotonic() - started
            found = await runner.list_tasks(name="noop", limit=tasks + 10)
            commands, _ = await stop_and_count(procs, names)
    starts = sorted(t.workers[0].claimed_at.timestamp() for t in found)
    return {"starts": starts, "commands": sum(commands.values()), "seconds": round(elapsed, 2)}


def most_in_window(starts: list[float], period: float) -> int:
    """The most starts any half-open window ``[t, t + period)`` holds (t at each start)."""
    return max(bisect.bisect_left(starts, s + period) - i for i, s in enumerate(starts))


async def measure(uri: str, args: argparse.Namespace, run: int) -> dict[str, Any]:
    period = parse_rate(args.rate).period
    limited = await run_once(uri, f"rl_{run}_limited", args.workers, args.tasks, args.rate)
    free = await run_once(uri, f"rl_{run}_free", args.workers, args.tasks, None)
    starts = limited["starts"]
    achieved = len(starts) / (starts[-1] - starts[0] + period)
    limit = parse_rate(args.rate).limit
    per_task = limited["commands"] / args.tasks
    free_per_task = free["commands"] / args.tasks
    return {
        "max_starts_per_window": most_in_window(starts, period),
        "limit": limit,
        "achieved_per_s": round(achieved * period, 2),
        "achieved_share": round(achieved * period / limit, 3),
        "commands_per_task_limited": round(per_task, 2),
        "commands_per_task_unlimited": round(free_per_task, 2),
        "commands_ratio": round(per_task / free_per_task, 3),
        "seconds_limited": limited["seconds"],
        "seconds_unlimited": free["seconds"],
    }


async def main(args: argparse.Namespace) -> None:
    with dev_server() as uri:
        for run in range(args.rounds):
            figures = await measure(uri, args, run)
            config = {"workers": args.workers, "tasks": args.tasks, "rate": args.rate}
            emit("ratelimit", config, figures, results=args.results, smoke=args.smoke)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rate", default="50/s")
    parser.add_argument("--rounds", type=int, default=1)
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.tasks, args.rate = 2, 40, "20/s"
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
