"""How soon a pause takes effect fleet-wide: server time from ``paused_at`` to the last
claim of the paused name, while tasks of it keep arriving.

W ``taskrunner worker`` processes run no-op tasks published every 20 ms; the script
pauses the name, keeps publishing for 2 s, resumes, and reads the documents. Repeated
``--rounds`` times; reports every lag, the median and the maximum (the promise: < 1 s).

    uv run python bench/pause.py [--workers 4] [--rounds 5] [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from common import add_common_args, emit
from processes import Processes, dev_server, wait_until

from taskrunner import LimitState, TaskRunner, TaskState


async def feed(runner: TaskRunner, prefix: str, stop: asyncio.Event) -> None:
    i = 0
    while not stop.is_set():
        await runner.publish("noop", key=f"{prefix}{i}")
        i += 1
        await asyncio.sleep(0.02)


async def one_round(runner: TaskRunner, n: int) -> float:
    """Seconds from the pause (server time) to the last claim of the name before resume."""
    stop = asyncio.Event()
    feeding = asyncio.create_task(feed(runner, f"r{n}-", stop))
    await asyncio.sleep(1.0)
    [paused] = await runner.pause("noop")
    await asyncio.sleep(2.0)
    stop.set()
    await feeding
    tasks = await runner.list_tasks(name="noop", limit=100_000)
    claims = [w.claimed_at for t in tasks if t.key.startswith(f"r{n}-") for w in t.workers]
    await runner.resume("noop")
    assert isinstance(paused, LimitState) and paused.paused_at is not None
    return max(0.0, max(c for c in claims).timestamp() - paused.paused_at.timestamp())


async def main(args: argparse.Namespace) -> None:
    with dev_server() as uri, Processes(uri, "pause") as procs:
        for i in range(args.workers):
            procs.worker(f"w{i}")
        async with TaskRunner(uri, collection="pause") as runner:
            await runner.init()

            async def registered() -> bool:
                return len(await runner.workers()) >= int(args.workers)

            await wait_until(registered, 120, "workers", interval=0.1)
            lags = []
            for n in range(args.rounds):
                lags.append(round(await one_round(runner, n), 3))

                async def drained() -> bool:
                    return bool(await runner.store.count(state=TaskState.PENDING) == 0)

                await wait_until(drained, 120, "the backlog after resume", interval=0.1)
    figures: dict[str, Any] = {"lags_s": lags, "median_s": statistics.median(lags), "max_s": max(lags)}
    emit(
        "pause",
        {"workers": args.workers, "rounds": args.rounds},
        figures,
        results=args.results,
        smoke=args.smoke,
    )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.rounds = 2, 1
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
