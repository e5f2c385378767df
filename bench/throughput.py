"""Throughput: tasks per second and worker round trips per task, by workers x concurrency.

For each combination: starts a fresh embedded server (``taskrunner dev-server --port 0``),
starts W ``taskrunner worker --concurrency C`` processes (bench/apps.py) with
``TASKRUNNER_COUNT_ROUNDTRIPS=1``, waits until all W are registered (idle, discovery
running), then publishes N ``noop`` tasks in one ``publish_many``. Workers start
first so process start-up (about a second each on a small machine) is not timed.
Time = last ``finished_at`` - first ``claimed_at``, both server times read from the
task documents. When every task is SUCCESS the workers get SIGTERM and each logs
its ``round trips`` (commands by name); round trips per task = their sum / N. That
sum includes each worker's start-up, idle background (registry beats, change-stream
getMores) and shutdown, amortized over N.

    uv run python bench/throughput.py [--workers 1,2,4] [--concurrency 1,4,16] [--tasks 300]
                                      [--smoke] [--results PATH]

N defaults to 300 so each combination stays under a minute on a 2-core machine with
the embedded server (concurrency 1 ran at about 10 tasks/s there, concurrency 16 at
35-75). Prints one JSON line per combination (config {"system": "taskrunner", "workers": W,
"concurrency": C}); bench/baseline.py writes comparable lines for the hand-rolled loop.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from typing import Any

from common import add_common_args, emit, int_list
from processes import Processes, dev_server, stop_and_count, wait_until

from taskrunner import TaskRunner
from taskrunner.models import TaskState

COLLECTION = "throughput"


async def run_tasks(
    runner: TaskRunner, procs: Processes, workers: int, concurrency: int, tasks: int
) -> float:
    """Start the workers, publish, wait for every task; the seconds from first claim to last finish."""
    for i in range(workers):
        procs.worker(f"w{i}", "--concurrency", str(concurrency), env={"TASKRUNNER_COUNT_ROUNDTRIPS": "1"})

    async def all_registered() -> bool:
        return len(await runner.workers()) >= workers

    await wait_until(all_registered, 60, f"{workers} workers to register", interval=0.1)
    await runner.publish_many([{"name": "noop", "key": f"t{i:05}"} for i in range(tasks)])

    async def all_done() -> bool:
        return await runner.store.count(state=TaskState.SUCCESS) >= tasks

    await wait_until(all_done, 120, f"{tasks} tasks to succeed", interval=0.1)
    done = await runner.store.find(state=TaskState.SUCCESS)
    first = min(w.claimed_at for t in done for w in t.workers)
    last = max(w.finished_at for t in done for w in t.workers if w.finished_at is not None)
    return (last - first).total_seconds()


async def combination(workers: int, concurrency: int, tasks: int) -> dict[str, Any]:
    with dev_server() as uri, Processes(uri, COLLECTION) as procs:
        runner = TaskRunner(uri, collection=COLLECTION)
        try:
            await runner.init()
            seconds = await run_tasks(runner, procs, workers, concurrency, tasks)
            commands, jobs = await stop_and_count(procs, [f"w{i}" for i in range(workers)])
        except Exception:
            for i in range(workers):
                print(procs.tail(f"w{i}"))
            raise
        finally:
            await runner.close()
    return throughput_figures(tasks, seconds, commands, jobs)


def throughput_figures(
    tasks: int, seconds: float, commands: Counter[str], jobs: Counter[str]
) -> dict[str, Any]:
    """The figures of one run (bench/baseline.py reports the same)."""
    per_task = {k: round(v / tasks, 3) for k, v in sorted(commands.items())}
    return {
        "tasks": tasks,
        "seconds": round(seconds, 3),
        "tasks_per_s": round(tasks / seconds, 1),
        "roundtrips_per_task": round(sum(commands.values()) / tasks, 3),
        "roundtrips_per_task_by_command": per_task,
        "roundtrips_per_task_by_job": {k: round(v / tasks, 3) for k, v in sorted(jobs.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int_list, default=[1, 2, 4], help="comma-separated, e.g. 1,2,4")
    parser.add_argument(
        "--concurrency", type=int_list, default=[1, 4, 16], help="comma-separated slots per worker"
    )
    # 300, not more: at concurrency 1 the engine runs about 10 tasks/s here (see the docstring).
    parser.add_argument("--tasks", type=int, default=300)
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.concurrency, args.tasks = [1], [4], 20
    for workers in args.workers:
        for concurrency in args.concurrency:
            figures = asyncio.run(combination(workers, concurrency, args.tasks))
            config = {"system": "taskrunner", "workers": workers, "concurrency": concurrency}
            emit("throughput", config, figures, results=args.results, smoke=args.smoke)


if __name__ == "__main__":
    main()
