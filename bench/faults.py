"""MongoDB's faults under load: outcomes, and how soon pickup is back once a fault ends.

Each round starts a fresh embedded server (``taskrunner dev-server --port 0``) and
``--workers`` ``taskrunner worker`` processes (default options, bench/apps.py), publishes 4
long tasks (``sleep``, in flight through the fault) and a backlog, and sets one fault with
the server's test-only ``taskrunnerFault`` command (docs/embedded-server.md):

- ``ends``: the server ends every change stream ``--ends`` times while the backlog runs
  (each when another share of it has finished, and at least a second after the last);
- ``stepdown``: a ``--stepdown`` seconds stepdown once a fifth of the backlog has finished;
- ``lose``: the reply of every ``--lose-every``-th write is lost (the write applied) while
  the whole backlog runs;
- ``none``: the control, no fault: the stepdown's backlog, and the probe published once a
  fifth of it has finished, so its pickup is what "normal" means under that load.

When the fault ends (the last end; the server primary again; the fault turned off) a
probe task is published ahead of the backlog (priority 10). Its pickup recovery time is
``claimed_at - created_at`` of the probe's document (server times). Once every task is
finished the workers get SIGTERM; the slowest exit is timed. Outcomes come from the task
documents: ``success``, ``fail``, ``unfinished``, ``failures_counted`` (the failure budget
spent, summed), ``claimed_twice`` (tasks claimed more than once: with default options,
after a lost claim or a lease the fault let expire).

    uv run python bench/faults.py [--scenarios ends,stepdown,lose,none] [--rounds 3] [--workers 4]
                                  [--tasks 240,500,120,500] [--smoke] [--results PATH]

Prints and records one JSON line per scenario: summed outcome counts, each round's
recovery (s), their median, and the slowest exit after SIGTERM. A round takes about a
minute on a quiet machine (the stepdown's 500 tasks longer).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import time
from collections import Counter
from typing import Any

from common import add_common_args, emit
from processes import Processes, dev_server, wait_until
from pymongo import AsyncMongoClient

from taskrunner import TaskRunner, TaskState
from taskrunner.engine.follow import MIN_LIFE

COLLECTION = "faults"
SCENARIOS = ("ends", "stepdown", "lose", "none")
LONG = 4  # long tasks in flight through the fault
WAIT = 600.0  # bound on any wait: a fault round that takes longer has gone wrong


class Round:
    """One scenario's round: a server, worker processes, a publisher."""

    def __init__(self, uri: str, procs: Processes, runner: TaskRunner, args: argparse.Namespace) -> None:
        self.uri, self.procs, self.runner, self.args = uri, procs, runner, args
        self.workers = [f"w{i}" for i in range(args.workers)]

    async def fault(self, mode: str, **options: Any) -> dict[str, Any]:
        client: AsyncMongoClient[dict[str, Any]]
        async with AsyncMongoClient(self.uri) as client:
            reply: dict[str, Any] = await client.admin.command({"taskrunnerFault": mode, **options})
        return reply

    async def start(self) -> None:
        for worker_id in self.workers:
            self.procs.worker(worker_id)

        async def following() -> bool:
            return all(self.procs.events(w, "change stream opened") for w in self.workers)

        await wait_until(following, 60, "the workers' streams", interval=0.1)

    async def publish(self, name: str, n: int, prefix: str, **params: Any) -> None:
        await self.runner.publish_many(
            [{"name": name, "key": f"{prefix}{i:04d}", "params": params} for i in range(n)]
        )

    async def until_done(self, n: int, name: str | None = None) -> None:
        """Until ``n`` tasks (of ``name``) succeeded."""

        async def done() -> bool:
            return await self.runner.store.count(state=TaskState.SUCCESS, name=name) >= n

        await wait_until(done, WAIT, f"{n} tasks to succeed", interval=0.2)

    async def long_runs(self, seconds: float) -> None:
        await self.runner.publish_many(
            [
                {"name": "sleep", "key": f"long{i}", "params": {"seconds": seconds}, "priority": 1}
                for i in range(LONG)
            ]
        )

        async def running() -> bool:
            return await self.runner.store.count(state=TaskState.RUNNING) >= LONG

        await wait_until(running, 60, "the long tasks to run", interval=0.1)

    async def probe(self) -> float:
        """Seconds (server time) from the probe's publication to its claim."""
        await self.runner.publish("noop", key="probe", priority=10)

        async def claimed() -> float | None:
            task = await self.runner.get("probe")
            return (task.workers[0].claimed_at - task.created_at).total_seconds() if task.workers else None

        seconds: float = await wait_until(claimed, WAIT, "the probe's claim", interval=0.02)
        return seconds

    async def stop(self) -> float:
        """SIGTERM every worker; seconds until the last one exited."""
        sent = time.monotonic()
        for worker_id in self.workers:
            self.procs.signal(worker_id, signal.SIGTERM)
        for worker_id in self.workers:
            await self.procs.wait_exit(worker_id, WAIT)
        return time.monotonic() - sent

    def ended_lines(self) -> int:
        return sum(len(self.procs.events(w, "change stream ended")) for w in self.workers)


