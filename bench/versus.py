"""taskrunner against the hand-rolled loop, side by side on one server, as a user would run both.

One embedded server (``taskrunner dev-server --port 0``) serves every run; each run gets
a fresh collection. For each worker count W, each system runs in turn (the order
alternates between rounds, so neither always goes first on a warmer machine):

- ``taskrunner``: W ``taskrunner worker --concurrency 1`` processes (bench/apps.py,
  ``TASKRUNNER_COUNT_ROUNDTRIPS=1``), registered and settled (3 s, so each has read the
  registry and knows its peers) before publishing starts.
- ``loop``: W processes of bench/baseline_worker.py (``find_one_and_update`` PENDING ->
  RUNNING sorted by priority and age, ``update_one`` to SUCCESS, 100 ms sleep when idle).

Then N ``stamp`` tasks are published from this process, one at a time
(``--publish one``: ``runner.publish`` / ``insert_one``, each awaited before the next)
or all at once (``--publish many``: ``runner.publish_many`` / ``insert_many``). The
handler returns ``time.time()`` at its start.

Figures per run: ``tasks_per_s`` = N / (last finish - the moment publishing began),
pickup p50/p95 = handler start - the publish call of that task (one machine, one
clock), ``commands_per_task`` = every command the worker processes sent / N (their
PyMongo listeners; getMores, registry beats and idle polling included), and for
taskrunner ``getmores_per_task_per_worker``, ``events_per_task_per_worker`` (change
events the workers received) and ``claim_attempts_per_claim`` (claim commands / N).
``--hog`` keeps both cores busy with two spinning processes during every run.

    uv run python bench/versus.py [--workers 4,16] [--tasks 300] [--publish one|many]
                                  [--rounds 3] [--hog] [--systems taskrunner,loop]
                                  [--uri URI] [--smoke] [--results PATH]

One JSON line per run (bench "versus", config {"system", "workers", "publish", "hog"});
bench/report.py takes medians per config, and ratios are taken within each round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from common import add_common_args, emit, int_list, percentile
from processes import BENCH_DIR, Processes, dev_server, wait_until
from pymongo import AsyncMongoClient

from taskrunner import TaskRunner
from taskrunner.models import TaskState

Doc = dict[str, Any]
LOOP_DB = "baseline"
SETTLE = 3.0  # seconds between the last worker's registration and the first publish
LOOP_INDEX = [("state", 1), ("priority", -1), ("created_at", 1)]


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def cpu_hog(enabled: bool) -> Iterator[None]:
    """Two processes spinning at normal priority: both cores busy, as on a shared host."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(2 if enabled else 0)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.join()


def figures(tasks: int, seconds: float, pickups: list[float]) -> dict[str, Any]:
    return {
        "tasks": tasks,
        "seconds": round(seconds, 3),
        "tasks_per_s": round(tasks / seconds, 1),
        "pickup_p50_ms": round(1000 * percentile(pickups, 50), 2),
        "pickup_p95_ms": round(1000 * percentile(pickups, 95), 2),
    }


async def stop_all(procs: Processes, names: list[str]) -> list[dict[str, Any]]:
    """SIGTERM every process; the last ``round trips`` event each logged."""
    for name in names:
        procs.signal(name, signal.SIGTERM)
    counts = []
    for name in names:
        await procs.wait_exit(name, 30)
        events = procs.events(name, "round trips")
        if not events:
            raise RuntimeError(f"{name} logged no round trips:\n{procs.tail(name)}")
        counts.append(events[-1])
    return counts


