"""One test per shortcoming of the Rust crate mscheduler (docs/guarantees.md, "Compared with mscheduler"),
each proving taskrunner does not have it.

1. ``run_time`` is stored but never read: delayed tasks run at once.
2. ``priority``, retry delay, ``returns`` and ``fail_reason`` are unused.
3. The retry delay is overridden: the fail event makes the task claimable "now".
4. "Not fully succeeded" compares successes with max retries instead of concurrency.
5. The claim filter never re-checks ``specific_worker_ids``.
6. The same worker may run a task again after succeeding on it.
7. With >1 slot, a late worker waits for the latest ping expiry, so free slots idle.
8. The retry budget is per worker: total attempts = workers x retries.
9. Batch fetch reads the first 10 only and restarts from the top (starvation); keys
   whose time comes while the worker is full are dropped.
10. A bounded event channel drops events on lag and can stop the fetch loop.
11. Client clocks and server ``$$NOW`` are mixed in lease arithmetic.
12. Its "don't update running" filter never matches; it relies on the unique index.
13. ``shutdown()`` marks tasks failed (burning a retry) without stopping handlers.
14. Waiting for an event resubscribes each time and can miss events.
15. Tests drop a join handle and think the first consumer stopped.
16. A second unique index ``{key, worker_id}`` adds nothing.
And: there is no reconnect; if the change stream ends, the consumer returns.

Worker tests run in-process ``Worker`` objects against the embedded server; rules that
live in the claim filter run at store level on both ``MemoryStore`` and ``MongoStore``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest
import runs

from taskrunner.context import TaskContext
from taskrunner.engine.worker import Worker
from taskrunner.errors import StoreUnavailable
from taskrunner.models import EntryState, NewTask, TaskState
from taskrunner.runner import TaskRunner
from taskrunner.store import fields as f
from taskrunner.store import rules
from taskrunner.store.base import ChangeEvent, ChangeStream, Page, Store
from taskrunner.store.mongo import MongoStore
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo
Params = dict[str, Any]


# -- fixtures and helpers ---------------------------------------------------------------------
def new(key: str, **options: Any) -> NewTask:
    return NewTask.build(key=key, name="job", options=options)


def state_is(runner: TaskRunner, key: str, state: TaskState) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await runner.get(key)).state is state

    return check


@asynccontextmanager
async def running(*workers: Worker) -> AsyncIterator[list[asyncio.Task[None]]]:
    """Run workers in-process; stop them and join their run() on exit."""
    tasks = [asyncio.create_task(w.run(), name=f"worker:{w.worker_id}") for w in workers]
    try:
        yield tasks
    finally:
        for w in workers:
            w.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)


def worker(runner: TaskRunner, worker_id: str, concurrency: int = 1, **kwargs: Any) -> Worker:
    # poll_interval is long: everything here must be driven by events and the claim queue.
    return Worker(runner, concurrency=concurrency, worker_id=worker_id, poll_interval=60.0, **kwargs)


class Gate:
    """A handler body that blocks until opened (keeps a worker's slot busy)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()

    async def __call__(self) -> None:
        self.entered.set()
        await self.opened.wait()


class WatchSpy:
    """Wraps ``store.watch``: counts opens, records ``resume_after``, can slow or break streams."""

    def __init__(self, store: Store) -> None:
        self.inner = store.watch
        self.calls: list[Mapping[str, Any] | None] = []
        self.lag = 0.0
        self.broken = asyncio.Event()
        self.reopen = asyncio.Event()
        self.reopen.set()

    async def __call__(self, *, resume_after: Mapping[str, Any] | None = None, **kwargs: Any) -> ChangeStream:
        self.calls.append(resume_after)
        await self.reopen.wait()
        return SpiedStream(self, await self.inner(resume_after=resume_after, **kwargs))


class SpiedStream:
    def __init__(self, spy: WatchSpy, inner: ChangeStream) -> None:
        self.spy, self.inner = spy, inner

    @property
    def resume_token(self) -> Mapping[str, Any] | None:
        return self.inner.resume_token

    async def next(self, wait: float) -> ChangeEvent | None:
        if self.spy.broken.is_set():
            self.spy.broken.clear()
            raise StoreUnavailable("change stream ended (test)")
        await asyncio.sleep(self.spy.lag)
        return await self.inner.next(wait)

    async def close(self) -> None:
        await self.inner.close()


def count_scans(w: Worker) -> list[int]:
    """Count the full catch-up sweeps discovery asks for (a stream opened without a resume
    token, or lost history): the returned list grows by one for each."""
    scans: list[int] = []
    inner = w.discovery.sweep_at

    def sweep_at(when: Any) -> None:
        if when is None:
            scans.append(1)
        inner(when)

    w.discovery.sweep_at = sweep_at
    return scans


def hear_inserts(w: Worker) -> list[str]:
    """Wrap the worker's discovery: the returned list grows by the key of each insert its stream delivers."""
    inserted: list[str] = []
    on_event = w.discovery.on_event

    def record(event: ChangeEvent) -> None:
        if event.kind == "insert" and event.key is not None:
            inserted.append(event.key)
        on_event(event)

    w.discovery.on_event = record  # type: ignore[method-assign]
    return inserted


async def later_than(store: Store, moment: datetime) -> bool:
    """Whether the server's clock has passed ``moment``."""
    return await store.server_time() > moment


def count_sweeps(runner: TaskRunner) -> list[int]:
    """Wrap ``runner.store.due``; the returned list grows by the tasks each sweep read."""
    sweeps: list[int] = []
    inner = runner.store.due

    async def due(worker_id: str, names: Any, *, horizon: Any, limit: int = 100, apart: Any = ()) -> Page:
        page = await inner(worker_id, names, horizon=horizon, limit=limit, apart=apart)
        sweeps.append(len(page.tasks))
        return page

    runner.store.due = due  # type: ignore[method-assign]
    return sweeps


# -- the gaps ---------------------------------------------------------------------------------
async def test_gap_01_run_at_is_respected(runner: TaskRunner) -> None:
    """Gap 1 (run time never read): a task with ``run_at`` or ``delay`` is claimed no earlier
    than that server time, promptly after it, and after a task due now."""
    claimed: list[str] = []

    @runner.task("job")
    async def job(params: Params, ctx: TaskContext) -> None:
        claimed.append(ctx.key)

    async with running(worker(runner, "w1", concurrency=4)):
        now = await runner.store.server_time()
        later = await runner.publish("job", key="later", run_at=now + timedelta(seconds=3))
        delayed = await runner.publish("job", key="delayed", delay=1.5)
        due = await runner.publish("job", key="due")
        assert delayed.run_at >= now + timedelta(seconds=1.5)
        await wait_for(lambda: len(claimed) == 3)
        await wait_for(state_is(runner, "later", TaskState.SUCCESS))
    assert claimed == ["due", "delayed", "later"]
    for published in (due, delayed, later):
        [entry] = (await runner.get(published.key)).workers
        assert entry.claimed_at >= published.run_at
        assert entry.claimed_at - published.run_at < timedelta(seconds=10)


async def test_gap_02_priority_backoff_result_and_error_are_used(runner: TaskRunner) -> None:
    """Gap 2 (priority, retry delay, returns, fail_reason unused): a one-slot worker runs
    higher priorities first, stores the handler's return value and the failure's error,
    and a failure moves ``run_at`` to its finish time plus ``retry_backoff``."""
    order: list[str] = []

    @runner.task("job")
    async def job(params: Params, ctx: TaskContext) -> dict[str, int]:
        order.append(ctx.key)
        if params.get("fail"):
            raise ValueError("bad input: fail=1")
        return {"doubled": 2 * params["n"]}

    for key, priority in (("p1", 1), ("p5", 5), ("p3", 3)):
        await runner.publish("job", {"n": priority}, key=key, priority=priority)
    await runner.publish("job", {"fail": 1}, key="boom", priority=-1, max_failures=2, retry_backoff=300)
    async with running(worker(runner, "w1")):
        await wait_for(lambda: len(order) == 4)
        await wait_for(state_is(runner, "p1", TaskState.SUCCESS))

        async def boom_failed() -> bool:
            return (await runner.get("boom")).failures == 1

        await wait_for(boom_failed)
    assert order == ["p5", "p3", "p1", "boom"]
    assert [(await runner.get(k)).workers[0].result for k in ("p1", "p3", "p5")] == [
        {"doubled": 2},
        {"doubled": 6},
        {"doubled": 10},
    ]
    boom = await runner.get("boom")
    [entry] = boom.workers
    assert entry.state is EntryState.FAIL and entry.result is None
    assert entry.error is not None and entry.error.type == "ValueError"
    assert entry.error.message == "bad input: fail=1" and "Traceback" in (entry.error.traceback or "")
    assert entry.finished_at is not None
    assert boom.state is TaskState.PENDING
    assert boom.run_at == boom.claimable_at == entry.finished_at + timedelta(seconds=300)


async def test_gap_03_retry_delay_is_not_overridden_by_the_fail_event(runner: TaskRunner) -> None:
    """Gap 3 (the fail event makes the task claimable at once): after a failure no worker can
    claim the task before ``retry_backoff`` has passed on the server's clock, although the
    failure's change event reaches the worker at once."""
    calls: list[str] = []

    @runner.task("job")
    async def job(params: Params, ctx: TaskContext) -> None:
        calls.append(ctx.run_id)
        if len(calls) == 1:
            raise ValueError("first run fails")

    await runner.publish("job", key="k", retry_backoff=1.5, max_failures=3)
    async with running(worker(runner, "w1", concurrency=2)):
        await wait_for(lambda: len(calls) == 1)

        async def failed() -> bool:
            return (await runner.get("k")).failures == 1

        await wait_for(failed)
        assert await runner.store.claim("other", key="k") is None  # not claimable "now"
        await wait_for(state_is(runner, "k", TaskState.SUCCESS))
    task = await runner.get("k")
    first, second = task.workers
    assert (first.state, second.state) == (EntryState.FAIL, EntryState.SUCCESS)
    assert first.finished_at is not None
    assert second.claimed_at >= first.finished_at + timedelta(seconds=1.5)
    assert len(calls) == 2 and task.failures == 1 and task.attempts == 2


async def test_gap_04_success_needs_concurrency_successes(store: Store) -> None:
    """Gap 4 (successes compared with max retries): a task is SUCCESS once ``concurrency``
    distinct workers succeeded, whatever ``max_failures`` is."""
    await store.publish([new("c3", concurrency=3, max_failures=1), new("c1", concurrency=1, max_failures=5)])
    for i, w in enumerate(["w1", "w2", "w3"]):
        claim = await store.claim(w, key="c3")
        assert claim is not None
        task = await runs.succeed(store, "c3", claim.run_id, i)
        assert task.state is (TaskState.SUCCESS if i == 2 else TaskState.PENDING)
    assert await store.claim("w4", key="c3") is None

    claim = await store.claim("w1", key="c1")
    assert claim is not None
    assert (await runs.succeed(store, "c1", claim.run_id)).state is TaskState.SUCCESS
    assert await store.claim("w2", key="c1") is None
    assert [(await store.get(k)).successes for k in ("c3", "c1")] == [3, 1]


async def test_gap_05_claim_filter_checks_worker_ids(store: Store) -> None:
    """Gap 5 (the claim never re-checks specific_worker_ids): a worker outside ``worker_ids``
    cannot claim the task even by key; a listed worker can."""
    await store.publish([new("mine", worker_ids=["a", "b"])])
    assert await store.claim("c", key="mine") is None
    assert await store.claim("c") is None
    task = await store.get("mine")
    assert rules.next_claim(task, "c") is None and rules.next_claim(task, "a") is not None
    claim = await store.claim("b", key="mine")
    assert claim is not None and claim.entry.worker_id == "b"


async def test_gap_06_worker_never_reruns_a_task_it_succeeded(store: Store) -> None:
    """Gap 6 (a worker may run a task again after succeeding on it): with a free slot left,
    the worker that succeeded can no longer claim the task; another worker can."""
    await store.publish([new("twice", concurrency=2)])
    claim = await store.claim("w1", key="twice")
    assert claim is not None
    task = await runs.succeed(store, "twice", claim.run_id)
    assert task.state is TaskState.PENDING
    assert rules.next_claim(task, "w1") is None
    assert await store.claim("w1", key="twice") is None
    assert await store.claim("w1") is None
    other = await store.claim("w2")
    assert other is not None and other.task.key == "twice"
    assert (await runs.succeed(store, "twice", other.run_id)).state is TaskState.SUCCESS
    assert [w.worker_id for w in (await store.get("twice")).workers] == ["w1", "w2"]


async def test_gap_07_free_slot_is_claimable_at_the_earliest_lease_expiry(runner: TaskRunner) -> None:
    """Gap 7 (a late worker waits for the latest ping expiry): with both slots held, the task
    is claimable when the earliest lease expires, and a third worker takes that slot while
    the other, freshly renewed lease is still live."""
    ran: list[str] = []

    @runner.task("job", concurrency=2, ping_interval=1, ping_timeout=4)
    async def job(params: Params, ctx: TaskContext) -> None:
        ran.append(ctx.worker_id)

    store = runner.store
    await runner.publish("job", key="k")
    dead = await store.claim("dead", key="k")  # never pings
    assert dead is not None
    await wait_for(lambda: later_than(store, dead.entry.claimed_at), what="server time to move on")
    alive = await store.claim("alive", key="k")
    assert dead is not None and alive is not None
    task = await store.get("k")
    assert task.claimable_at == dead.entry.expires_at < alive.entry.expires_at

    async def late_succeeded() -> bool:
        return any(
            w.worker_id == "late" and w.state is EntryState.SUCCESS for w in (await runner.get("k")).workers
        )

    async with running(worker(runner, "late")):
        # Renew the other lease about 1 s before the dead one expires: from then on only
        # the earliest expiry frees a slot (no later write moves claimable_at).
        left = (dead.entry.expires_at - await store.server_time()).total_seconds()
        await asyncio.sleep(max(0.0, left - 1.0))
        pinged = await runs.ping(store, "k", alive.run_id)
        renewed = pinged.entry(alive.run_id)
        assert renewed is not None and renewed.expires_at > dead.entry.expires_at + timedelta(seconds=2)
        assert pinged.claimable_at == dead.entry.expires_at
        await wait_for(late_succeeded)
    assert ran == ["late"]
    task = await store.get("k")
    entries = {w.worker_id: w for w in task.workers}
    assert set(entries) == {"alive", "late"}  # the expired lease was dropped ...
    assert task.failures == 1  # ... and counted as one failed run
    assert dead.entry.expires_at <= entries["late"].claimed_at < renewed.expires_at
    assert entries["alive"].state is EntryState.RUNNING


async def test_gap_08_failure_budget_is_task_wide(runner: TaskRunner) -> None:
    """Gap 8 (per-worker retry budget, workers x retries attempts): three workers together
    run an always-failing task exactly ``max_failures`` times, then it is FAIL."""
    calls: list[str] = []

    @runner.task("job", max_failures=2, retry_backoff=0)
    async def job(params: Params, ctx: TaskContext) -> None:
        calls.append(ctx.worker_id)
        raise RuntimeError("always fails")

    workers = [worker(runner, f"w{i}") for i in range(3)]
    async with running(*workers):
        await runner.publish("job", key="k")
        await wait_for(state_is(runner, "k", TaskState.FAIL))
        await asyncio.sleep(0.5)  # give any worker with a budget of its own time to claim
    task = await runner.get("k")
    assert len(calls) == 2 and task.failures == 2 and task.attempts == 2
    assert [w.state for w in task.workers] == [EntryState.FAIL, EntryState.FAIL]
    for w in workers:
        assert await runner.store.claim(w.worker_id, key="k") is None


async def test_gap_09_sweeps_reach_every_task_and_keep_due_keys(runner: TaskRunner) -> None:
    """Gap 9 (first-10 batch restarting from the top; due keys dropped while full): sweeps
    read past their limit to every task written before the worker started, and tasks that
    fall due while the only slot is busy still run afterwards, by priority."""
    order: list[str] = []
    gate = Gate()

    @runner.task("job")
    async def job(params: Params, ctx: TaskContext) -> None:
        order.append(ctx.key)
        if ctx.key == "block":
            await gate()

    keys = [f"k{i:02}" for i in range(10)]
    for key in keys:  # before the worker starts: only a sweep can find them
        await runner.publish("job", key=key)
    w = worker(runner, "w1")
    sweeps = count_sweeps(runner)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr("taskrunner.engine.worker.SWEEP_LIMIT", 3)
    try:
        async with running(w):
            await wait_for(lambda: sorted(order) == keys)
            assert sweeps[:4] == [3, 3, 3, 1] or sum(sweeps) >= 10

            await runner.publish("job", key="block")
            await asyncio.wait_for(gate.entered.wait(), 20)
            delayed = [
                await runner.publish("job", key=key, priority=priority, delay=0.3)
                for key, priority in (("d1", 1), ("d3", 3), ("d2", 2))
            ]
            # Their time comes while the only slot is busy.
            await wait_for(lambda: all(t.key in w.queue for t in delayed), what="the worker to queue them")
            due = max(t.run_at for t in delayed)
            await wait_for(lambda: later_than(runner.store, due), what="their run_at to pass")
            assert order[-1] == "block" and all(t.key in w.queue for t in delayed)
            gate.opened.set()
            await wait_for(lambda: len(order) == 14)
    finally:
        monkeypatch.undo()
    assert order[-3:] == ["d3", "d2", "d1"]


async def test_gap_10_event_bursts_while_busy_are_not_dropped(runner: TaskRunner) -> None:
    """Gap 10 (bounded channel drops events on lag, can stop fetching): a burst of 100 new
    tasks while the only slot is busy, through a claim queue of capacity 16, runs every
    task exactly once, and discovery still follows the stream afterwards."""
    counts: dict[str, int] = {}
    gate = Gate()

    @runner.task("job")
    async def job(params: Params, ctx: TaskContext) -> None:
        counts[ctx.key] = counts.get(ctx.key, 0) + 1
        if ctx.key == "block":
            await gate()

    w = worker(runner, "w1", queue_capacity=16)
    sweeps = count_sweeps(runner)
    heard = hear_inserts(w)
    burst = [f"n{i:03}" for i in range(100)]
    async with running(w):
        await runner.publish("job", key="block")
        await asyncio.wait_for(gate.entered.wait(), 20)
        await runner.publish_many([{"name": "job", "key": k} for k in burst[:50]])
        for key in burst[50:]:
            await runner.publish("job", key=key)
        await wait_for(lambda: set(burst) <= set(heard), what="the burst to reach the worker")
        assert counts == {"block": 1}
        gate.opened.set()
        await wait_for(lambda: len(counts) == 101, within=40)
        assert len(sweeps) >= 2  # what the overflowed queue evicted, sweeps found again
        await runner.publish("job", key="after")
        await wait_for(lambda: "after" in counts)
        await wait_for(state_is(runner, "after", TaskState.SUCCESS))
    assert set(counts) == {"block", "after", *burst} and set(counts.values()) == {1}
    assert await runner.store.count(state=TaskState.SUCCESS) == 102


@pytest.mark.parametrize("skew", [-3600.0, 3600.0], ids=["worker_1h_behind", "worker_1h_ahead"])
async def test_gap_11_leases_and_schedule_follow_the_server_clock(
    runner: TaskRunner, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    """Gap 11 (client and server clocks mixed): with the worker's clock an hour off, tasks
    still run promptly and not before ``run_at``, and every lease time is server time
    (``expires_at`` = server ``claimed_at`` + ``ping_timeout``)."""
    real_time = time.time

    class SkewedTime:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def time() -> float:
            return real_time() + skew

    claimed: list[str] = []

    @runner.task("job", ping_interval=1, ping_timeout=40)
    async def job(params: Params, ctx: TaskContext) -> None:
        claimed.append(ctx.key)

    w = worker(runner, "w1", concurrency=2)
    # The worker's clock reads this machine's time where its class is defined: skew it there.
    monkeypatch.setattr(sys.modules[type(w.clock).__module__], "time", SkewedTime())
    async with running(w):
        before = await runner.store.server_time()
        due = await runner.publish("job", key="due")
        delayed = await runner.publish("job", key="delayed", delay=1.5)
        await wait_for(lambda: claimed == ["due", "delayed"], within=15)
        await wait_for(state_is(runner, "delayed", TaskState.SUCCESS))
        after = await runner.store.server_time()
        assert abs(w.clock.now() - after.timestamp()) < 5
        assert abs(w.clock.offset + skew) < 60
    for published in (due, delayed):
        [entry] = (await runner.get(published.key)).workers
        assert before - timedelta(seconds=1) <= entry.claimed_at <= after + timedelta(seconds=1)
        assert published.run_at <= entry.claimed_at < published.run_at + timedelta(seconds=10)
        assert entry.expires_at == entry.claimed_at + timedelta(seconds=40)


async def test_gap_12_update_pending_never_touches_running_task(store: Store) -> None:
    """Gap 12 (the "don't update running" filter never matches; relies on the unique index):
    republishing a running key with ``update_pending`` returns it unchanged without an
    error or a second document, even with no unique index, and updates a pending key."""
    if isinstance(store, MongoStore):
        await store.collection.drop_index("key_unique")
    await store.publish([NewTask.build(key="run", name="job", params={"v": 1})])
    await store.publish([NewTask.build(key="wait", name="job", params={"v": 1})])
    claim = await store.claim("w1", key="run")
    assert claim is not None
    [again] = await store.publish(
        [NewTask.build(key="run", name="job", params={"v": 2}, priority=9)], update_pending=True
    )
    assert not again.created and again.state is TaskState.RUNNING
    assert again.params == {"v": 1} and again.priority == 0
    assert [w.run_id for w in again.workers] == [claim.run_id]
    [pending] = await store.publish(
        [NewTask.build(key="wait", name="job", params={"v": 2})], update_pending=True
    )
    assert not pending.created and pending.params == {"v": 2}
    assert await store.count() == 2
    assert (await runs.succeed(store, "run", claim.run_id)).state is TaskState.SUCCESS


async def test_gap_13_shutdown_stops_handlers_and_releases_without_failure(runner: TaskRunner) -> None:
    """Gap 13 (shutdown marks tasks failed without stopping handlers): stopping a worker
    cancels its handler after ``shutdown_timeout`` and releases the claim without spending
    budget, so another worker takes the task at once (long before the lease would expire)."""
    ticks: list[str] = []
    cancelled: list[str] = []

    @runner.task("job", ping_interval=5, ping_timeout=120)
    async def job(params: Params, ctx: TaskContext) -> None:
        if ctx.worker_id == "w2":
            return
        try:
            while True:
                ticks.append(ctx.worker_id)
                await asyncio.sleep(0.05)
        finally:
            cancelled.append(ctx.worker_id)

    first = worker(runner, "w1", shutdown_timeout=0.3)
    await runner.publish("job", key="k")
    async with running(first):
        await wait_for(lambda: len(ticks) >= 3)
    assert cancelled == ["w1"]
    stopped_at = len(ticks)
    task = await runner.get("k")
    assert task.state is TaskState.PENDING and task.workers == []
    assert task.failures == 0 and task.attempts == 1
    assert task.claimable_at is not None and task.claimable_at <= await runner.store.server_time()

    async with running(worker(runner, "w2")):
        await wait_for(state_is(runner, "k", TaskState.SUCCESS), within=20)
    assert len(ticks) == stopped_at  # the handler really stopped: not one tick while w2 ran the task
    task = await runner.get("k")
    assert [(w.worker_id, w.state) for w in task.workers] == [("w2", EntryState.SUCCESS)]
    assert task.failures == 0 and task.attempts == 2


async def test_gap_14_one_stream_delivers_every_event_in_order(
    runner: TaskRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gap 14 (resubscribing per wait misses events): with a lagging consumer and the only
    slot busy, 30 publishes made between reads all arrive in commit order through the one
    stream opened at start (no reopen, no rescan), and each task then runs once."""
    counts: dict[str, int] = {}
    gate = Gate()

    @runner.task("job")
    async def job(params: Params, ctx: TaskContext) -> None:
        counts[ctx.key] = counts.get(ctx.key, 0) + 1
        if ctx.key == "block":
            await gate()

    spy = WatchSpy(runner.store)
    monkeypatch.setattr(runner.store, "watch", spy)
    w = worker(runner, "w1")
    scans = count_scans(w)
    inserted = hear_inserts(w)
    keys = [f"e{i:02}" for i in range(30)]
    async with running(w):
        await runner.publish("job", key="block")
        await asyncio.wait_for(gate.entered.wait(), 20)
        spy.lag = 0.05
        for key in keys:
            await runner.publish("job", key=key)
        await wait_for(lambda: len(inserted) == 30)
        assert inserted == keys
        spy.lag = 0.0
        gate.opened.set()
        await wait_for(lambda: len(counts) == 31, within=30)
    assert len(spy.calls) == 1 and len(scans) == 1
    assert set(counts.values()) == {1}


async def test_gap_15_stopped_worker_is_really_stopped(runner: TaskRunner) -> None:
    """Gap 15 (a dropped join handle taken for a stopped consumer): once ``run()`` of a
    stopped worker returns, none of its side tasks or runs is left and it claims nothing
    more; a task published afterwards waits for another worker."""
    ran: list[tuple[str, str]] = []

    @runner.task("job")
    async def job(params: Params, ctx: TaskContext) -> None:
        ran.append((ctx.key, ctx.worker_id))

    first = worker(runner, "w1")
    async with running(first) as [handle]:
        await runner.publish("job", key="a")
        await wait_for(state_is(runner, "a", TaskState.SUCCESS))
    assert handle.done() and handle.exception() is None
    side = {"discovery", "claimer", "clock"}
    runs = ("run:", "handler:", "heartbeat:")
    leftovers = [t for t in asyncio.all_tasks() if t.get_name() in side or t.get_name().startswith(runs)]
    assert leftovers == [] and first.runs == {}

    await runner.publish("job", key="b")
    await asyncio.sleep(1.0)  # a worker that had not really stopped would claim it now
    b = await runner.get("b")
    assert b.state is TaskState.PENDING and b.attempts == 0
    async with running(worker(runner, "w2")):
        await wait_for(state_is(runner, "b", TaskState.SUCCESS))
    assert ran == [("a", "w1"), ("b", "w2")]


async def test_gap_16_key_is_the_only_unique_index(runner: TaskRunner) -> None:
    """Gap 16 (a useless second unique index ``{key, worker_id}``): ``key_unique`` on ``key``
    is the one unique index besides ``_id``, declared and created."""
    declared = {name: keys for name, (keys, options) in f.INDEXES.items() if options.get("unique")}
    assert declared == {"key_unique": [(f.KEY, 1)]}
    store = runner.store
    assert isinstance(store, MongoStore)
    info = await store.collection.index_information()
    unique = {
        name: [tuple(k) for k in spec["key"]]
        for name, spec in info.items()
        if spec.get("unique") and name != "_id_"
    }
    assert unique == {"key_unique": [(f.KEY, 1)]}
    assert set(info) == {"_id_", *f.INDEXES}
    assert not any(f.WORKER_ID in str(spec["key"]) for spec in info.values() if spec.get("unique"))


async def test_gap_no_reconnect_stream_resumes(runner: TaskRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing remark (no reconnect: the consumer returns when the stream ends): when the
    change stream fails, discovery reopens it from its resume token, so a task published
    while it was down runs, without a rescan."""
    ran: list[str] = []

    @runner.task("job")
    async def job(params: Params, ctx: TaskContext) -> None:
        ran.append(ctx.key)

    spy = WatchSpy(runner.store)
    monkeypatch.setattr(runner.store, "watch", spy)
    w = worker(runner, "w1")
    scans = count_scans(w)
    async with running(w):
        await runner.publish("job", key="a")
        await wait_for(lambda: ran == ["a"])
        spy.reopen.clear()
        spy.broken.set()
        await wait_for(lambda: len(spy.calls) == 2)  # discovery is reopening; hold it closed
        await runner.publish("job", key="b")  # written while no stream is open
        spy.reopen.set()
        await wait_for(lambda: ran == ["a", "b"])
        await wait_for(state_is(runner, "b", TaskState.SUCCESS))
    assert spy.calls[0] is None and spy.calls[1] is not None
    assert len(scans) == 1
