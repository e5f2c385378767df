"""Fleet-wide limits: whether a backlog uses the limit, how exact it is, what it costs.

W ``taskrunner worker`` processes (default 4, counting their round trips) on one dev
server, each case with fresh workers on a fresh collection, all in one run:

* ``rate`` (each of ``--rates``): N no-op tasks published at once under ``taskrunner limit
  noop --rate R``. The achieved rate, as starts per period over the whole backlog
  (starts / (last - first + period)) and while tasks waited (R periods over the mean time
  from each start to the R-th after it: each lane's time to start again; a lane that idles
  while tasks wait shows there), and the most starts any window of the period holds (the
  promise: never more than R).
* ``unlimited``: the same tasks, no limit: what the fleet and the server sustain. A limit
  above it cannot be reached, so only limits below it say anything about the limits.
* ``live``: N tasks under ``--live`` FROM, changed to TO once a third have finished. The
  rate while tasks waited before the change, against FROM, and from a second after it
  (workers apply a change within a second), against TO, and the most starts in a window
  from then.
* ``capped``: K tasks sleeping ``--hold`` seconds under ``--max-running M``. Seconds from
  the first claim to the last finish against the ideal K * hold / M, the most runs at
  once (never more than M), slot reuse (each claim past the first M against the finish
  it follows, first come first served: p50 and max) and the longest time fewer than M ran
  while tasks waited; ``uncapped``: the same tasks without a limit.

Starts, finishes and windows are the task documents' server times (``claimed_at``,
``finished_at``); commands are every command of every worker, start to stop, per task
(and per job). The machine's other load moves every figure: run it on a quiet machine,
and with ``--hog`` (both cores kept busy) to see a loaded one.

    uv run python bench/ratelimit.py [--workers 4] [--tasks 100] [--rates 5/s,10/s]
                                     [--live 5/s,2/s] [--max-running 2] [--held-tasks 20]
                                     [--hold 0.5] [--hog] [--settle 3] [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from common import add_common_args, emit
from processes import Processes, dev_server, stop_and_count, wait_until
from versus import cpu_hog

from taskrunner import NoLiveWorkerWarning, Task, TaskRunner, TaskState
from taskrunner.limits.gates import parse_rate

Midway = Callable[[TaskRunner], Awaitable[None]]


async def run_once(
    uri: str,
    collection: str,
    args: argparse.Namespace,
    limit: dict[str, Any],
    *,
    held: bool = False,
    tasks: int | None = None,
    midway: Midway | None = None,
) -> dict[str, Any]:
    """Run the tasks on ``args.workers`` processes with ``limit`` set on their name;
    ``midway`` runs once a third of them have started (a live change)."""
    name = "sleep" if held else "noop"
    params = {"seconds": args.hold} if held else {}
    count = tasks if tasks is not None else args.held_tasks if held else args.tasks
    with Processes(uri, collection) as procs:
        async with TaskRunner(uri, collection=collection) as runner:
            await runner.init()
            if limit:
                with warnings.catch_warnings():  # set before its workers start, on purpose
                    warnings.simplefilter("ignore", NoLiveWorkerWarning)
                    await runner.set_limits(name, **limit)
            names = [f"w{i}" for i in range(args.workers)]
            for worker in names:
                procs.worker(worker, env={"TASKRUNNER_COUNT_ROUNDTRIPS": "1"})

            async def registered() -> bool:
                return len(await runner.workers()) >= args.workers

            await wait_until(registered, 120, f"{args.workers} workers to register", interval=0.1)
            await asyncio.sleep(args.settle)  # every worker has read the registry and its limits
            started = time.monotonic()
            for first in range(0, count, 100):  # small chunks: a big write into a busy dev server stalls it
                batch = range(first, min(first + 100, count))
                await runner.publish_many([{"name": name, "key": f"t{i}", "params": params} for i in batch])
            changed = None
            if midway is not None:

                async def a_third() -> bool:
                    return await runner.store.count(state=TaskState.SUCCESS) >= count // 3

                await wait_until(a_third, 900, "a third of the tasks", interval=0.05)
                await midway(runner)
                stored = (await runner.limits(name)).stored
                changed = stored.updated_at.timestamp() if stored and stored.updated_at else None

            async def done() -> bool:
                return await runner.store.count(state=TaskState.SUCCESS) >= count

            await wait_until(done, 900, f"{count} tasks", interval=0.2)
            elapsed = time.monotonic() - started
            found = await runner.list_tasks(name=name, limit=count + 10)
            commands, jobs = await stop_and_count(procs, names)
            gates = Counter[str]()
            for worker in names:
                for event in procs.events(worker, "gate round trips"):
                    gates.update({k: v for k, v in event.items() if isinstance(v, int)})
    return {
        "tasks": found,
        "count": count,
        "commands": sum(commands.values()),
        "jobs": dict(jobs),
        "gates": dict(gates),
        "seconds": round(elapsed, 2),
        "changed": changed,
    }


def starts_of(tasks: list[Task]) -> list[float]:
    return sorted(e.claimed_at.timestamp() for t in tasks for e in t.workers)


def most_in_window(starts: list[float], period: float) -> int:
    """The most starts any half-open window ``[t, t + period)`` holds (t at each start)."""
    return max((bisect.bisect_left(starts, s + period) - i for i, s in enumerate(starts)), default=0)


def per_period(starts: list[float], period: float) -> float:
    """Starts per period over the whole backlog."""
    return len(starts) / (starts[-1] - starts[0] + period) * period


def waiting_rate(starts: list[float], limit: int, period: float) -> float | None:
    """Starts per period while tasks waited: ``limit`` periods over the mean time from
    each start to the ``limit``-th after it (each lane's time to start again; free of
    where a window falls, so a burst of starts at each period's turn reads right). None
    with too few starts."""
    spans = [later - first for first, later in zip(starts, starts[limit:], strict=False)]
    return limit * period / statistics.mean(spans) if spans and statistics.mean(spans) > 0 else None


def _share(value: float | None, limit: int) -> float | None:
    return round(value / limit, 3) if value is not None else None


def slowest_period(starts: list[float], period: float) -> int:
    """The fewest starts in a window ``[t, t + period)`` that ends by the last start
    (t at each start past the first period): a lane that idled while tasks waited."""
    ends = [s for s in starts if starts[0] + period <= s and s + period <= starts[-1]]
    return min(
        (bisect.bisect_left(starts, s + period) - bisect.bisect_left(starts, s) for s in ends), default=0
    )


def spans(tasks: list[Task]) -> list[tuple[float, float]]:
    return sorted(
        (e.claimed_at.timestamp(), e.finished_at.timestamp())
        for t in tasks
        for e in t.workers
        if e.finished_at
    )


def most_at_once(runs: list[tuple[float, float]]) -> int:
    edges = sorted((t, step) for s, e in runs for t, step in ((s, 1), (e, -1)))
    running = best = 0
    for _, step in edges:
        running += step
        best = max(best, running)
    return best


def slot_reuse(runs: list[tuple[float, float]], cap: int) -> list[float]:
    """Seconds from each finish to the claim that took its slot, first come first served:
    the claims past the first ``cap`` in order, against the finishes in order."""
    claims, finishes = sorted(s for s, _ in runs), sorted(e for _, e in runs)
    return [claim - finish for claim, finish in zip(claims[cap:], finishes, strict=False)]


def longest_short(runs: list[tuple[float, float]], cap: int) -> float:
    """The longest time fewer than ``cap`` runs went on between the first claim and the
    last (tasks waited all that time)."""
    last = max(s for s, _ in runs)
    edges = sorted((t, step) for s, e in runs for t, step in ((s, 1), (e, -1)) if t <= last)
    running, since, longest = 0, None, 0.0
    for t, step in edges:
        running += step
        if running < cap and since is None:
            since = t
        elif running >= cap and since is not None:
            longest, since = max(longest, t - since), None
    return round(longest, 3)


def _per_task(jobs: dict[str, int], tasks: int) -> dict[str, float]:
    return {job: round(count / tasks, 3) for job, count in sorted(jobs.items())}


def _task_bound(jobs: dict[str, int]) -> int:
    return sum(jobs.get(job, 0) for job in ("claim", "run_writes", "gates"))


def rate_figures(run: dict[str, Any], text: str) -> dict[str, Any]:
    rate = parse_rate(text)
    starts = starts_of(run["tasks"])
    achieved, waiting = per_period(starts, rate.period), waiting_rate(starts, rate.limit, rate.period)
    return {
        "limit": rate.limit,
        "achieved_per_period": round(achieved, 2),
        "achieved_share": round(achieved / rate.limit, 3),
        "waiting_per_period": round(waiting, 2) if waiting is not None else None,
        "waiting_share": _share(waiting, rate.limit),
        "slowest_period": slowest_period(starts, rate.period),
        "max_starts_per_window": most_in_window(starts, rate.period),
        "commands_per_task": round(run["commands"] / run["count"], 2),
        "gate_commands_per_task": round(run["jobs"].get("gates", 0) / run["count"], 3),
        "gate_counts": run["gates"],
        "seconds": run["seconds"],
    }


def live_figures(run: dict[str, Any], before: str, after: str) -> dict[str, Any]:
    old, new = parse_rate(before), parse_rate(after)
    starts = starts_of(run["tasks"])
    since = (run["changed"] or starts[0]) + 1.0  # workers apply a change within a second
    early = [s for s in starts if s < (run["changed"] or starts[0])]
    late = [s for s in starts if s >= since]
    before, after = waiting_rate(early, old.limit, old.period), waiting_rate(late, new.limit, new.period)
    return {
        "from": old.limit,
        "to": new.limit,
        "before_change_per_period": round(before, 2) if before is not None else None,
        "before_change_share": _share(before, old.limit),
        "after_change_per_period": round(after, 2) if after is not None else None,
        "after_change_share": _share(after, new.limit),
        "starts_after_change": len(late),
        "max_starts_per_window_after_change": most_in_window(late, new.period),
        "seconds": run["seconds"],
    }


def capped_figures(
    capped: dict[str, Any], uncapped: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    runs = spans(capped["tasks"])
    reuse = slot_reuse(runs, args.max_running)
    busy = max(e for _, e in runs) - min(s for s, _ in runs)
    ideal = args.held_tasks * args.hold / args.max_running
    free = spans(uncapped["tasks"])
    return {
        "max_running": args.max_running,
        "seconds_first_claim_to_last_finish": round(busy, 2),
        "ideal_seconds": round(ideal, 2),
        "over_ideal": round(busy / ideal, 3),
        "most_running_at_once": most_at_once(runs),
        "slot_reuse_p50_ms": round(1000 * statistics.median(reuse), 1) if reuse else None,
        "slot_reuse_max_ms": round(1000 * max(reuse), 1) if reuse else None,
        "longest_below_cap_s": longest_short(runs, args.max_running),
        "commands_per_task": round(capped["commands"] / capped["count"], 2),
        "uncapped_seconds_first_claim_to_last_finish": round(
            max(e for _, e in free) - min(s for s, _ in free), 2
        ),
        "uncapped_most_running_at_once": most_at_once(free),
        "uncapped_commands_per_task": round(uncapped["commands"] / uncapped["count"], 2),
    }


async def measure(uri: str, args: argparse.Namespace, run: int) -> dict[str, Any]:
    with cpu_hog(args.hog):
        limited = {
            text: await run_once(uri, f"rl_{run}_rate{i}", args, {"rate_limit": text})
            for i, text in enumerate(args.rates)
        }
        free = await run_once(uri, f"rl_{run}_free", args, {})
        before, after = args.live

        async def change(runner: TaskRunner) -> None:
            await runner.set_limits("noop", rate_limit=after)

        live = await run_once(
            uri, f"rl_{run}_live", args, {"rate_limit": before}, tasks=args.live_tasks, midway=change
        )
        capped = await run_once(uri, f"rl_{run}_capped", args, {"max_running": args.max_running}, held=True)
        uncapped = await run_once(uri, f"rl_{run}_held", args, {}, held=True)
    free_starts = starts_of(free["tasks"])
    first = limited[args.rates[0]]
    return {
        "rates": {text: rate_figures(limited[text], text) for text in args.rates},
        "unlimited_per_s": round(per_period(free_starts, 1.0), 2),
        "unlimited_seconds": free["seconds"],
        "unlimited_commands_per_task": round(free["commands"] / free["count"], 2),
        # Commands that scale with tasks (claims, outcome writes, gate writes, renewals
        # included), free of the heartbeats and waits a longer run adds.
        "task_commands_ratio": round(_task_bound(first["jobs"]) / _task_bound(free["jobs"]), 3),
        "live": live_figures(live, before, after),
        "capped": capped_figures(capped, uncapped, args),
        # Per job (claim, run_writes, gates scale with tasks; registry, limits, clock and
        # discovery's waits with time and workers), to tell the limit's cost from a longer run.
        "jobs_per_task": {
            "limited": _per_task(first["jobs"], first["count"]),
            "unlimited": _per_task(free["jobs"], free["count"]),
            "capped": _per_task(capped["jobs"], capped["count"]),
            "uncapped": _per_task(uncapped["jobs"], uncapped["count"]),
        },
    }


async def main(args: argparse.Namespace) -> None:
    with dev_server() as uri:
        for run in range(args.rounds):
            figures = await measure(uri, args, run)
            config = {
                "workers": args.workers,
                "tasks": args.tasks,
                "rates": args.rates,
                "live": args.live,
                "live_tasks": args.live_tasks,
                "hog": args.hog,
                "max_running": args.max_running,
                "held_tasks": args.held_tasks,
                "hold": args.hold,
            }
            emit("ratelimit", config, figures, results=args.results, smoke=args.smoke)


def _rates(text: str) -> list[str]:
    rates = [part.strip() for part in text.split(",") if part.strip()]
    for rate in rates:
        parse_rate(rate)
    return rates


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--tasks", type=int, default=100, help="tasks of each rate case and the unlimited one"
    )
    parser.add_argument("--rates", type=_rates, default=["5/s", "10/s"], help="comma list, e.g. 5/s,10/s")
    parser.add_argument("--live", type=_rates, default=["5/s", "2/s"], help="FROM,TO of the live change")
    parser.add_argument("--live-tasks", type=int, default=60)
    parser.add_argument("--max-running", type=int, default=2)
    parser.add_argument("--held-tasks", type=int, default=20, help="tasks of the max_running case")
    parser.add_argument("--hold", type=float, default=0.5, help="seconds each max_running task sleeps")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hog", action="store_true", help="keep both cores busy during every run")
    parser.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds the workers get to see each other before publishing",
    )
    add_common_args(parser)
    args = parser.parse_args()
    if len(args.live) != 2:
        parser.error("--live takes two rates, FROM,TO")
    if args.smoke:
        args.workers, args.tasks, args.rates, args.live_tasks, args.held_tasks = 2, 20, ["10/s"], 12, 6
        args.live, args.hold, args.settle = ["4/s", "2/s"], 0.1, 1.0
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
