"""Acceptance tests of the worker engine: real ``taskrunner worker`` processes on one collection.

Each test starts worker processes (tests/workers.py) running tests/apps/acceptance_app.py,
publishes through the API, and checks documents, change events, handler marks (exact
execution counts) and the workers' JSON logs. Times in documents are server times.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from workers import ChangeRecorder, WorkerPool, finished, wait_exit

from taskrunner import EntryState, NewTask, TaskOptionsDict, TaskRunner, TaskState, WorkerEntry
from taskrunner.store import rules
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

Doc = dict[str, Any]


@pytest.mark.timeout(300)  # its waits add up to 150 s, which a busy host may need
async def test_many_tasks_each_run_exactly_once_spread_over_workers(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """200 tasks on 3 workers all succeed, each handler runs exactly once, and every worker gets a share."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = pool.start_many(["w1", "w2", "w3"], "--concurrency", "4")
        await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")
        keys = [f"bulk-{i:03d}" for i in range(200)]
        started = time.monotonic()
        await runner.publish_many([{"name": "quick", "key": key} for key in keys])
        await wait_for(lambda: _count_is(runner, TaskState.SUCCESS, 200), 90, "200 successes", interval=0.5)
        elapsed = time.monotonic() - started
        await asyncio.sleep(1.0)  # a duplicate run would show up in the marks by now
        marks = pool.marks(event="start")
    print(f"200 tasks in {elapsed:.1f}s")
    assert Counter(m["key"] for m in marks) == Counter(keys)
    tasks = [await runner.get(key) for key in keys]
    assert all(len(t.workers) == 1 and t.attempts == 1 and t.failures == 0 for t in tasks)
    by_worker = Counter(t.workers[0].worker_id for t in tasks)
    assert by_worker == Counter(m["worker_id"] for m in marks)
    assert set(by_worker) == {"w1", "w2", "w3"} and min(by_worker.values()) >= 20, by_worker


async def _count_is(runner: TaskRunner, state: TaskState, n: int) -> bool:
    return await runner.store.count(state=state) == n


async def running_entry(runner: TaskRunner, key: str, *, not_worker: str | None = None) -> WorkerEntry | None:
    """The task's RUNNING entry (of a worker other than ``not_worker``), if any."""
    task = await runner.get(key)
    return next(
        (w for w in task.workers if w.state is EntryState.RUNNING and w.worker_id != not_worker), None
    )


PING_TIMEOUT = 2.0
LEASE: TaskOptionsDict = {"ping_interval": 0.5, "ping_timeout": PING_TIMEOUT}


