"""Engine overhead: worker CPU time per no-op task, with the in-memory store (no network, no server).

Publishes N no-op tasks into a ``MemoryStore`` **before** the timer starts (publishing
is excluded), then runs one in-process ``taskrunner.engine.worker.Worker`` with C slots
until every task is SUCCESS and divides the ``time.process_time()`` delta (this
process, all threads; nothing subtracted) by N. What it counts is the whole
worker: discovery (startup scan and change events), claim queue, claims, runs,
outcome writes, plus the MemoryStore's own work standing in for the server.
``--concurrency`` takes a comma list (one JSON line per value, config
``{"store": "memory", "concurrency": C}``; figures tasks, cpu_ms_per_task,
wall_s, tasks_per_s). For orientation it also splits the CPU time into
store_ms_per_task (inside MemoryStore calls: the share a real server would carry;
the in-memory store scans every document per claim, so it grows with N) and
engine_ms_per_task (the rest); cpu_ms_per_task is their sum, nothing subtracted. ``--profile`` runs the same window under cProfile, prints
the top 25 entries by cumulative and by own time to stderr and records nothing
(the profiler inflates the CPU time).

    uv run python bench/cpu.py --concurrency 10,50 [--tasks 3000] [--profile] [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import inspect
import io
import pstats
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from common import add_common_args, emit, int_list

from taskrunner import MemoryStore, TaskContext, TaskRunner, TaskState
from taskrunner.engine.worker import Worker
from taskrunner.observability.logs import configure_logging


class TimedMemoryStore(MemoryStore):
    """A MemoryStore that adds up the CPU time spent inside its calls.

    Its operations complete without awaiting, so the process-time delta around one
    call is that call's own cost: the share a real server would carry. ``watch``
    is left out (its stream waits for events); decoding events stays engine time.
    Only the outermost call counts (``claim_many`` may call ``claim``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.cpu = 0.0
        self._depth = 0
        for name, method in inspect.getmembers(self, inspect.iscoroutinefunction):
            if not name.startswith("_") and name != "watch":
                setattr(self, name, self._timed(method))

    def _timed(self, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(method)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            self._depth += 1
            try:
                return await method(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.cpu += time.process_time() - start

        return timed


async def measure(tasks: int, concurrency: int, profiler: cProfile.Profile | None) -> dict[str, Any]:
    store = TimedMemoryStore()
    app = TaskRunner(store=store)
    done = asyncio.Event()
    handled = 0

    @app.task("noop")
    async def noop(params: dict[str, Any], ctx: TaskContext) -> None:
        nonlocal handled
        handled += 1
        if handled >= tasks:
            done.set()

    await app.init()
    await app.publish_many([{"name": "noop", "key": f"t{i:05}"} for i in range(tasks)])
    worker = Worker(app, worker_id="cpu", concurrency=concurrency)
    if profiler is not None:
        profiler.enable()
    store.cpu = 0.0
    cpu, wall = time.process_time(), time.perf_counter()
    running = asyncio.create_task(worker.run())
    # Count handler calls instead of polling the store, so the bench itself costs no CPU
    # until the last handler returns; then wait for the last outcome writes.
    await done.wait()
    while await app.store.count(state=TaskState.SUCCESS) < tasks:
        await asyncio.sleep(0.005)
    cpu, wall, in_store = time.process_time() - cpu, time.perf_counter() - wall, store.cpu
    if profiler is not None:
        profiler.disable()
    worker.stop()
    await running
    return {
        "tasks": tasks,
        "cpu_ms_per_task": round(1000 * cpu / tasks, 4),
        "store_ms_per_task": round(1000 * in_store / tasks, 4),
        "engine_ms_per_task": round(1000 * (cpu - in_store) / tasks, 4),
        "wall_s": round(wall, 3),
        "tasks_per_s": round(tasks / wall, 1),
    }


def print_profile(profiler: cProfile.Profile) -> None:
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(order).print_stats(25)
        print(f"--- top 25 by {order} ---\n{out.getvalue()}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--concurrency", type=int_list, default=[10, 50], help="comma list of slots")
    parser.add_argument("--profile", action="store_true", help="print a cProfile summary; record nothing")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.tasks, args.concurrency = 50, [10]
    configure_logging("console", "error")
    for concurrency in args.concurrency:
        profiler = cProfile.Profile() if args.profile else None
        figures = asyncio.run(measure(args.tasks, concurrency, profiler))
        if profiler is not None:
            print(f"concurrency {concurrency}: {figures}", file=sys.stderr)
            print_profile(profiler)
            continue
        emit(
            "cpu",
            {"store": "memory", "concurrency": concurrency},
            figures,
            results=args.results,
            smoke=args.smoke,
        )


if __name__ == "__main__":
    main()
