"""What idle workers cost the server: commands per second per worker, by job.

W ``taskrunner worker`` processes (``--concurrency 1``, counting their round trips) run
``--warm`` no-op tasks, then sit idle, once for ``--short`` and once for ``--long``
seconds, then stop. The difference of the two runs' command counts over the difference
of their idle times is the idle cost: start-up, the warm-up tasks and shutdown cancel
out. Modes: ``stream`` (change streams, the default) and ``poll`` (``--discovery poll``,
a sweep every ``--poll-interval``). ``idle_claims`` counts the claims the workers
attempted after the warm-up tasks were done (their debug log: ``claimed`` and each key
of ``claim missed``); 0 expected: a worker never claims a finished task.

    uv run python bench/idle.py [--workers 4] [--short 5] [--long 35] [--modes stream,poll]
                                [--rounds 1] [--smoke] [--results PATH]

One JSON line per mode and round (bench "idle", config {"mode", "workers"}).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from datetime import datetime
from typing import Any

from common import add_common_args, emit
from processes import Processes, dev_server, stop_and_count, wait_until

from taskrunner import TaskRunner
from taskrunner.models import TaskState

POLL_INTERVAL = 1.0
SETTLE = 3.0


async def idle_counts(
    uri: str, collection: str, workers: int, mode: str, warm: int, idle: float
) -> tuple[Counter[str], Counter[str], int]:
    """Commands and jobs of ``workers`` processes that ran ``warm`` tasks, then idled ``idle``
    s, and the claims they attempted while idle."""
    extra = ["--log-level", "debug"]
    extra += ["--discovery", "poll", "--poll-interval", str(POLL_INTERVAL)] if mode == "poll" else []
    with Processes(uri, collection) as procs:
        names = [f"w{i}" for i in range(workers)]
        for name in names:
            procs.worker(name, "--concurrency", "1", *extra, env={"TASKRUNNER_COUNT_ROUNDTRIPS": "1"})
        async with TaskRunner(uri, collection=collection) as runner:
            await runner.init()

            async def registered() -> bool:
                return len(await runner.workers()) >= workers

            async def warmed() -> bool:
                return await runner.store.count(state=TaskState.SUCCESS) >= warm

            await wait_until(registered, 120, f"{workers} workers to register", interval=0.1)
            await asyncio.sleep(SETTLE)  # every worker has read the registry: ownership settled
            await runner.publish_many([{"name": "stamp", "key": f"warm{i}"} for i in range(warm)])
            await wait_until(warmed, 120, f"{warm} warm-up tasks", interval=0.1)
            since = time.time()
            await asyncio.sleep(idle)
            claims = sum(claims_since(procs, name, since) for name in names)
            commands, jobs = await stop_and_count(procs, names)
            return commands, jobs, claims


def claims_since(procs: Processes, name: str, since: float) -> int:
    """Claims ``name`` attempted after ``since`` (wall clock), from its debug log."""

    def after(event: dict[str, Any]) -> bool:
        return datetime.fromisoformat(str(event["timestamp"])).timestamp() >= since

    won = [e for e in procs.events(name, "claimed") if after(e)]
    missed = [e for e in procs.events(name, "claim missed") if after(e)]
    return len(won) + sum(len(e.get("keys", [])) for e in missed)


async def measure(uri: str, mode: str, workers: int, args: argparse.Namespace, run: int) -> dict[str, Any]:
    short = await idle_counts(uri, f"idle_{mode}_{run}_s", workers, mode, args.warm, args.short)
    long = await idle_counts(uri, f"idle_{mode}_{run}_l", workers, mode, args.warm, args.long)
    per = (args.long - args.short) * workers  # worker-seconds of idling the difference covers

    def rate(index: int) -> dict[str, float]:
        diff = {k: long[index][k] - short[index][k] for k in long[index] | short[index]}
        return {k: round(v / per, 3) for k, v in sorted(diff.items()) if v}

    commands, jobs = rate(0), rate(1)
    return {
        "commands_per_s_per_worker": round(sum(commands.values()), 3),
        "by_command": commands,
        "by_job": jobs,
        "idle_claims": short[2] + long[2],
        "idle_seconds": args.long - args.short,
    }


async def main(args: argparse.Namespace) -> None:
    with dev_server() as uri:
        for run in range(args.rounds):
            for mode in args.modes.split(","):
                figures = await measure(uri, mode, args.workers, args, run)
                config = {"mode": mode, "workers": args.workers}
                emit("idle", config, figures, results=args.results, smoke=args.smoke)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--warm", type=int, default=20, help="tasks run before idling")
    parser.add_argument("--short", type=float, default=5.0)
    parser.add_argument("--long", type=float, default=35.0)
    parser.add_argument("--modes", default="stream,poll")
    parser.add_argument("--rounds", type=int, default=1)
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.warm, args.short, args.long = 2, 4, 1.0, 3.0
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
