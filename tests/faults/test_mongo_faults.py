"""MongoDB's own faults under real ``taskrunner worker`` processes: change streams the server
ends mid-run, a primary stepdown, and write replies lost after the write was applied.

Each test runs 4 workers (default options, tests/apps/acceptance_app.py) on a private
``taskrunner dev-server`` process and sets one fault with the server's test-only
``taskrunnerFault`` command (docs/embedded-server.md). Tasks keep the default lease options
(``ping_timeout`` 30 s, longer than the 10 s stepdown), as a user's would. Each test then
holds the fault suite's promises:

* no task lost: every task ends SUCCESS;
* nothing run twice: one handler start mark per task;
* no failure budget spent by the fault: every task's ``failures`` is 0 and no entry FAIL;
* pickup back to normal within 5 s of the fault's end: a probe task published (with a
  higher priority than the backlog) as the fault ends is claimed within 5 s of its
  publication, both read in server time from its document (``created_at``, ``claimed_at``);
* ``taskrunner worker`` exits within 10 s of SIGTERM;
* one log line per outage: each warning or error event at most once per worker and
  outage (``lines_per_outage``), and no traceback or other line that is not a JSON event.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from workers import WorkerPool, WorkerProcess, dev_server, wait_exit

from taskrunner import EntryState, Task, TaskRunner, TaskState
from taskrunner.engine.follow import MIN_LIFE
from taskrunner.testing import wait_for

pytestmark = pytest.mark.embedded

WORKERS = ["w1", "w2", "w3", "w4"]
PROBE = "probe"
PICKUP = 5.0  # seconds after the fault's end within which a new task is claimed
SIGTERM_EXIT = 10.0  # seconds a worker may take to exit after SIGTERM
WAIT = 180.0  # bound for waits on a whole backlog; a busy host takes longer than a quiet one


@dataclass
class Fleet:
    """A private server, a publisher on it and 4 worker processes; ``hold`` starts long runs
    that stay in flight (leases renewed, outcomes unwritten) until ``release``."""

    uri: str
    runner: TaskRunner
    pool: WorkerPool
    workers: list[WorkerProcess]
    gate: Path

    async def fault(self, mode: str, **options: Any) -> dict[str, Any]:
        client: AsyncMongoClient[dict[str, Any]]
        async with AsyncMongoClient(self.uri) as client:
            reply: dict[str, Any] = await client.admin.command({"taskrunnerFault": mode, **options})
        return reply

    def starts(self) -> Counter[str]:
        return Counter(m["key"] for m in self.pool.marks(event="start"))

    async def until_started(self, n: int) -> None:
        await wait_for(lambda: len(self.starts()) >= n, WAIT, f"{n} tasks to start")

    def ends(self) -> int:
        """``change stream ended`` lines of every worker."""
        return sum(len(w.find("change stream ended")) for w in self.workers)

    async def until_ends(self, n: int) -> None:
        await wait_for(lambda: self.ends() >= n, 30, f"{n} change stream ended lines")

    async def succeeded(self, n: int) -> bool:
        return await self.runner.store.count(state=TaskState.SUCCESS) == n

    async def publish(self, keys: list[str], seconds: float) -> None:
        """A backlog of ``sleep`` tasks published at once (one bulk write)."""
        await self.runner.publish_many(
            [{"name": "sleep", "key": k, "params": {"seconds": seconds}} for k in keys]
        )

    async def hold(self, n: int) -> list[str]:
        """``n`` runs that wait for the gate (their leases renewed every 5 s meanwhile), started."""
        keys = keys_of("long", n)
        params = {"seconds": 0.1, "first_gate": str(self.gate)}
        await self.runner.publish_many([{"name": "sleep", "key": k, "params": params} for k in keys])
        await wait_for(lambda: all(self.starts()[k] for k in keys), 60, "the long runs to start")
        return keys

    def release(self) -> None:
        self.gate.touch()

    async def probe(self, key: str = PROBE) -> float:
        """Publish a task ahead of any backlog (priority 10) and return, in server time,
        the seconds from its publication to its claim."""
        await self.runner.publish("quick", key=key, priority=10)

        async def claimed() -> Task | None:
            task = await self.runner.get(key)
            return task if task.workers else None

        task = await wait_for(claimed, WAIT, f"{key} to be claimed", interval=0.05)
        return (task.workers[0].claimed_at - task.created_at).total_seconds()

    async def stop(self) -> list[float]:
        """SIGTERM every worker; the seconds each took to exit (each must exit 0)."""
        sent = time.monotonic()
        for worker in self.workers:
            worker.terminate()
        took = []
        for worker in self.workers:
            assert await wait_exit(worker, SIGTERM_EXIT + 20) == 0, worker.worker_id
            took.append(time.monotonic() - sent)
        return took


@pytest.fixture
async def fleet(collection_name: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    """4 ``taskrunner worker`` processes on a ``taskrunner dev-server`` of this test's own:
    the faults are server-wide, and a stepdown must not reach other tests."""
    counted = {"TASKRUNNER_COUNT_ROUNDTRIPS": "1"}  # each worker logs its commands as it stops
    with dev_server() as (_, uri), WorkerPool(uri, collection_name, tmp_path, env=counted) as pool:
        async with TaskRunner(uri, collection=collection_name) as runner:
            await runner.init()
            workers = pool.start_many(WORKERS)
            await wait_for(
                lambda: all(w.find("change stream opened") for w in workers), 60, "the workers' streams"
            )
            yield Fleet(uri, runner, pool, workers, tmp_path / "gate")


def noise(worker: WorkerProcess) -> Counter[str]:
    """The worker's warning and error lines by event (and stream: ``change stream ended
    (tasks)``); a line that is not a JSON event (a traceback, a print) counts under ``"<not an
    event>"``, one with a traceback under ``"<exception>"``."""
    counts: Counter[str] = Counter()
    for line in worker.logs():
        if line.get("event") is None:
            counts["<not an event>"] += 1
        elif "exception" in line:
            counts["<exception>"] += 1
        elif line.get("level") in ("warning", "error", "critical"):
            stream = f" ({line['stream']})" if "stream" in line else ""
            counts[f"{line['event']}{stream}"] += 1
    return counts