async def ends(r: Round, tasks: int) -> None:
    await r.publish("sleep", tasks, "t", seconds=0.1)
    expected, logged_at = 0, 0.0
    for end in range(1, r.args.ends + 1):
        await r.until_done(tasks * end // (r.args.ends + 1))
        await asyncio.sleep(max(0.0, logged_at + MIN_LIFE - time.monotonic()))  # see follow.MIN_LIFE
        expected += (await r.fault("endStreams"))["ended"]

        async def logged(n: int = expected) -> bool:
            return r.ended_lines() >= n

        await wait_until(logged, 60, "the workers to log the ends", interval=0.05)
        logged_at = time.monotonic()


async def stepdown(r: Round, tasks: int) -> None:
    await r.publish("sleep", tasks, "t", seconds=0.5)
    await r.until_done(tasks // 5)
    await r.fault("stepDown", seconds=r.args.stepdown)

    async def primary() -> bool:  # the stepdown ends by itself
        client: AsyncMongoClient[dict[str, Any]]
        async with AsyncMongoClient(r.uri) as client:
            hello = await client.admin.command("hello")
        return bool(hello.get("isWritablePrimary"))

    await wait_until(primary, r.args.stepdown + 60, "the stepdown to end", interval=0.05)


async def lose(r: Round, tasks: int) -> None:
    await r.fault("loseReplies", every=r.args.lose_every)
    try:
        await r.publish("noop", tasks, "t")
        await r.until_done(tasks, "noop")
    finally:
        await r.fault("off")


async def none(r: Round, tasks: int) -> None:
    await r.publish("sleep", tasks, "t", seconds=0.5)
    await r.until_done(tasks // 5)


FAULTS = {"ends": ends, "stepdown": stepdown, "lose": lose, "none": none}


async def one_round(scenario: str, tasks: int, args: argparse.Namespace) -> dict[str, Any]:
    with dev_server() as uri, Processes(uri, COLLECTION) as procs:
        runner = TaskRunner(uri, collection=COLLECTION)
        r = Round(uri, procs, runner, args)
        try:
            await runner.init()
            await r.start()
            await r.long_runs(args.long_seconds)
            await FAULTS[scenario](r, tasks)
            recovery = await r.probe()
            total = LONG + tasks + 1
            await r.until_done(total)
            exit_s = await r.stop()
            found = await runner.store.find()
        except Exception:
            for name in procs.names:
                print(f"--- {name}\n{procs.tail(name)}")
            raise
        finally:
            await runner.close()
    states = Counter(t.state for t in found)
    return {
        "success": states[TaskState.SUCCESS],
        "fail": states[TaskState.FAIL],
        "unfinished": sum(n for state, n in states.items() if not state.finished),
        "failures_counted": sum(t.failures for t in found),
        "claimed_twice": sum(t.attempts > 1 for t in found),
        "recovery_s": recovery,
        "exit_s": exit_s,
    }


def figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    counts = ("success", "fail", "unfinished", "failures_counted", "claimed_twice")
    recovery = [r["recovery_s"] for r in rounds]
    return {
        **{name: sum(r[name] for r in rounds) for name in counts},
        "recovery_s": [round(s, 3) for s in recovery],
        "recovery_median_s": round(statistics.median(recovery), 3),
        "exit_max_s": round(max(r["exit_s"] for r in rounds), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma list of ends,stepdown,lose,none"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tasks", default="240,500,120,500", help="backlog of ends,stepdown,lose,none")
    parser.add_argument("--ends", type=int, default=3, help="times the streams are ended")
    parser.add_argument("--stepdown", type=float, default=10.0, help="seconds")
    parser.add_argument("--lose-every", type=int, default=7)
    parser.add_argument("--long-seconds", type=float, default=20.0, help="the long tasks' sleep")
    add_common_args(parser)
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    backlog = dict(zip(SCENARIOS, map(int, args.tasks.split(",")), strict=True))
    if args.smoke:
        args.rounds, args.workers, args.ends, args.stepdown, args.long_seconds = 1, 2, 1, 2.0, 1.0
        backlog = dict.fromkeys(SCENARIOS, 12)
    for scenario in scenarios:
        rounds = [asyncio.run(one_round(scenario, backlog[scenario], args)) for _ in range(args.rounds)]
        config = {"scenario": scenario, "workers": args.workers, "tasks": backlog[scenario]}
        if scenario == "stepdown":
            config["seconds"] = args.stepdown
        elif scenario == "lose":
            config["every"] = args.lose_every
        emit(
            "faults",
            config,
            figures(rounds) | {"rounds": len(rounds)},
            results=args.results,
            smoke=args.smoke,
        )


if __name__ == "__main__":
    main()
