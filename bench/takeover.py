"""Takeover time: how long a task waits for another worker when its owner dies or is stopped.

Starts the embedded server (``taskrunner dev-server --port 0``) and three ``taskrunner
worker --concurrency 2`` processes (bench/apps.py). Each sample publishes a ``sleep`` task (60 s,
``ping_interval`` 0.5, ``ping_timeout`` 2 by default), waits until a worker runs it,
then signals that owner:

- SIGKILL: the dead run's lease expires ``ping_timeout`` after its last ping, then the
  other worker claims the task (its entry lists the dead one in ``took_over``).
  Sample = new entry's ``claimed_at`` - the dead entry's last ``ping_at`` (both server
  times, from the document; the last ping is read after the kill, before the lease
  can expire, since the takeover drops the stale entry).
- SIGTERM: the owner stops claiming, gives its handler ``--shutdown-timeout`` (0.5 s
  default) and releases the claim; the other worker claims it. Sample = new entry's
  ``claimed_at`` - the server's clock (``hello.localTime``) read just before the signal.

After each sample the task is canceled; before each sample fresh workers (new ids)
replace signalled ones until at least two are live and registered. A SIGKILLed worker's registry entry
lives 10 s more, so for a while the survivor may rank behind a dead peer and wait one
claim step (50-250 ms) before taking over: that is part of the measured time.

    uv run python bench/takeover.py [--samples 5] [--ping-timeout 2.0] [--ping-interval 0.5]
                                    [--smoke] [--results PATH]

Prints one JSON line per signal: samples (seconds), median_s, max_s.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
from datetime import datetime
from itertools import count
from typing import Any

from common import add_common_args, emit
from processes import Processes, dev_server, wait_until

from taskrunner import TaskRunner
from taskrunner.models import EntryState, Task, WorkerEntry

COLLECTION = "takeover"
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM}


class Fleet:
    """Live worker processes; a signalled one leaves, fresh ones (new ids) join."""

    def __init__(self, runner: TaskRunner, procs: Processes) -> None:
        self.runner, self.procs, self.ids = runner, procs, count()
        self.live: list[str] = []

    async def grow(self, size: int) -> None:
        """Start workers (in parallel) until ``size`` are live and registered."""
        new = [f"w{next(self.ids)}" for _ in range(size - len(self.live))]
        for worker_id in new:
            self.procs.worker(worker_id, "--concurrency", "2")
        self.live.extend(new)

        async def registered() -> bool:
            return set(new) <= {w.worker_id for w in await self.runner.workers()}

        await wait_until(registered, 60, f"{new} to register", interval=0.05)

    def signal(self, worker_id: str, signum: int) -> None:
        self.procs.signal(worker_id, signum)
        self.live.remove(worker_id)


async def running(runner: TaskRunner, key: str, but: str | None = None) -> WorkerEntry | None:
    """The task's running entry of a worker other than ``but``, if any."""
    task = await runner.get(key)
    return next((w for w in task.workers if w.state is EntryState.RUNNING and w.worker_id != but), None)


def entry(task: Task, run_id: str) -> WorkerEntry:
    found = task.entry(run_id)
    assert found is not None, f"run {run_id} is gone from {task.key}"
    return found


async def sample(fleet: Fleet, key: str, signame: str, args: argparse.Namespace) -> float:
    """Publish, signal the owner, wait for the other worker's claim; the takeover time."""
    runner = fleet.runner
    await runner.publish(
        "sleep", {"seconds": 60}, key=key, ping_interval=args.ping_interval, ping_timeout=args.ping_timeout
    )
    # Polled gently: the document's server times, not this loop, time the takeover.
    owner: WorkerEntry = await wait_until(
        lambda: running(runner, key), 30, f"{key} to be claimed", interval=0.05
    )
    # Let a ping land: the lease then runs from a heartbeat, not from the claim.
    await asyncio.sleep(args.ping_interval)
    since: datetime = await runner.store.server_time()
    fleet.signal(owner.worker_id, SIGNALS[signame])
    if signame == "SIGKILL":
        await asyncio.sleep(0.3)  # a ping already on the wire lands; the lease is still live
        since = entry(await runner.get(key), owner.run_id).ping_at
    within = args.ping_timeout + 30
    new: WorkerEntry = await wait_until(
        lambda: running(runner, key, but=owner.worker_id), within, f"{key} taken over", interval=0.05
    )
    if signame == "SIGKILL" and owner.worker_id not in new.took_over:
        raise AssertionError(f"{key}: the new entry's took_over is {new.took_over}, not {owner.worker_id}")
    await runner.cancel(key)  # the survivor's handler stops at its next ping
    return (new.claimed_at - since).total_seconds()


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in SIGNALS}
    with dev_server() as uri, Processes(uri, COLLECTION) as procs:
        runner = TaskRunner(uri, collection=COLLECTION)
        fleet = Fleet(runner, procs)
        try:
            await runner.init()
            await fleet.grow(3)  # a spare: the first sample's replacement need not start at once
            for signame, i in [(s, i) for s in SIGNALS for i in range(args.samples)]:
                await fleet.grow(2)  # the owner and at least one idle worker to take over
                samples[signame].append(await sample(fleet, f"{signame}-{i}", signame, args))
        except Exception:
            for name in procs.names:
                print(f"--- {name}\n{procs.tail(name)}")
            raise
        finally:
            await runner.close()
    return samples


def figures(samples: list[float]) -> dict[str, Any]:
    return {
        "samples": [round(s, 3) for s in samples],
        "median_s": round(statistics.median(samples), 3),
        "max_s": round(max(samples), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5, help="per signal")
    parser.add_argument("--ping-timeout", type=float, default=2.0)
    parser.add_argument("--ping-interval", type=float, default=0.5)
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.samples = 1
    samples = asyncio.run(measure(args))
    for signame, values in samples.items():
        config = {"signal": signame, "ping_timeout": args.ping_timeout}
        emit("takeover", config, figures(values), results=args.results, smoke=args.smoke)


if __name__ == "__main__":
    main()