# -- taskrunner ----------------------------------------------------------------------------------
async def run_taskrunner(uri: str, collection: str, workers: int, tasks: int, many: bool) -> dict[str, Any]:
    with Processes(uri, collection) as procs:
        names = [f"w{i}" for i in range(workers)]
        for name in names:
            procs.worker(name, "--concurrency", "1", env={"TASKRUNNER_COUNT_ROUNDTRIPS": "1"})
        runner = TaskRunner(uri, collection=collection)
        try:
            await runner.init()

            async def registered() -> bool:
                return len(await runner.workers()) >= workers

            await wait_until(registered, 120, f"{workers} workers to register", interval=0.1)
            # Steady state, as in production: every worker has read the registry (every 2 s)
            # and knows its peers, so ownership and its stream's buckets are settled.
            await asyncio.sleep(SETTLE)
            keys = [f"t{i:05}" for i in range(tasks)]
            published: dict[str, float] = {}
            start = time.time()
            if many:
                await runner.publish_many([{"name": "stamp", "key": k} for k in keys])
                published = dict.fromkeys(keys, start)
            else:
                for key in keys:
                    published[key] = time.time()
                    await runner.publish("stamp", key=key)

            async def all_done() -> bool:
                return await runner.store.count(state=TaskState.SUCCESS) >= tasks

            await wait_until(all_done, 300, f"{tasks} tasks to succeed", interval=0.05)
            done = await runner.store.find(state=TaskState.SUCCESS)
            reports = await stop_all(procs, names)
        except Exception:
            for name in names:
                print(procs.tail(name), file=sys.stderr)
            raise
        finally:
            await runner.close()
    end = max(w.finished_at.timestamp() for t in done for w in t.workers if w.finished_at is not None)
    pickups = [float(t.results[0]) - published[t.key] for t in done]
    commands: Counter[str] = Counter()
    jobs: Counter[str] = Counter()
    for report in reports:
        commands.update(report["commands"])
        jobs.update(report.get("jobs", {}))
    events = sum(report.get("change_events", 0) for report in reports)
    return {
        **figures(tasks, end - start, pickups),
        "commands_per_task": round(sum(commands.values()) / tasks, 3),
        "commands_per_task_by_job": {k: round(v / tasks, 3) for k, v in sorted(jobs.items())},
        "commands_per_task_by_name": {k: round(v / tasks, 3) for k, v in sorted(commands.items())},
        "getmores_per_task_per_worker": round(commands["getMore"] / tasks / workers, 3),
        "events_per_task_per_worker": round(events / tasks / workers, 3),
        "claim_attempts_per_claim": round(jobs["claim"] / tasks, 3),
        "runs_per_worker": sorted(Counter(t.workers[0].worker_id for t in done).values()),
    }


# -- the loop -------------------------------------------------------------------------------------
def loop_document(key: str) -> Doc:
    return {"key": key, "name": "stamp", "state": "PENDING", "priority": 0, "created_at": time.time()}


async def run_loop(uri: str, collection: str, workers: int, tasks: int, many: bool) -> dict[str, Any]:
    with Processes(uri, collection) as procs:
        names = [f"b{i}" for i in range(workers)]
        client: AsyncMongoClient[Doc] = AsyncMongoClient(uri, tz_aware=True)
        coll = client[LOOP_DB][collection]
        try:
            await coll.create_index(LOOP_INDEX)
            for name in names:
                procs.start(
                    name, [sys.executable, str(BENCH_DIR / "baseline_worker.py"), uri, collection, name]
                )

            async def ready() -> bool:
                return all(procs.events(name, "ready") for name in names)

            await wait_until(ready, 120, "loop workers to start", interval=0.05)
            keys = [f"t{i:05}" for i in range(tasks)]
            published: dict[str, float] = {}
            start = time.time()
            if many:
                await coll.insert_many([loop_document(k) for k in keys])
                published = dict.fromkeys(keys, start)
            else:
                for key in keys:
                    published[key] = time.time()
                    await coll.insert_one(loop_document(key))

            async def all_done() -> bool:
                return await coll.count_documents({"state": "SUCCESS"}) >= tasks

            await wait_until(all_done, 300, f"{tasks} loop tasks", interval=0.05)
            docs = await coll.find({}, {"key": 1, "result": 1, "finished_at": 1, "owner": 1}).to_list()
            reports = await stop_all(procs, names)
        finally:
            await client.close()
    end = max(d["finished_at"].timestamp() for d in docs)
    pickups = [float(d["result"]) - published[d["key"]] for d in docs]
    total = sum(report["total"] for report in reports)
    return {
        **figures(tasks, end - start, pickups),
        "commands_per_task": round(total / tasks, 3),
        "runs_per_worker": sorted(Counter(d["owner"] for d in docs).values()),
    }


SYSTEMS = {"taskrunner": run_taskrunner, "loop": run_loop}


def run(args: argparse.Namespace) -> None:
    with contextlib.nullcontext(args.uri) if args.uri else dev_server() as uri:
        for round_ in range(args.rounds):
            for workers in args.workers:
                order = args.systems if round_ % 2 == 0 else args.systems[::-1]
                for system in order:
                    collection = f"v_{system}_w{workers}_r{round_}"
                    with cpu_hog(args.hog):
                        result = asyncio.run(
                            SYSTEMS[system](uri, collection, workers, args.tasks, args.publish == "many")
                        )
                    config = {"system": system, "workers": workers, "publish": args.publish, "hog": args.hog}
                    emit(
                        "versus", config, {"round": round_, **result}, results=args.results, smoke=args.smoke
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int_list, default=[4, 16], help="comma list, e.g. 4,16")
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--publish", choices=["one", "many"], default="one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hog", action="store_true", help="keep both cores busy during every run")
    parser.add_argument("--systems", type=lambda s: s.split(","), default=["taskrunner", "loop"])
    parser.add_argument("--uri", help="use this server instead of starting a dev-server (e.g. to profile it)")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.tasks, args.rounds = [2], 20, 1
    run(args)


if __name__ == "__main__":
    main()