WRITES = ("insert", "update", "delete", "findAndModify")


def writes(worker: WorkerProcess) -> int:
    """The write commands the stopped worker sent (its ``round trips`` line), retries included."""
    [counts] = worker.find("round trips")
    return sum(counts["commands"].get(name, 0) for name in WRITES)


def lines_per_outage(fleet: Fleet, outages: int) -> dict[str, Counter[str]]:
    """Each worker's noise, once it is checked: no traceback, and each warning or error event
    (of each stream) at most once per outage."""
    noisy = {worker.worker_id: noise(worker) for worker in fleet.workers}
    for worker_id, counts in noisy.items():
        assert not counts["<not an event>"] and not counts["<exception>"], (worker_id, counts)
        assert all(n <= outages for n in counts.values()), (worker_id, counts)
    return noisy


async def no_budget_spent(fleet: Fleet, keys: list[str]) -> None:
    """Every task SUCCESS, started once, no failure counted and no FAIL entry."""
    tasks = await fleet.runner.store.find()
    assert sorted(t.key for t in tasks) == sorted(keys)
    assert [t.key for t in tasks if t.state is not TaskState.SUCCESS] == []
    assert fleet.starts() == Counter(keys), {k: n for k, n in fleet.starts().items() if n != 1}
    assert [(t.key, t.failures) for t in tasks if t.failures] == []
    failed = [(t.key, e.error) for t in tasks for e in t.workers if e.state is EntryState.FAIL]
    assert failed == []


async def reached(moment: float) -> None:
    """Until the monotonic clock reaches ``moment``."""
    await wait_for(lambda: time.monotonic() >= moment, max(0.0, moment - time.monotonic()) + 5, "the moment")


