"""Units of the engine: the claim queue, claim ranks, and discovery's fallbacks (memory store)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from structlog.testing import capture_logs
from support import logged, run_until

from taskrunner import MemoryStore, TaskContext, TaskRunner, TaskState
from taskrunner.engine.claim_queue import ClaimQueue, Place, Rank
from taskrunner.engine.worker import Worker
from taskrunner.errors import ChangeStreamsUnsupported, StoreUnavailable
from taskrunner.models import WorkerInfo
from taskrunner.store.base import ChangeStream, Page
from taskrunner.testing import wait_for


def test_queue_keeps_one_entry_per_key_in_time_order() -> None:
    """Re-scheduling a key replaces its entry; due() lists due keys best rank first."""
    queue = ClaimQueue()
    queue.put("a", 5.0, Rank(Place.OWNED, 0, 1, 0.0))
    queue.put("b", 3.0, Rank(Place.OWNED, 0, 1, 0.0))
    queue.put("a", 1.0, Rank(Place.OWNED, -5, 1, 0.0))
    assert len(queue) == 2 and queue.next_at() == 1.0
    assert [d.key for d in queue.due(4.0)] == ["a", "b"]
    queue.discard("a")
    assert queue.next_at() == 3.0 and "a" not in queue


def test_queue_overflow_evicts_the_farthest_and_flags_a_rescan() -> None:
    """Past capacity the farthest keys go and the queue asks for a rescan; the nearest stay."""
    queue = ClaimQueue(capacity=10)
    for i in range(11):
        queue.put(f"k{i}", float(i), Rank(Place.OWNED, 0, 1, 0.0))
    assert queue.overflowed and len(queue) == 9
    assert [d.key for d in queue.due(100.0)] == [f"k{i}" for i in range(9)]


def test_parked_entries_of_a_gate_wake_best_first_when_a_permit_opens() -> None:
    """Entries parked for a gate's permit until a later time: ``wake`` makes the best of
    those still parked due now (not one claimed or re-queued meanwhile, nor another gate's)
    and says how many; the others stay parked until their time."""
    queue = ClaimQueue()
    for key, priority in (("low", 0), ("high", 9), ("mid", 5), ("gone", 7)):
        queue.put(key, 1.0, Rank(Place.OWNED, -priority, 1, 0.0), name="job", gate="job")
    queue.put("other", 1.0, Rank(Place.OWNED, -9, 1, 0.0), name="else", gate="else")
    for entry in queue.due(1.0):
        queue.park(entry, 10.0)
    queue.discard("gone")  # claimed meanwhile
    assert queue.due(2.0) == [] and queue.count("job") == 3
    assert queue.wake("job", 2, 2.0) == 2
    assert [d.key for d in queue.due(2.0)] == ["high", "mid"]
    assert queue.wake("job", 5, 2.0) == 1 and queue.wake("job", 5, 2.0) == 0
    assert [d.key for d in queue.due(2.0)] == ["high", "mid", "low"]
    assert "other" not in {d.key for d in queue.due(9.9)} and "other" in {d.key for d in queue.due(10.0)}


def make_runner(store: Any) -> tuple[TaskRunner, list[str]]:
    runner = TaskRunner(store=store)
    done: list[str] = []

    @runner.task("job")
    async def job(params: dict[str, Any], ctx: TaskContext) -> None:
        done.append(ctx.key)

    return runner, done


def test_exactly_one_worker_owns_each_task_and_owners_spread() -> None:
    """Rendezvous ownership: for every key exactly one of five workers with the same peers
    owns it, and 200 keys spread over all five (none gets more than twice its share)."""
    runner, _ = make_runner(MemoryStore())
    workers = [Worker(runner, worker_id=f"w{i}") for i in range(5)]
    started = datetime.now(UTC)
    for w in workers:
        w.peers = [
            WorkerInfo(
                worker_id=o.worker_id, host="h", pid=1, started_at=started, names=["job"], concurrency=1
            )
            for o in workers
            if o is not w
        ]

    async def owners() -> list[str]:
        tasks = await runner.store.publish(
            [runner.new_task({"name": "job", "key": f"k{i}"}) for i in range(200)]
        )
        found = []
        for task in tasks:
            [owner] = [w.worker_id for w in workers if w.owns(task)]
            found.append(owner)
        return found

    counts = Counter(asyncio.run(owners()))
    assert sorted(counts) == [f"w{i}" for i in range(5)] and max(counts.values()) <= 80


class NoStreams(MemoryStore):
    """A store whose server has no change streams, like a standalone mongod."""

    async def watch(
        self,
        *,
        resume_after: Any = None,
        key: str | None = None,
        work_for: Any = None,
        owned: Any = None,
        summary: bool = False,
    ) -> ChangeStream:
        raise ChangeStreamsUnsupported("$changeStream is only supported on replica sets")


async def test_worker_polls_when_the_server_has_no_change_streams() -> None:
    """Without change streams the worker warns once and still finds and runs tasks by polling."""
    runner, done = make_runner(NoStreams())
    worker = Worker(runner, worker_id="w", poll_interval=0.2)
    await runner.publish("job", key="before")

    async def later() -> None:  # published once the worker runs, so only a later poll can find it
        await wait_for(lambda: done == ["before"], what="the first task to run")
        await runner.publish("job", key="after")

    publisher = asyncio.create_task(later())
    await run_until(worker, lambda: len(done) == 2)
    await publisher
    assert worker.discovery.polling and sorted(done) == ["after", "before"]


class CountedSweeps(NoStreams):
    """Polls like NoStreams and counts the sweeps it serves."""

    sweeps = 0

    async def due(
        self, worker_id: str, names: Any, *, horizon: datetime, limit: int = 100, apart: Any = ()
    ) -> Page:
        self.sweeps += 1
        return await super().due(worker_id, names, horizon=horizon, limit=limit, apart=apart)


async def test_a_sweep_marks_an_unreadable_document_once_and_runs_the_other_tasks() -> None:
    """A sweep marks an unreadable document FAIL naming its field (logged once, however
    often the worker polls) and still runs every other task."""
    store = CountedSweeps()
    runner, done = make_runner(store)
    store.insert_document(
        {
            "key": "a-broken",
            "name": "job",
            "params": "nope",
            "state": "PENDING",
            "claimable_at": datetime(2020, 1, 1, tzinfo=UTC),
            "options": {"worker_ids": []},
        }
    )
    await runner.publish_many([{"name": "job", "key": f"k{i}"} for i in range(4)])
    worker = Worker(runner, worker_id="w", poll_interval=0.05)
    with capture_logs() as logs:
        await run_until(worker, lambda: len(done) == 4 and store.sweeps >= 3)
    marked = [e for e in logs if e["event"] == "marked an unreadable task document FAIL"]
    assert sorted(done) == [f"k{i}" for i in range(4)]
    assert len(marked) == 1 and marked[0]["key"] == "a-broken" and "params" in marked[0]["problem"]
    broken = store.document("a-broken")
    assert broken["state"] == "FAIL" and broken["error"]["type"] == "MalformedTask"


async def test_a_worker_runs_a_minimal_document_written_by_hand() -> None:
    """A document holding only key, name and params is normalized by a polling worker's sweep and run."""
    store = CountedSweeps()
    runner, done = make_runner(store)
    store.insert_document({"key": "by-hand", "name": "job", "params": {"n": 1}})
    worker = Worker(runner, worker_id="w", poll_interval=0.05)
    await run_until(worker, lambda: done == ["by-hand"])
    task = await runner.get("by-hand")
    assert task.state is TaskState.SUCCESS and task.unreadable is None and task.options.max_failures == 3


class BlindSweeps(MemoryStore):
    """Sweeps never show unreadable documents: only the change stream can."""

    async def due(
        self, worker_id: str, names: Any, *, horizon: datetime, limit: int = 100, apart: Any = ()
    ) -> Page:
        page = await super().due(worker_id, names, horizon=horizon, limit=limit, apart=apart)
        return Page(page.tasks, [], page.after)


async def test_a_worker_hears_a_hand_written_document_and_runs_it() -> None:
    """A minimal document inserted while the worker listens reaches it on the change stream
    (sweeps here never show it), is normalized and runs."""
    store = BlindSweeps()
    runner, done = make_runner(store)
    worker = Worker(runner, worker_id="w")
    with capture_logs() as logs:
        running = asyncio.create_task(worker.run())
        try:
            await wait_for(lambda: logged(logs, "change stream opened"), what="the worker's stream to open")
            store.insert_document({"key": "heard", "name": "job"})
            await wait_for(lambda: done == ["heard"], 10, "the hand-written task to run", interval=0.02)
        finally:
            worker.stop()
            await running
    assert (await runner.get("heard")).state is TaskState.SUCCESS


async def test_lost_history_leads_to_a_sweep_and_no_stranded_task() -> None:
    """After ChangeHistoryLost the worker sweeps, so tasks written in the gap still run: a store
    keeping one change loses the stream's place as five tasks land at once."""
    store = MemoryStore(history=1)
    runner, done = make_runner(store)
    worker = Worker(runner, worker_id="w")
    with capture_logs() as logs:
        running = asyncio.create_task(worker.run())
        await wait_for(lambda: logged(logs, "change stream opened"), what="the worker's stream to open")
        await runner.publish_many([{"name": "job", "key": f"k{i}"} for i in range(5)])
        await wait_for(lambda: len(done) == 5, what="five tasks run")
        worker.stop()
        await running
    assert logged(logs, "change stream history lost; sweeping"), "the history was never lost"
    assert sorted(done) == [f"k{i}" for i in range(5)]
    assert await runner.store.count(state=TaskState.SUCCESS) == 5


async def test_stop_releases_running_claims_without_spending_budget() -> None:
    """Stopping a worker mid-run cancels the handler and releases the claim; failures stay 0."""
    runner = TaskRunner(store=MemoryStore())
    started = asyncio.Event()

    @runner.task("slow")
    async def slow(params: dict[str, Any], ctx: TaskContext) -> None:
        started.set()
        await asyncio.sleep(60)

    worker = Worker(runner, worker_id="w", shutdown_timeout=0.1)
    await runner.publish("slow", key="s")
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(started.wait(), 5)
    worker.stop()
    await asyncio.wait_for(running, 5)
    task = await runner.get("s")
    assert task.state is TaskState.PENDING and task.failures == 0 and task.workers == []


async def test_worker_registers_itself_while_running() -> None:
    """A running worker appears in the registry with its task names and leaves it on stop."""
    registry_store = MemoryStore()
    runner, _ = make_runner(registry_store)
    worker = Worker(runner, worker_id="w-reg", beat_interval=0.1)
    running = asyncio.create_task(worker.run())
    await wait_for(registry_store.workers, what="the worker to register")
    [info] = await registry_store.workers()
    worker.stop()
    await running
    assert (info.worker_id, info.names) == ("w-reg", ["job"])
    assert await registry_store.workers() == []


async def test_a_side_task_crashing_in_a_row_is_logged_once_and_restarted_ever_later() -> None:
    """The monitor restarts a crashing side task after pauses that double, and logs only
    the first crash of a run of them: a server that does not answer as one warning without
    a traceback, any other exception as an error with it; the repeats are debug."""
    runner, _ = make_runner(MemoryStore())
    worker = Worker(runner, worker_id="w")
    starts: list[float] = []

    async def failing(*errors: Exception) -> None:
        starts.append(time.monotonic())
        if len(starts) <= len(errors):
            raise errors[len(starts) - 1]
        worker.stop()  # ends the monitor's loop

    away = StoreUnavailable("MongoDB unavailable: 127.0.0.1:1: connection refused")
    with capture_logs() as logs:
        await asyncio.wait_for(worker._supervise("store", lambda: failing(away, away)), 30)
    crashes = [
        (e["log_level"], "exc_info" in e) for e in logs if e["event"] == "side task crashed; restarting"
    ]
    assert crashes == [("warning", False), ("debug", False)], logs
    first, second = (b - a for a, b in itertools.pairwise(starts))
    assert first >= 1.0 and second >= 2.0, starts

    worker, starts = Worker(runner, worker_id="w"), []
    with capture_logs() as logs:
        await asyncio.wait_for(worker._supervise("bug", lambda: failing(RuntimeError("a bug"))), 30)
    [crash] = [e for e in logs if e["event"] == "side task crashed; restarting"]
    assert crash["log_level"] == "error" and isinstance(crash["exc_info"], RuntimeError), crash
