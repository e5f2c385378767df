"""Batching in the worker: group-committed run writes, one shared heartbeat, batched claims
(memory store, counting every store call the way round trips would be counted)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from support import run_until

from taskrunner import MemoryStore, TaskContext, TaskRunner, TaskState
from taskrunner.engine.heartbeat import Heartbeat, RunLease
from taskrunner.engine.worker import Worker
from taskrunner.engine.writes import RunWrites
from taskrunner.store.base import Claim, Claimed, RunResult, RunStatus, RunWrite
from taskrunner.testing import wait_for


class CountingStore(MemoryStore):
    """Counts the calls that would each be one round trip, and what each batch carried."""

    def __init__(self, *, delay: float = 0.0) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.batches: list[list[RunWrite]] = []
        self.claimed: list[int] = []  # tasks each claim_many took
        self.delay = delay
        self.on_the_wire = asyncio.Event()  # set when a first batch is sent

    async def write_runs(self, writes: Sequence[RunWrite]) -> list[RunResult]:
        self.calls["write_runs"] += 1
        self.batches.append(list(writes))
        self.on_the_wire.set()
        await asyncio.sleep(self.delay)  # a round trip takes time; writes meanwhile queue up
        return await super().write_runs(writes)

    async def claim(self, worker_id: str, **kwargs: Any) -> Claim | None:
        self.calls["claim"] += 1
        return await super().claim(worker_id, **kwargs)

    async def claim_many(self, worker_id: str, keys: Sequence[str], **kwargs: Any) -> Claimed:
        self.calls["claim_many"] += 1
        claimed = await super().claim_many(worker_id, keys, **kwargs)
        self.claimed.append(len(claimed.claims))
        return claimed


def app(store: MemoryStore, seconds: float = 0.0) -> tuple[TaskRunner, list[str]]:
    runner = TaskRunner(store=store)
    done: list[str] = []

    @runner.task("job")
    async def job(params: dict[str, Any], ctx: TaskContext) -> None:
        await asyncio.sleep(seconds)
        done.append(ctx.key)

    return runner, done


async def test_writes_submitted_during_a_round_trip_go_out_together() -> None:
    """Group commit: the first write leaves alone, the ones queued behind it share one batch."""
    store = CountingStore(delay=0.05)
    await store.publish([TaskRunner(store=store).new_task({"name": "job", "key": f"k{i}"}) for i in range(5)])
    claims = (await store.claim_many("w1", [f"k{i}" for i in range(5)])).claims
    writes = RunWrites(store)
    submit = [writes.submit(RunWrite("success", c.task.key, c.run_id, "w1", i)) for i, c in enumerate(claims)]
    first = asyncio.create_task(submit[0])
    await asyncio.wait_for(store.on_the_wire.wait(), 10)
    assert not first.done(), "the first batch's round trip ended before the others were submitted"
    results = await asyncio.gather(first, *submit[1:])
    assert results == [RunStatus.DONE] * 5
    assert [len(b) for b in store.batches] == [1, 4]
    assert [(await store.get(f"k{i}")).state for i in range(5)] == [TaskState.SUCCESS] * 5


async def test_fifty_runs_cost_about_one_renewal_write_per_interval() -> None:
    """1 worker x 50 long tasks: lease renewals are one write per ping_interval, not 50."""
    store = CountingStore()
    runner, _ = app(store, seconds=30)
    await runner.publish_many([{"name": "job", "key": f"k{i}", "ping_interval": 0.2} for i in range(50)])
    worker = Worker(runner, concurrency=50, worker_id="w1")
    running = asyncio.create_task(worker.run())
    try:
        await wait_for(lambda: len(worker.runs) == 50, what="50 runs")
        await wait_for(lambda: store.calls["write_runs"] >= 1, what="a first renewal")
        before, began = len(store.batches), time.monotonic()
        await wait_for(lambda: len(store.batches) >= before + 5, what="five more renewals")
        took, renewals = time.monotonic() - began, store.batches[before : before + 5]
        # Each write renews every run; a busy machine only spaces them out further.
        assert [len(b) for b in renewals] == [50] * 5 and {w.kind for b in renewals for w in b} == {"ping"}
        assert took >= 4 * 0.2 * 0.9
        tasks = [await store.get(f"k{i}") for i in range(50)]
        assert all(
            t.state is TaskState.RUNNING and t.workers[0].ping_at > t.workers[0].claimed_at for t in tasks
        )
    finally:
        worker.stop()
        await running


async def test_a_shared_renewal_stops_exactly_the_runs_it_lost() -> None:
    """Of three runs, the one whose entry is gone, and the canceled one, stop; the third keeps its lease."""
    store = CountingStore()
    runner, _ = app(store)
    await runner.publish_many([{"name": "job", "key": k, "ping_interval": 0.1} for k in "abc"])
    claims = {c.task.key: c for c in (await store.claim_many("w1", list("abc"))).claims}
    ended: dict[str, RunStatus | None] = {}
    heartbeat = Heartbeat(RunWrites(store), "w1")

    def ender(key: str) -> Callable[[RunStatus | None], None]:
        return lambda status: ended.__setitem__(key, status)

    for key, claim in claims.items():
        heartbeat.add(RunLease(key, claim.run_id, 0.1, 5.0, ender(key)))
    await store.release("a", claims["a"].run_id)
    await runner.cancel("b")
    await wait_for(lambda: len(ended) == 2, what="two runs to end")
    assert ended == {"a": RunStatus.LOST, "b": RunStatus.CANCELED}
    assert len(heartbeat) == 1
    entry = (await store.get("c")).entry(claims["c"].run_id)
    assert entry is not None and entry.ping_at > claims["c"].entry.ping_at
    heartbeat.remove(claims["c"].run_id)


async def test_a_lease_that_cannot_be_renewed_fences_itself_after_ping_timeout() -> None:
    """When renewals keep failing, each run is stopped once its own ping_timeout passes unconfirmed."""

    class Away(CountingStore):
        async def write_runs(self, writes: Sequence[RunWrite]) -> list[RunResult]:
            from taskrunner.errors import StoreUnavailable

            raise StoreUnavailable("MongoDB unavailable: test")

    store = Away()
    runner, _ = app(store)
    await runner.publish_many([{"name": "job", "key": k} for k in "ab"])
    claims = (await store.claim_many("w1", ["a", "b"])).claims
    ended: dict[str, tuple[RunStatus | None, float]] = {}
    loop = asyncio.get_running_loop()
    start = loop.time()
    heartbeat = Heartbeat(RunWrites(store), "w1")

    def ender(key: str) -> Callable[[RunStatus | None], None]:
        return lambda status: ended.__setitem__(key, (status, loop.time() - start))

    for claim, timeout in zip(claims, (0.3, 0.6), strict=True):
        heartbeat.add(RunLease(claim.task.key, claim.run_id, 0.1, timeout, ender(claim.task.key)))
    await wait_for(lambda: len(ended) == 2, what="both runs to fence themselves")
    assert {k: v[0] for k, v in ended.items()} == {"a": None, "b": None}
    # Not before its own timeout (a busy machine may only make each later, never earlier).
    assert 0.3 - 0.05 <= ended["a"][1] <= ended["b"][1] and ended["b"][1] >= 0.6 - 0.05


async def test_free_slots_claim_due_tasks_in_batches() -> None:
    """With ten slots free and 40 tasks due, claims take several tasks per round trip."""
    store = CountingStore()
    runner, done = app(store, seconds=0.05)
    await runner.publish_many([{"name": "job", "key": f"k{i:02}"} for i in range(40)])
    worker = Worker(runner, concurrency=10, worker_id="w1")
    await run_until(worker, lambda: len(done) == 40)
    assert sorted(done) == [f"k{i:02}" for i in range(40)]
    # The first round fills every slot at once; later ones take what frees up together,
    # which a busy machine may make fewer.
    assert store.claimed[0] == 10


async def test_batch_one_claims_one_task_per_round_trip() -> None:
    """``batch=1`` never batches claims."""
    store = CountingStore()
    runner, done = app(store)
    await runner.publish_many([{"name": "job", "key": f"k{i}"} for i in range(12)])
    await run_until(Worker(runner, concurrency=6, worker_id="w1", batch=1), lambda: len(done) == 12)
    assert store.calls["claim_many"] == 0 and store.calls["claim"] >= 12