def keys_of(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


# -- streams closed mid-run ---------------------------------------------------------------------------
STREAMS = ("tasks", "limits")
ENDS = 3


@pytest.mark.timeout(600)  # bounded by the waits inside, which leave a busy host room
async def test_streams_ended_mid_run_lose_nothing_and_log_once_per_end(fleet: Fleet) -> None:
    """The server ends every change stream 3 times while 4 workers run a backlog of 240
    short tasks and 4 long runs: every task once and SUCCESS, no budget spent, a probe
    claimed within 5 s of the last end, one ``change stream ended`` per end and stream
    (no worker gives up on its streams), exit within 10 s of SIGTERM."""
    long, short = await fleet.hold(4), keys_of("short", 240)
    await fleet.publish(short, 0.1)
    ended, logged_at = 0, 0.0
    for end in range(1, ENDS + 1):
        await fleet.until_started(len(long) + len(short) * end // (ENDS + 1))
        # The rule under test is about time: a reopened stream that lived MIN_LIFE is ended
        # again, not given up on (one ending sooner cannot be followed: the worker polls).
        await reached(logged_at + MIN_LIFE)
        reply = await fleet.fault("endStreams")
        assert reply["ended"] >= len(WORKERS), reply  # every worker's task stream at least
        ended += reply["ended"]
        await fleet.until_ends(ended)
        logged_at = time.monotonic()
    pickup = await fleet.probe()
    fleet.release()
    await wait_for(lambda: fleet.succeeded(len(long) + len(short) + 1), WAIT, "every task to succeed")
    exits = await fleet.stop()

    print(f"probe claimed {pickup:.2f}s after its publication; exits after SIGTERM {exits}")
    await no_budget_spent(fleet, [*long, *short, PROBE])
    assert pickup <= PICKUP
    assert max(exits) <= SIGTERM_EXIT
    assert fleet.ends() == ended  # one line per stream ended
    noisy = lines_per_outage(fleet, ENDS)
    ends = {f"change stream ended ({stream})" for stream in STREAMS}
    assert all(set(counts) <= ends for counts in noisy.values()), noisy


# -- a stepdown ----------------------------------------------------------------------------------------
STEPDOWN = 10


async def primary(uri: str) -> bool:
    client: AsyncMongoClient[dict[str, Any]]
    async with AsyncMongoClient(uri) as client:
        hello = await client.admin.command("hello")
    return bool(hello.get("isWritablePrimary"))


@pytest.mark.timeout(600)
async def test_a_stepdown_loses_nothing_and_pickup_resumes_at_once(fleet: Fleet) -> None:
    """A 10 s stepdown while 4 workers run 500 tasks of 0.5 s and 4 long runs (claims,
    lease renewals and outcome writes refused meanwhile, streams interrupted): every task
    once and SUCCESS, no budget spent, a probe published once the server is primary again
    claimed within 5 s, one line per outage and component, exit within 10 s of SIGTERM."""
    long, short = await fleet.hold(4), keys_of("t", 500)
    await fleet.publish(short, 0.5)
    await fleet.until_started(len(long) + 100)
    await fleet.fault("stepDown", seconds=STEPDOWN)
    down, down_at = time.monotonic(), time.time()
    await wait_for(lambda: primary(fleet.uri), STEPDOWN + 30, "the stepdown to end", interval=0.05)
    lasted = time.monotonic() - down
    pickup = await fleet.probe()
    fleet.release()
    await wait_for(lambda: fleet.succeeded(len(long) + len(short) + 1), WAIT, "every task to succeed")
    exits = await fleet.stop()

    marks = fleet.pool.marks()
    started = {m["key"]: m["t"] for m in marks if m["event"] == "start"}
    in_flight = [m["key"] for m in marks if m["event"] == "finish" and started[m["key"]] < down_at < m["t"]]
    print(
        f"stepdown {lasted:.1f}s with {len(in_flight)} runs in flight; probe claimed {pickup:.2f}s "
        f"after; exits after SIGTERM {exits}; noise {[noise(w) for w in fleet.workers]}"
    )
    await no_budget_spent(fleet, [*long, *short, PROBE])
    assert set(long) <= set(in_flight)
    assert pickup <= PICKUP
    assert max(exits) <= SIGTERM_EXIT
    noisy = lines_per_outage(fleet, 1)
    # Each worker holding a long run had its renewals refused (one every 5 s) and said so once.
    holders = {m["worker_id"] for m in marks if m["event"] == "start" and m["key"] in long}
    assert all(noisy[w]["ping failed; retrying"] == 1 for w in holders), noisy


# -- lost replies --------------------------------------------------------------------------------------
LOSE_EVERY = 7
PUBLISHES = 4  # the test's own writes while replies are lost: one bulk write and its retries


@pytest.mark.timeout(600)
async def test_every_seventh_write_reply_lost_loses_nothing(fleet: Fleet) -> None:
    """Every 7th write's reply lost (the write applied) while 4 workers run 120 short tasks
    and 4 long runs: every task once and SUCCESS, no budget spent (no claim orphaned to
    expire), a probe published after the fault claimed within 5 s, exit within 10 s of
    SIGTERM, at most one line per reply lost and no traceback."""
    long, short = await fleet.hold(4), keys_of("short", 120)
    await fleet.fault("loseReplies", every=LOSE_EVERY)
    try:
        await fleet.publish(short, 0)
        await wait_for(lambda: fleet.succeeded(len(short)), WAIT, "the short tasks to succeed")
    finally:
        await fleet.fault("off")
    pickup = await fleet.probe()
    fleet.release()
    await wait_for(lambda: fleet.succeeded(len(long) + len(short) + 1), WAIT, "every task to succeed")
    exits = await fleet.stop()

    noisy = {w.worker_id: noise(w) for w in fleet.workers}
    sent = sum(writes(w) for w in fleet.workers) + PUBLISHES
    lines = sum(n for counts in noisy.values() for n in counts.values())
    print(f"probe claimed {pickup:.2f}s after; exits after SIGTERM {exits}; {sent} writes; noise {noisy}")
    await no_budget_spent(fleet, [*long, *short, PROBE])
    assert pickup <= PICKUP
    assert max(exits) <= SIGTERM_EXIT
    for worker_id, counts in noisy.items():
        assert not counts["<not an event>"] and not counts["<exception>"], (worker_id, counts)
    assert lines <= sent // LOSE_EVERY, noisy  # at most one line per reply lost