async def test_killed_worker_is_taken_over_once_its_lease_expires(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """After SIGKILL another worker claims the task within ping_timeout (+ slack) of the last ping, not before."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = {w.worker_id: w for w in pool.start_many(["w1", "w2"])}
        await runner.publish("sleep", {"seconds": 0.3, "first_seconds": 60}, key="victim", **LEASE)
        first = await wait_for(lambda: running_entry(runner, "victim"), 30, "a first claim")
        victim = workers.pop(first.worker_id)
        [survivor] = workers.values()
        await wait_for(lambda: _pinged(runner, "victim", first, times=2), 10, "two pings")
        victim.kill()
        await wait_exit(victim, 10)
        last_ping = (await runner.get("victim")).entry(first.run_id)
        assert last_ping is not None
        [done] = await wait_for(lambda: finished(runner, "victim"), 30, "the takeover to finish")
    assert done.state is TaskState.SUCCESS and (done.failures, done.attempts) == (1, 2)
    [entry] = done.workers  # the expired entry was dropped by the takeover claim
    assert (entry.worker_id, entry.state, entry.attempt) == (survivor.worker_id, EntryState.SUCCESS, 2)
    assert entry.took_over == [victim.worker_id] and survivor.find("taken over", key="victim")
    delay = (entry.claimed_at - last_ping.ping_at).total_seconds()
    print(f"takeover {delay:.2f}s after the killed worker's last ping (ping_timeout 2s)")
    assert PING_TIMEOUT - 0.01 <= delay <= PING_TIMEOUT + 1.5
    assert [m["worker_id"] for m in pool.marks(key="victim", event="start")] == [
        victim.worker_id,
        survivor.worker_id,
    ]


async def _pinged(runner: TaskRunner, key: str, claimed: WorkerEntry, *, times: int) -> bool:
    """Has the claim's lease been renewed about ``times`` times (ping_interval 0.5 s)?"""
    entry = (await runner.get(key)).entry(claimed.run_id)
    return entry is not None and (entry.ping_at - claimed.claimed_at).total_seconds() >= 0.45 * times


async def test_stalled_worker_loses_its_claim_and_writes_nothing(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A SIGSTOPped worker's run is taken over; resumed, it stops its handler and never writes to the task."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = {w.worker_id: w for w in pool.start_many(["w1", "w2"])}
        async with ChangeRecorder(mongo_uri, collection_name) as changes:
            await runner.publish("sleep", {"seconds": 1.5, "first_seconds": 60}, key="stall", **LEASE)
            old = await wait_for(lambda: running_entry(runner, "stall"), 30, "a first claim")
            stalled = workers.pop(old.worker_id)
            [owner] = workers.values()
            await wait_for(lambda: _pinged(runner, "stall", old, times=1), 10, "a ping")
            stalled.pause()
            new = await wait_for(
                lambda: running_entry(runner, "stall", not_worker=stalled.worker_id), 30, "the takeover"
            )
            stalled.resume()  # while the new owner's handler still runs
            await wait_for(lambda: stalled.find("stopping run", key="stall"), 15, "the stalled run to stop")
            [done] = await wait_for(lambda: finished(runner, "stall"), 30, "the new owner to finish")
            await wait_for(lambda: pool.marks(key="stall", event="cancelled"), 10, "the old handler's cancel")
            await asyncio.sleep(0.5)  # a late write of the old run would show in the changes by now
        assert stalled.alive()
    [stop] = stalled.find("stopping run", key="stall")
    assert stop["reason"] in ("claim lost", "lease unconfirmed for ping_timeout")
    assert not stalled.find("run succeeded", key="stall") and not stalled.find("claim released", key="stall")
    [cancelled] = pool.marks(key="stall", event="cancelled")
    assert (cancelled["run_id"], cancelled["ctx_cancelled"]) == (old.run_id, True)
    # The final document holds only the new owner's entry and result.
    assert done.state is TaskState.SUCCESS and done.failures == 1
    [entry] = done.workers
    assert (entry.worker_id, entry.run_id, entry.state) == (owner.worker_id, new.run_id, EntryState.SUCCESS)
    assert entry.result == {"worker_id": owner.worker_id, "run_id": new.run_id}
    # No write of the old run after the takeover: its entry never reappears in any change event.
    docs = [doc for _, doc in changes.of("stall")]
    taken = next(i for i, doc in enumerate(docs) if any(w["run_id"] == new.run_id for w in doc["workers"]))
    assert all(w["run_id"] != old.run_id for doc in docs[taken:] for w in doc["workers"])


async def test_concurrency_three_runs_on_three_distinct_workers_never_more(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """concurrency=3 on 4 workers: exactly 3 distinct workers succeed, and no change event ever shows more than 3 claims."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = pool.start_many(["w1", "w2", "w3", "w4"])
        await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")
        async with ChangeRecorder(mongo_uri, collection_name) as changes:
            await runner.publish("sleep", {"seconds": 2.0}, key="c3", concurrency=3)
            [done] = await wait_for(lambda: finished(runner, "c3"), 60, "three successes")
            await asyncio.sleep(1.0)  # a fourth run would have started by now
        marks = pool.marks(key="c3", event="start")
    docs = [doc for _, doc in changes.of("c3")]
    running = [sum(w["state"] == "RUNNING" for w in doc["workers"]) for doc in docs]
    held = [sum(w["state"] in ("RUNNING", "SUCCESS") for w in doc["workers"]) for doc in docs]
    print(f"{len(docs)} change events; RUNNING entries per event: {running}")
    assert max(running) == 3 and max(held) == 3  # they overlapped, and never exceeded the limit
    assert done.state is TaskState.SUCCESS and len(done.workers) == 3
    assert all(w.state is EntryState.SUCCESS for w in done.workers)
    assert len({w.worker_id for w in done.workers}) == 3
    assert sorted(m["worker_id"] for m in marks) == sorted(w.worker_id for w in done.workers)


async def test_worker_ids_are_respected_and_removal_stops_the_run(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """Tasks naming w2 run only on w2; dropping a running worker from worker_ids stops and releases its run."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        pool.start_many(["w1", "w2", "w3"], "--concurrency", "2")
        keys = [f"only-w2-{i}" for i in range(6)]
        await runner.publish_many([{"name": "quick", "key": key, "worker_ids": ["w2"]} for key in keys])
        tasks = await wait_for(lambda: finished(runner, *keys), 60, "the w2 tasks")
        assert {(t.state, w.worker_id) for t in tasks for w in t.workers} == {(TaskState.SUCCESS, "w2")}
        assert {m["worker_id"] for key in keys for m in pool.marks(key=key)} == {"w2"}

        await runner.publish(
            "sleep",
            {"seconds": 0.3, "first_seconds": 60},
            key="moving",
            worker_ids=["w1", "w3"],
            ping_interval=0.5,
            ping_timeout=10,
        )
        first = await wait_for(lambda: running_entry(runner, "moving"), 30, "a claim by w1 or w3")
        other = "w3" if first.worker_id == "w1" else "w1"
        stopped = time.monotonic()
        await _set_worker_ids(mongo_uri, collection_name, "moving", [other])
        await wait_for(lambda: _entry_gone(runner, "moving", first.run_id), 30, "the entry's release")
        release_delay = time.monotonic() - stopped
        [done] = await wait_for(lambda: finished(runner, "moving"), 30, "the other worker's run")
        [worker] = [w for w in pool.workers if w.worker_id == first.worker_id]
    print(f"released {release_delay:.2f}s after the worker_ids change (ping_interval 0.5s)")
    assert release_delay <= 20.0  # a few ping intervals (0.5 s), not the 60 s first run; room for a busy host
    [stop] = worker.find("stopping run", key="moving")
    assert stop["reason"] == "worker no longer in worker_ids"
    assert worker.find("claim released", key="moving", reason="worker no longer in worker_ids")
    assert done.state is TaskState.SUCCESS and done.failures == 0  # a release spends no budget
    assert [(w.worker_id, w.state) for w in done.workers] == [(other, EntryState.SUCCESS)]
    assert [m["event"] for m in pool.marks(key="moving", worker_id=first.worker_id)] == ["start", "cancelled"]


async def _set_worker_ids(uri: str, collection: str, key: str, worker_ids: list[str]) -> None:
    async with AsyncMongoClient[Doc](uri) as client:
        result = await client.taskrunner[collection].update_one(
            {"key": key}, {"$set": {"options.worker_ids": worker_ids}}
        )
        assert result.modified_count == 1


async def _entry_gone(runner: TaskRunner, key: str, run_id: str) -> bool:
    return (await runner.get(key)).entry(run_id) is None


async def test_max_failures_is_task_wide_and_errors_are_kept(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """max_failures=2 over 3 workers allows exactly 2 failed runs; local_retries and retry_backoff apply; errors keep type, message, traceback."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        pool.start_many(["w1", "w2", "w3"])
        await runner.publish("always_fails", key="doomed", max_failures=2, local_retries=2, retry_backoff=0.4)
        await runner.publish("flaky", {"failures": 2}, key="flaky", local_retries=2, retry_backoff=0.3)
        await runner.publish("fails_fast", key="gives-up", max_failures=1, local_retries=2, retry_backoff=0.3)
        doomed, flaky, gave_up = await wait_for(
            lambda: finished(runner, "doomed", "flaky", "gives-up"), 60, "the three tasks"
        )
        await asyncio.sleep(1.5)  # a third run of "doomed" would have started by now
        doomed_marks, flaky_marks = pool.marks(key="doomed"), pool.marks(key="flaky")
    assert doomed.state is TaskState.FAIL and (doomed.failures, doomed.attempts) == (2, 2)
    assert [w.state for w in doomed.workers] == [EntryState.FAIL, EntryState.FAIL]
    for entry in doomed.workers:
        assert entry.error is not None and entry.error.type == "RuntimeError"
        assert entry.error.message == f"boom from {entry.worker_id}"
        assert entry.error.traceback and "always_fails" in entry.error.traceback
        calls = [m for m in doomed_marks if m["run_id"] == entry.run_id]
        assert len(calls) == 3  # local_retries=2: three calls in one run, retry_backoff apart
        assert all(b["t"] - a["t"] >= 0.4 for a, b in itertools.pairwise(calls))
    assert len(doomed_marks) == 6  # 2 runs x 3 calls, no third run
    first, second = doomed.workers
    assert first.finished_at is not None
    backoff = (second.claimed_at - first.finished_at).total_seconds()
    assert backoff >= 0.4 - 0.01  # retry_backoff passes before another claim
    # local_retries=2: the handler is called 3 times in one run and the third call succeeds.
    assert flaky.state is TaskState.SUCCESS and (flaky.failures, flaky.attempts) == (0, 1)
    [entry] = flaky.workers
    assert entry.result == {"calls": 3}
    starts = [m for m in flaky_marks if m["event"] == "start"]
    assert [m["run_id"] for m in starts] == [entry.run_id] * 3
    assert all(b["t"] - a["t"] >= 0.3 for a, b in itertools.pairwise(starts))
    # Fail skips local retries: one call, one FAIL entry.
    assert gave_up.state is TaskState.FAIL and len(pool.marks(key="gives-up")) == 1
    [entry] = gave_up.workers
    assert entry.error is not None and (entry.error.type, entry.error.message) == (
        "Fail",
        "gave up on purpose",
    )


async def test_sigterm_releases_the_run_for_another_worker_at_once(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """SIGTERM releases a running task (failures stay 0) and another worker claims it at once, long before its 30 s lease ends."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = {w.worker_id: w for w in pool.start_many(["w1", "w2"])}
        await runner.publish(
            "sleep", {"seconds": 0.3, "first_seconds": 60}, key="handover", ping_interval=1, ping_timeout=30
        )
        first = await wait_for(lambda: running_entry(runner, "handover"), 30, "a first claim")
        leaving = workers.pop(first.worker_id)
        [staying] = workers.values()
        async with ChangeRecorder(mongo_uri, collection_name) as changes:
            await wait_for(
                lambda: pool.marks(key="handover", event="start"), 30, "the first handler to start"
            )
            signalled = time.monotonic()
            leaving.terminate()
            seen = await wait_for(
                lambda: _claimed_by(changes, "handover", staying.worker_id), 15, "the pickup"
            )
            [done] = await wait_for(lambda: finished(runner, "handover"), 30, "the second run")
        assert await wait_exit(leaving, 10) == 0
    pickup = seen - signalled
    released = next(doc for _, doc in changes.of("handover") if not doc["workers"])
    [entry] = done.workers
    server_gap = (entry.claimed_at - released["updated_at"]).total_seconds()
    print(
        f"SIGTERM to pickup {pickup:.2f}s (shutdown-timeout 0.5s); release to claim {server_gap:.2f}s server time"
    )
    # Measured 0.5-0.6 s on a quiet machine, 1.3 s with test files running side by side; a
    # claim that waited for the lease would take 30 s.
    assert pickup < 10
    assert done.state is TaskState.SUCCESS and (done.failures, done.attempts) == (0, 2)
    assert (entry.worker_id, entry.state) == (staying.worker_id, EntryState.SUCCESS)
    assert leaving.find("claim released", key="handover", reason="worker shutting down")
    assert leaving.find("worker stopped")
    assert [m["event"] for m in pool.marks(key="handover", worker_id=leaving.worker_id)] == [
        "start",
        "cancelled",
    ]


def _claimed_by(changes: ChangeRecorder, key: str, worker_id: str) -> float | None:
    """Receive time of the first change event showing ``worker_id``'s entry on ``key``."""
    return next(
        (t for t, doc in changes.of(key) if any(w["worker_id"] == worker_id for w in doc["workers"])), None
    )


async def test_delayed_task_waits_and_priority_orders_a_busy_worker(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A delay=2 task is not claimed before its run_at; a higher-priority task published later starts first."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        solo = pool.start("solo", "--concurrency", "1", "--poll-interval", "60")  # on time can't be a sweep
        # Timed from a listening worker: a busy machine may take seconds to start one.
        await wait_for(lambda: solo.find("change stream opened"), 60, "the worker's stream to open")
        delayed = await runner.publish("quick", key="later", delay=2)
        assert (delayed.run_at - delayed.created_at).total_seconds() == pytest.approx(2, abs=0.01)
        [done] = await wait_for(lambda: finished(runner, "later"), 30, "the delayed task")
        [entry] = done.workers
        assert entry.claimed_at >= done.run_at
        print(f"delayed task claimed {(entry.claimed_at - done.run_at).total_seconds():.2f}s after run_at")
        assert (entry.claimed_at - done.run_at).total_seconds() < 20.0  # on time, not at a sweep 60 s apart

        await runner.publish("sleep", {"seconds": 2}, key="busy")
        await wait_for(lambda: running_entry(runner, "busy"), 30, "the busy task to start")
        await runner.publish("quick", key="low", priority=0)
        await runner.publish("quick", key="high", priority=5)
        busy, low, high = await wait_for(lambda: finished(runner, "busy", "low", "high"), 30, "all three")
        order = [m["key"] for m in pool.marks(event="start")]
    assert order == ["later", "busy", "high", "low"]
    assert busy.workers[0].finished_at is not None
    assert busy.workers[0].finished_at <= high.workers[0].claimed_at < low.workers[0].claimed_at


async def test_bad_input_never_stops_a_worker(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """Malformed documents, unknown names, invalid params, unstorable results and KeyboardInterrupt fail only their task."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        worker = pool.start("tough", "--concurrency", "2")
        await wait_for(lambda: worker.find("worker started"), 30, "the worker to start")
        async with AsyncMongoClient[Doc](mongo_uri, tz_aware=True) as client:
            collection = client.taskrunner[collection_name]
            await collection.insert_many(_malformed_documents())
        await runner.publish("nobody_handles", {"x": 1}, key="unknown")
        bad: dict[str, Any] = {"max_failures": 1}
        await runner.publish("typed", {"count": "many"}, key="bad-params", **bad)
        await runner.publish("unstorable", key="unstorable", **bad)
        await runner.publish("interrupt", key="interrupt", **bad)
        await runner.publish("interrupt_sync", key="interrupt-sync", **bad)
        failed = await wait_for(
            lambda: finished(runner, "bad-params", "unstorable", "interrupt", "interrupt-sync"),
            30,
            "failures",
        )
        await runner.publish("quick", key="after")
        [after] = await wait_for(lambda: finished(runner, "after"), 30, "the normal task")
        assert worker.alive()
        unknown = await runner.get("unknown")
        async with AsyncMongoClient[Doc](mongo_uri, tz_aware=True) as client:
            collection = client.taskrunner[collection_name]
            rejected = await wait_for(
                lambda: collection.find_one({"key": "malformed-2", "state": "FAIL"}), 30, "a mark"
            )
        [by_hand] = await wait_for(lambda: finished(runner, "malformed-1"), 30, "the hand-written task")
    assert after.state is TaskState.SUCCESS and after.workers[0].worker_id == "tough"
    assert (unknown.state, unknown.workers, unknown.attempts) == (TaskState.PENDING, [], 0)
    errors = {t.key: t.workers[0].error for t in failed}
    assert all(t.state is TaskState.FAIL and len(t.workers) == 1 for t in failed)
    assert errors["bad-params"] is not None and errors["bad-params"].type == "InvalidParams"
    assert "params.count" in errors["bad-params"].message
    assert errors["unstorable"] is not None and "cannot be stored" in errors["unstorable"].message
    assert errors["interrupt"] is not None and errors["interrupt"].type == "KeyboardInterrupt"
    assert errors["interrupt-sync"] is not None and errors["interrupt-sync"].type == "KeyboardInterrupt"
    assert not pool.marks(key="bad-params")  # invalid params never reach the handler
    # Hand-written documents: the minimal one gets its defaults and runs; the unreadable one
    # is marked FAIL in the document itself, naming the field, and never runs.
    assert by_hand.state is TaskState.SUCCESS and pool.marks(key="malformed-1")
    assert rejected["workers"] == [] and rejected["error"]["type"] == "MalformedTask"
    assert rejected["error"]["message"].startswith("params") and rejected["fatal"] is True
    assert not pool.marks(key="malformed-2")
    assert not [
        e for e in worker.logs() if e.get("event") in ("side task crashed; restarting", "run crashed")
    ]


def _malformed_documents() -> list[Doc]:
    """A document holding only key, name and state, and one the claim filter accepts but no model reads."""
    now = datetime.now(UTC)
    claimable = rules.new_document(NewTask(key="malformed-2", name="quick"), publish_id="by-hand")
    claimable.update(
        {
            "created_at": now,
            "updated_at": now,
            "run_at": now,
            "claimable_at": now,
            "params": "not an object",
            "priority": 100,
        }
    )
    return [{"key": "malformed-1", "name": "quick", "state": "PENDING"}, claimable]
