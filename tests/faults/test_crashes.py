"""Crashes and poison: real ``taskrunner worker`` processes killed, stalled, skewed or crashed by their tasks.

Workers run tests/apps/faults_app.py (tests/workers.py starts them). Leases are short
(ping_interval 0.3 s, ping_timeout 1.5 s) so lost runs come back quickly; bounds on
anything timed are generous because the host's two cores are shared.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from bson import Int64
from pymongo import AsyncMongoClient
from pymongo.errors import WriteError
from workers import ChangeRecorder, WorkerPool, WorkerProcess

from taskrunner import (
    EntryState,
    InvalidTask,
    NewTask,
    Task,
    TaskContext,
    TaskOptionsDict,
    TaskRunner,
    TaskSpec,
    TaskState,
)
from taskrunner.dev.server import EmbeddedServer
from taskrunner.engine.worker import Worker
from taskrunner.store.memory import MemoryStore
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

Doc = dict[str, Any]
FAULTS_APP = "apps.faults_app:runner"
PING_INTERVAL, PING_TIMEOUT = 0.3, 1.5
LEASE: TaskOptionsDict = {"ping_interval": PING_INTERVAL, "ping_timeout": PING_TIMEOUT, "retry_backoff": 0}
# Workers that sweep only every minute: what must happen promptly cannot come from a sweep,
# so bounds on "promptly" can leave a busy host SLACK seconds.
NO_SWEEPS = ("--poll-interval", "60")
SLACK = 20.0


@pytest.fixture
async def own_server(embedded_uri: str) -> AsyncIterator[EmbeddedServer]:
    """A private embedded server (on this test's loop) whose change streams a test may break.

    Its tests stay on the embedded server with TASKRUNNER_TEST_MONGO_URI too: they reach into the
    server to kill the worker's change-stream cursor, or keep only 20 events of change history,
    which a real MongoDB does not let a client do.
    """
    async with EmbeddedServer(history_size=20) as server:
        yield server


async def succeeded(runner: TaskRunner, n: int) -> bool:
    return await runner.store.count(state=TaskState.SUCCESS) == n


async def started(*workers: WorkerProcess) -> None:
    await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")


def by_run(marks: list[Doc]) -> dict[str, list[Doc]]:
    runs: dict[str, list[Doc]] = defaultdict(list)
    for m in marks:
        runs[m["run_id"]].append(m)
    return runs


# -- crashes --------------------------------------------------------------------------------------
@pytest.mark.timeout(600)  # bounded by the waits inside, which leave a busy host room
async def test_random_sigkills_lose_no_task_and_record_each_success_once(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """240 tasks, 3 workers x 4 slots, a random busy worker SIGKILLed (and replaced) every 1-2 s, 6 times.

    Every task ends SUCCESS with exactly one SUCCESS entry and one recorded completion;
    runs are executed again only when their lease was lost: their worker was killed, or
    (rarely, on a loaded host) a live worker's writes missed the 1.5 s lease, in which case
    that worker logged the loss and wrote nothing. Lost leases are at most kills x slots
    plus those live losses.
    """
    rng = random.Random(20261122)
    slots, kills, n = 4, 6, 240
    keys = [f"c-{i:03d}" for i in range(n)]
    ids = (f"c{i}" for i in itertools.count())
    killed: dict[str, float] = {}  # worker id -> wall time of its SIGKILL

    async def victims(live: list[WorkerProcess]) -> list[WorkerProcess] | bool:
        return _busy(pool.marks(), live) or await succeeded(runner, n)

    with WorkerPool(mongo_uri, collection_name, tmp_path, app=FAULTS_APP) as pool:
        live = [pool.start(next(ids), "--concurrency", str(slots), "--log-level", "debug") for _ in range(3)]
        await started(*live)
        await runner.publish_many(
            [
                {
                    "name": "nap",
                    "key": k,
                    "params": {"seconds": rng.uniform(0.3, 0.9)},
                    "max_failures": 10,
                    **LEASE,
                }
                for k in keys
            ]
        )
        for _ in range(kills):
            await asyncio.sleep(rng.uniform(1.0, 2.0))
            # A victim in the middle of a run, however slowly a busy host starts replacements.
            busy = await wait_for(lambda: victims(live), 60, "a worker with a run in progress")
            if not isinstance(busy, list):
                break  # every task is done already
            victim = rng.choice(busy)
            victim.kill()
            killed[victim.worker_id] = time.time()
            live.remove(victim)
            live.append(pool.start(next(ids), "--concurrency", str(slots), "--log-level", "debug"))
        await wait_for(lambda: succeeded(runner, n), 300, f"{n} successes", interval=0.5)
        # A duplicate run would have left a start mark; every run a live worker started must end.
        await wait_for(lambda: _settled(pool.marks(), killed), 60, "live workers' runs to end")
        marks = pool.marks()
        assert all(w.alive() for w in live)
        logs = {w.worker_id: w.logs() for w in pool.workers}
    tasks = {k: await runner.get(k) for k in keys}
    starts = {k: by_run([m for m in marks if m["key"] == k and m["event"] == "start"]) for k in keys}
    finishes = by_run([m for m in marks if m["event"] == "finish"])

    def gave_up(worker_id: str, run_id: str) -> bool:
        """The live worker noticed it lost the run's lease and wrote no outcome."""
        events = {e.get("event") for e in logs[worker_id] if e.get("run_id") == run_id}
        return bool(events & LOST_EVENTS) and not events & {"run succeeded", "run failed"}

    reexecuted, delays, live_losses = [], [], []
    for key, task in tasks.items():
        assert task.state is TaskState.SUCCESS
        [entry] = task.workers  # every expired lease was dropped by the claim that took over
        assert entry.state is EntryState.SUCCESS
        # The recorded run started and finished exactly once.
        assert len(starts[key].get(entry.run_id, [])) == 1 and len(finishes[entry.run_id]) == 1
        # Every other run of the task lost its lease: a killed worker, or a live one that gave up.
        others = [run[0] for run_id, run in starts[key].items() if run_id != entry.run_id]
        for m in others:
            if m["worker_id"] not in killed:
                assert gave_up(m["worker_id"], m["run_id"]), (key, m)
                live_losses.append(m["worker_id"])
        # A lost lease is the only failure here; the claim that dropped it names its worker.
        assert set(entry.took_over) <= set(killed) | set(live_losses)
        assert (task.failures > 0) == bool(entry.took_over) and task.failures >= len(others)
        assert task.attempts == task.failures + 1
        if others:
            reexecuted.append(key)
            last = max(others, key=lambda m: m["t"])
            if last["worker_id"] in killed:
                delays.append(starts[key][entry.run_id][0]["t"] - killed[last["worker_id"]])
    lost_leases = sum(t.failures for t in tasks.values())
    print(
        f"{kills} kills; {lost_leases} lost leases ({len(live_losses)} of live workers); {len(reexecuted)} tasks "
        f"re-executed; takeover after kill: min {min(delays, default=0):.2f}s max {max(delays, default=0):.2f}s"
    )
    assert 1 <= lost_leases <= kills * slots + len(live_losses)
    assert len(reexecuted) <= lost_leases
    # Takeovers happened, each after its kill. How long after depends on the lease and on how
    # busy the host is, so no upper bound here: the stall test checks the timing exactly.
    assert any(set(t.workers[0].took_over) & set(killed) for t in tasks.values())
    assert all(d > 0 for d in delays), delays


def _busy(marks: list[Doc], workers: list[WorkerProcess]) -> list[WorkerProcess]:
    """The workers with a run they started and have not ended."""
    ended = {m["run_id"] for m in marks if m["event"] in ("finish", "cancelled")}
    running = {m["worker_id"] for m in marks if m["event"] == "start" and m["run_id"] not in ended}
    return [w for w in workers if w.worker_id in running]


def _settled(marks: list[Doc], killed: dict[str, float]) -> bool:
    """Every run a live worker started has finished or been cancelled."""
    ended = {m["run_id"] for m in marks if m["event"] in ("finish", "cancelled")}
    return all(m["run_id"] in ended for m in marks if m["event"] == "start" and m["worker_id"] not in killed)


LOST_EVENTS = {
    "stopping run",
    "claim lost before the outcome was written; nothing written",
    "could not write the run's outcome",
    "run abandoned: another worker may own it",
}


async def test_stalled_worker_is_taken_over_and_its_late_writes_are_rejected(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """SIGSTOP past ping_timeout: the task is taken over; on SIGCONT the old run stops at once, writing nothing."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=FAULTS_APP) as pool:
        workers = {w.worker_id: w for w in pool.start_many(["s1", "s2"], *NO_SWEEPS)}
        await started(*workers.values())
        async with ChangeRecorder(mongo_uri, collection_name) as changes:
            await runner.publish("nap", {"seconds": 1.0, "first_seconds": 60}, key="stall", **LEASE)
            old = await wait_for(lambda: _running(runner, "stall"), 30, "a first claim")
            stalled = workers.pop(old.worker_id)
            [owner] = workers.values()
            await wait_for(lambda: _pinged(runner, "stall", old.run_id), 10, "a ping")
            stalled.pause()
            new = await wait_for(lambda: _running(runner, "stall", stalled.worker_id), 30, "the takeover")
            resumed_at = time.time()
            stalled.resume()  # while the new owner's handler still runs
            [stop] = await wait_for(
                lambda: stalled.find("stopping run", key="stall"), 15, "the old run to stop"
            )
            [done] = await wait_for(lambda: _finished(runner, "stall"), 30, "the new owner to finish")
            await wait_for(
                lambda: pool.marks(run_id=old.run_id, event="cancelled"), 10, "the old handler's cancel"
            )
            await asyncio.sleep(0.5)  # a late write of the old run would show in the changes by now
        assert stalled.alive() and owner.alive()
    stopped_after = datetime.fromisoformat(stop["timestamp"]).timestamp() - resumed_at
    versions = [doc for _, doc in changes.of("stall")]
    first_new = next(i for i, doc in enumerate(versions) if _has_run(doc, new.run_id))
    last_old_ping = max(
        (w["ping_at"] for doc in versions for w in doc["workers"] if w["run_id"] == old.run_id), default=None
    )
    assert last_old_ping is not None
    takeover = (new.claimed_at - last_old_ping).total_seconds()
    print(
        f"takeover {takeover:.2f}s after the stalled run's last ping; old run stopped {stopped_after:.2f}s after SIGCONT"
    )
    # At the lease's end, not earlier; "later" is bounded generously, yet far below a sweep.
    assert PING_TIMEOUT - 0.01 <= takeover <= PING_TIMEOUT + SLACK
    assert stop["reason"] in ("claim lost", "lease unconfirmed for ping_timeout")
    assert 0 <= stopped_after <= SLACK  # not when its 60 s handler would have ended
    # Nothing the stalled run did after the takeover reached the document.
    assert not any(_has_run(doc, old.run_id) for doc in versions[first_new:])
    assert not stalled.find("run succeeded", key="stall") and not stalled.find("run failed", key="stall")
    assert not pool.marks(run_id=old.run_id, event="finish")
    assert done.state is TaskState.SUCCESS and (done.failures, done.attempts) == (1, 2)
    [entry] = done.workers
    assert (entry.run_id, entry.worker_id, entry.took_over) == (
        new.run_id,
        owner.worker_id,
        [stalled.worker_id],
    )


async def _running(runner: TaskRunner, key: str, not_worker: str | None = None) -> Any:
    task = await runner.get(key)
    return next(
        (w for w in task.workers if w.state is EntryState.RUNNING and w.worker_id != not_worker), None
    )


async def _pinged(runner: TaskRunner, key: str, run_id: str) -> bool:
    entry = (await runner.get(key)).entry(run_id)
    return entry is not None and entry.ping_at > entry.claimed_at


async def _finished(runner: TaskRunner, *keys: str) -> list[Task] | None:
    tasks = [await runner.get(key) for key in keys]
    return tasks if all(t.state.finished for t in tasks) else None


def _has_run(doc: Doc, run_id: str) -> bool:
    return any(w.get("run_id") == run_id for w in doc.get("workers", []))


# -- change streams ---------------------------------------------------------------------------
async def test_killed_change_stream_cursor_strands_no_task(
    own_server: EmbeddedServer, collection_name: str, tmp_path: Path
) -> None:
    """killCursors on the worker's change stream mid-run: tasks published afterwards still run promptly."""
    streams = own_server._streams
    assert streams is not None
    async with TaskRunner(own_server.uri, collection=collection_name) as runner:
        await runner.init()
        with WorkerPool(own_server.uri, collection_name, tmp_path, app=FAULTS_APP) as pool:
            [worker] = pool.start_many(["cs1"], "--concurrency", "4", *NO_SWEEPS)
            await started(worker)
            before: list[TaskSpec] = [
                {"name": "nap", "key": f"before-{i}", "params": {"seconds": 0.5}} for i in range(4)
            ]
            await runner.publish_many(before)
            await wait_for(lambda: pool.marks(event="start"), 30, "a run to start")
            cursors = set(streams._cursors)
            assert cursors, "the worker has a change stream open"
            client: AsyncMongoClient[Doc] = AsyncMongoClient(own_server.uri)
            try:
                reply = await client["taskrunner"].command(
                    "killCursors", collection_name, cursors=[Int64(c) for c in cursors]
                )
            finally:
                await client.close()
            assert sorted(reply["cursorsKilled"]) == sorted(cursors)
            await wait_for(lambda: set(streams._cursors) - cursors, 30, "the worker to open a new stream")
            after = [f"after-{i}" for i in range(6)]
            await runner.publish_many([{"name": "nap", "key": k, "params": {"seconds": 0.1}} for k in after])
            await wait_for(lambda: succeeded(runner, 10), 30, "10 successes", interval=0.2)
            assert worker.alive()
            reopened = set(streams._cursors) - cursors
        pickups = [
            (t.workers[0].claimed_at - t.created_at).total_seconds()
            for t in [await runner.get(k) for k in after]
        ]
    print(f"after the cursor kill: pickup max {max(pickups):.2f}s")
    assert reopened, "the worker opened a new change stream"
    assert max(pickups) < SLACK  # found through the reopened stream, not a sweep (60 s apart)


async def test_lost_change_history_leads_to_a_sweep_and_strands_nothing(
    own_server: EmbeddedServer, collection_name: str, tmp_path: Path
) -> None:
    """A stalled worker's stream falls out of a 20-event history: it sweeps and runs all 60 tasks."""
    async with TaskRunner(own_server.uri, collection=collection_name) as runner:
        await runner.init()
        with WorkerPool(own_server.uri, collection_name, tmp_path, app=FAULTS_APP) as pool:
            [worker] = pool.start_many(["h1"], "--concurrency", "8")
            await started(worker)
            await runner.publish("nap", {"seconds": 0.05}, key="warm-up")
            await wait_for(lambda: succeeded(runner, 1), 30, "the warm-up task")
            worker.pause()
            await runner.publish_many(
                [{"name": "nap", "key": f"gap-{i:02d}", "params": {"seconds": 0.05}} for i in range(60)]
            )
            await asyncio.sleep(0.5)  # the stalled worker stays behind while the history moves on
            worker.resume()
            await wait_for(lambda: succeeded(runner, 61), 60, "61 successes", interval=0.2)
            assert worker.find("change stream history lost; sweeping")
            assert worker.alive()
            starts = Counter(m["key"] for m in pool.marks(event="start"))
    assert starts == Counter(["warm-up", *(f"gap-{i:02d}" for i in range(60))])


# -- poison ---------------------------------------------------------------------------------------
async def test_task_that_kills_its_workers_ends_fail_and_the_fleet_survives(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A handler calling os._exit(1) crashes each worker that runs it; restarted workers end it FAIL after max_failures."""
    ids = (f"p{i}" for i in itertools.count())
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=FAULTS_APP) as pool:
        live = [pool.start(next(ids), "--concurrency", "2") for _ in range(2)]
        crashed: list[WorkerProcess] = []

        async def supervise() -> None:  # restart dead workers, as systemd or Kubernetes would
            while True:
                for w in [w for w in live if not w.alive()]:
                    crashed.append(w)
                    live.remove(w)
                    live.append(pool.start(next(ids), "--concurrency", "2"))
                await asyncio.sleep(0.1)

        supervisor = asyncio.create_task(supervise())
        try:
            await started(*live)
            async with ChangeRecorder(mongo_uri, collection_name) as changes:
                await runner.publish("crash", key="poison", **(LEASE | {"max_failures": 2}))
                await runner.publish_many(
                    [
                        {
                            "name": "nap",
                            "key": f"ok-{i:02d}",
                            "params": {"seconds": 0.2},
                            "max_failures": 10,
                            **LEASE,
                        }
                        for i in range(20)
                    ]
                )
                await wait_for(
                    lambda: _finished(runner, "poison"), 60, "the poison task to end", interval=0.2
                )
                await wait_for(lambda: succeeded(runner, 20), 60, "20 successes", interval=0.2)
                await asyncio.sleep(0.5)  # a worker still to crash on the poison would be dead by now
        finally:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        assert all(w.alive() for w in live)
        poison_starts = pool.marks(key="poison", event="start")
    poison = await runner.get("poison")
    print(f"poison: {len(crashed)} worker crashes, failures {poison.failures}, attempts {poison.attempts}")
    assert poison.state is TaskState.FAIL and (poison.failures, poison.attempts) == (2, 2)
    # Each run crashed its worker: two starts on two workers, both dead with exit code 1.
    assert len(poison_starts) == 2 and len({m["worker_id"] for m in poison_starts}) == 2
    crashers = {w.worker_id: w.popen.returncode for w in crashed}
    assert {m["worker_id"] for m in poison_starts} <= set(crashers) and set(crashers.values()) == {1}
    # The history shows the lost leases: the second run took over the first crashed worker's lease,
    # and the claim that found the second lease dead ended the task instead of running it again.
    entries = [w for _, doc in changes.of("poison") for w in doc["workers"]]
    first, second = (m["worker_id"] for m in poison_starts)
    assert any(w["worker_id"] == second and w["took_over"] == [first] for w in entries)
    # The run that died last stays as its FAIL record, naming why.
    assert [(w.worker_id, w.state.value) for w in poison.workers] == [(second, "FAIL")]
    assert poison.last_error is not None and poison.last_error.type == "LeaseExpired"
    assert poison.finished_at is not None
    for i in range(20):
        assert (await runner.get(f"ok-{i:02d}")).state is TaskState.SUCCESS


async def test_hanging_handler_times_out_and_the_worker_stays_up(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """timeout=1 on a handler that never returns: each call is cancelled after 1 s; FAIL TimeoutError after the budget."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=FAULTS_APP) as pool:
        [worker] = pool.start_many(["t1"], "--concurrency", "2")
        await started(worker)
        await runner.publish(
            "hang",
            key="hang",
            **(LEASE | {"timeout": 1, "local_retries": 1, "max_failures": 2, "retry_backoff": 0.2}),
        )
        [done] = await wait_for(
            lambda: _finished(runner, "hang"), 30, "the hanging task to fail", interval=0.2
        )
        await runner.publish("nap", {"seconds": 0.1}, key="after")
        await wait_for(lambda: succeeded(runner, 1), 30, "a task after the hang")
        assert worker.alive()
        marks = pool.marks(key="hang")
    assert done.state is TaskState.FAIL and (done.failures, done.attempts) == (2, 2)
    assert len(done.workers) == 2
    for entry in done.workers:
        assert entry.state is EntryState.FAIL and entry.error is not None
        assert (entry.error.type, entry.error.message) == ("TimeoutError", "handler exceeded its 1 s timeout")
        assert entry.finished_at is not None
        took = (entry.finished_at - entry.claimed_at).total_seconds()
        # Two calls of 1 s each, 0.2 s apart (the default 10 s backoff would make it 12.2 s).
        assert 2.2 - 0.05 <= took <= 2.2 + 8, took
    # local_retries=1 and max_failures=2: four calls, each cancelled by its timeout.
    assert Counter(m["event"] for m in marks) == Counter({"start": 4, "cancelled": 4})
    assert len(worker.find("run failed", key="hang", error_type="TimeoutError")) == 2


async def test_sync_handler_timeout_marks_ctx_cancelled_and_fails() -> None:
    """A sync handler's thread cannot be killed: ctx.cancelled is set and the failure is recorded anyway."""
    runner = TaskRunner(store=MemoryStore())
    saw_cancel = threading.Event()

    @runner.task("spin")
    def spin(params: dict[str, Any], ctx: TaskContext) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if ctx.cancelled:
                saw_cancel.set()
                return
            time.sleep(0.01)

    @runner.task("own_timeout")
    async def own_timeout(params: dict[str, Any]) -> None:
        raise TimeoutError("the handler's own timeout")

    await runner.publish("spin", key="spin", timeout=timedelta(seconds=0.3), max_failures=1)
    await runner.publish("own_timeout", key="own", timeout=5, max_failures=1)
    worker = Worker(runner, worker_id="w")
    running = asyncio.create_task(worker.run())
    try:
        [spun, own] = await wait_for(lambda: _finished(runner, "spin", "own"), 10, "both tasks to fail")
        assert await asyncio.to_thread(saw_cancel.wait, 2)
    finally:
        worker.stop()
        await running
    [entry] = spun.workers
    assert spun.state is TaskState.FAIL and entry.error is not None
    assert (entry.error.type, entry.error.message) == ("TimeoutError", "handler exceeded its 0.3 s timeout")
    [entry] = own.workers
    assert entry.error is not None and entry.error.message == "the handler's own timeout"


# -- clock skew -------------------------------------------------------------------------------
async def test_workers_an_hour_off_claim_on_time_and_keep_their_leases(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """One worker's clock is 1 h ahead, another's 1 h behind: delayed tasks start on time,
    leases are server time (expires_at = ping_at + ping_timeout exactly) and nobody takes over."""
    ahead = WorkerPool(
        mongo_uri, collection_name, tmp_path / "ahead", app=FAULTS_APP, env={"FAULTS_CLOCK_SKEW": "3600"}
    )
    behind = WorkerPool(
        mongo_uri, collection_name, tmp_path / "behind", app=FAULTS_APP, env={"FAULTS_CLOCK_SKEW": "-3600"}
    )
    with ahead, behind:
        workers = [
            ahead.start("ahead", "--concurrency", "2", *NO_SWEEPS),
            behind.start("behind", "--concurrency", "2", *NO_SWEEPS),
        ]
        await started(*workers)
        async with ChangeRecorder(mongo_uri, collection_name) as changes:
            for w in workers:
                await runner.publish(
                    "nap",
                    {"seconds": 0.1},
                    key=f"late-{w.worker_id}",
                    delay=1.5,
                    **(LEASE | {"worker_ids": [w.worker_id]}),
                )
            for i in range(2):
                await runner.publish("nap", {"seconds": 3.0}, key=f"long-{i}", **LEASE)
            keys = ["late-ahead", "late-behind", "long-0", "long-1"]
            tasks = await wait_for(lambda: _finished(runner, *keys), 60, "all four tasks", interval=0.2)
            now = time.time()
        marks = ahead.marks() + behind.marks()
        assert all(w.alive() for w in workers)
        assert not any(w.find("taken over") for w in workers)
    # The skew is real: the workers' own wall clocks are an hour off.
    skews = {m["worker_id"]: m["t"] - now for m in marks}
    assert abs(skews["ahead"] - 3600) < 60 and abs(skews["behind"] + 3600) < 60, skews
    for task in tasks:
        assert task.state is TaskState.SUCCESS and (task.attempts, task.failures) == (1, 0)
        [entry] = task.workers
        assert entry.took_over == []
    for task in tasks[:2]:
        delay = (task.workers[0].claimed_at - task.created_at).total_seconds()
        print(f"{task.key}: claimed {delay:.2f}s after publishing with delay=1.5")
        assert 1.5 - 0.01 <= delay <= 1.5 + SLACK  # an hour off, or a sweep, would be far later
        assert task.workers[0].worker_id == task.key.removeprefix("late-")
    assert Counter(m["key"] for m in marks if m["event"] == "start") == Counter(keys)
    running = [w for _, doc in changes.documents for w in doc["workers"] if w["state"] == "RUNNING"]
    pings = [w for w in running if w["ping_at"] > w["claimed_at"]]
    assert len(pings) >= 10  # the long runs renewed their leases many times
    assert all(w["expires_at"] - w["ping_at"] == timedelta(seconds=PING_TIMEOUT) for w in running)


# -- the timeout option -------------------------------------------------------------------------
@pytest.mark.parametrize("timeout", [0, -1, 7 * 86_400 + 1, True])
def test_timeout_option_out_of_range_is_refused(timeout: object) -> None:
    """timeout is seconds (or a timedelta), > 0 and at most 7 days."""
    with pytest.raises(InvalidTask) as refused:
        NewTask.build(name="nap", key="k", options={"timeout": timeout})
    assert refused.value.field == "options.timeout"


async def test_timeout_option_through_cli_and_validator(mongo_uri: str, collection_name: str) -> None:
    """``publish --run-timeout`` stores options.timeout; the $jsonSchema validator accepts a number or null."""
    async with TaskRunner(mongo_uri, collection=collection_name) as runner:
        await runner.init(validator=True)
        env = {**os.environ, "TASKRUNNER_MONGO_URI": mongo_uri, "TASKRUNNER_COLLECTION": collection_name}
        published = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "taskrunner", "publish", "nap", "--key", "cli", "--run-timeout", "2.5"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert published.returncode == 0, published.stderr
        await runner.publish("nap", key="none")
        assert (await runner.get("cli")).options.timeout == 2.5
        assert (await runner.get("none")).options.timeout is None
        client: AsyncMongoClient[Doc] = AsyncMongoClient(mongo_uri)
        try:
            with pytest.raises(WriteError):
                await client["taskrunner"][collection_name].update_one(
                    {"key": "none"}, {"$set": {"options.timeout": "5 s"}}
                )
        finally:
            await client.close()
