"""Network faults between worker processes and the server, injected by tests/fault_proxy.py.

Workers reach the server through a ``FaultProxy``; the test itself (publisher, checks)
talks to the server directly. Each test asserts what docs/operations.md (Guarantees)
promises: a run that cannot confirm its lease for ``ping_timeout`` stops its handler
itself (self-fencing) before anyone can take it over, an outage is logged once per
state change and waited out cheaply, and a slow but working network keeps leases alive.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy
from workers import WorkerPool, WorkerProcess

from taskrunner import EntryState, Task, TaskRunner, TaskState
from taskrunner.errors import StoreUnavailable, TaskNotFound
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

Doc = dict[str, Any]
UNCONFIRMED = "lease unconfirmed for ping_timeout"
WORKER_ARGS = ("--timeout", "1", "--concurrency", "2", "--beat-interval", "1")
SLACK = 10.0  # what a busy host may add to anything timed here


@pytest.fixture
def proxy(mongo_uri: str) -> Iterator[FaultProxy]:
    with FaultProxy(mongo_uri) as p:
        yield p


def through(proxy: FaultProxy) -> tuple[str, ...]:
    """Worker options that connect through ``proxy``."""
    return ("--mongo-uri", proxy.uri, *WORKER_ARGS)


async def done(runner: TaskRunner, key: str) -> Task | None:
    task = await runner.get(key)
    return task if task.state.finished else None


async def running(runner: TaskRunner, key: str) -> Doc | None:
    """The RUNNING entry of ``key`` once it has been pinged at least twice after its claim."""
    task = await runner.get(key)
    for entry in task.workers:
        if entry.state is EntryState.RUNNING and (entry.ping_at - entry.claimed_at).total_seconds() >= 0.9:
            return {"worker_id": entry.worker_id, "run_id": entry.run_id, "ping_at": entry.ping_at}
    return None


def logged_at(event: Doc) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


async def discovery_back(worker: WorkerProcess, since: float) -> float:
    """Seconds from ``since`` (wall clock) until the worker's change stream was back."""
    found = await wait_for(lambda: worker.find("discovery recovered"), 30, f"{worker.worker_id}'s discovery")
    return logged_at(found[0]) - since


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def noisy(lines: list[Doc]) -> Counter[str]:
    """Warning and error lines by event name."""
    return Counter(str(e.get("event")) for e in lines if e.get("level") in ("warning", "error"))


async def test_partitioned_worker_fences_itself_and_resumes_after_heal(
    runner: TaskRunner, proxy: FaultProxy, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A partitioned worker cancels its handler after ping_timeout, before the takeover; healed, it works again."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        w1 = pool.start("w1", *through(proxy))
        await wait_for(lambda: w1.find("worker started"), 60, "w1 to start")
        lease: dict[str, Any] = {"ping_interval": 0.5, "ping_timeout": 2.0}
        await runner.publish("sleep", {"seconds": 0.3, "first_seconds": 60}, key="victim", **lease)
        # Finishes during the partition (its gate opens then), before its longer lease runs
        # out: its outcome cannot be written.
        gate = tmp_path / "partitioned"
        await runner.publish(
            "sleep",
            {"seconds": 0.3, "first_seconds": 0.5, "first_gate": str(gate)},
            key="short",
            ping_interval=0.5,
            ping_timeout=4.0,
        )
        claim = await wait_for(lambda: running(runner, "victim"), 30, "w1 to claim and ping")
        assert claim["worker_id"] == "w1"
        assert (await wait_for(lambda: running(runner, "short"), 30, "w1 to claim short"))[
            "worker_id"
        ] == "w1"
        w2 = pool.start("w2", *WORKER_ARGS)  # direct: on the server's side of the partition
        await wait_for(lambda: w2.find("worker started"), 60, "w2 to start")

        proxy.blackhole()
        gate.touch()
        last_ping = (await runner.get("victim")).entry(claim["run_id"])
        assert last_ping is not None
        [fenced] = await wait_for(lambda: w1.find("stopping run", reason=UNCONFIRMED), 15, "w1 to self-fence")
        final = await wait_for(lambda: done(runner, "victim"), 30, "the takeover to finish")
        unwritten = await wait_for(
            lambda: w1.find("could not write the run's outcome", key="short"), 20, "w1 to give up on short"
        )
        short = await wait_for(lambda: done(runner, "short"), 30, "the takeover of short to finish")
        cancelled = pool.marks(key="victim", event="cancelled")
        starts = pool.marks(key="victim", event="start")

        proxy.heal()
        healed = time.monotonic()
        await runner.publish("quick", key="after-heal", worker_ids=["w1"])
        after = await wait_for(lambda: done(runner, "after-heal"), 30, "w1 to work again")
        recovery = time.monotonic() - healed

    fence_delay = logged_at(fenced) - last_ping.ping_at.timestamp()
    print(
        f"self-fenced {fence_delay:.2f}s after the last confirmed ping (ping_timeout 2s); "
        f"back to work {recovery:.2f}s after heal"
    )
    assert fence_delay <= 2.0 + 0.5
    # The handler was cancelled (self-fencing) before the other worker started it.
    assert [(m["worker_id"], m["ctx_cancelled"]) for m in cancelled] == [("w1", True)]
    assert [m["worker_id"] for m in starts] == ["w1", "w2"]
    assert cancelled[0]["t"] < starts[1]["t"]
    assert final.state is TaskState.SUCCESS
    [entry] = [e for e in final.workers if e.state is EntryState.SUCCESS]
    assert (entry.worker_id, entry.took_over) == ("w2", ["w1"])
    assert pool.marks(key="victim", event="finish", worker_id="w1") == []
    assert not w1.find("run succeeded", key="victim") and not w1.find("run failed", key="victim")
    assert after.state is TaskState.SUCCESS and [e.worker_id for e in after.workers] == ["w1"]
    # A handler that finished in the partition: its write gave up (bounded), the takeover's result stands.
    assert unwritten and not w1.find("run succeeded", key="short")
    assert [m["worker_id"] for m in pool.marks(key="short", event="finish")] == ["w1", "w2"]
    assert short.state is TaskState.SUCCESS
    assert [(e.worker_id, e.state) for e in short.workers] == [("w2", EntryState.SUCCESS)]


async def test_server_outage_is_waited_out_quietly_and_cheaply(
    runner: TaskRunner, proxy: FaultProxy, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """20 s without a server: one log line per state change, no handler on an unconfirmed lease, < 5 % CPU,
    back within seconds; publishing meanwhile fails with StoreUnavailable after its timeout, writing nothing."""
    outage = 20.0
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = pool.start_many(["w1", "w2"], *through(proxy))
        await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")
        lease: dict[str, Any] = {"ping_interval": 0.5, "ping_timeout": 2.0}
        await runner.publish("sleep", {"seconds": 0.3, "first_seconds": 60}, key="victim", **lease)
        claim = await wait_for(lambda: running(runner, "victim"), 30, "a claim and two pings")
        owner = next(w for w in workers if w.worker_id == claim["worker_id"])
        before = {w.worker_id: len(w.logs()) for w in workers}

        proxy.drop()
        dropped, dropped_wall = time.monotonic(), time.time()
        async with TaskRunner(proxy.uri, collection=collection_name, timeout=2) as cut_off:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await cut_off.publish("quick", key="during-outage")
            publish_failed_after = time.monotonic() - started
        with pytest.raises(TaskNotFound):
            await runner.get("during-outage")
        [fenced] = await wait_for(lambda: owner.find("stopping run", reason=UNCONFIRMED), 15, "self-fencing")

        await wait_for(lambda: time.monotonic() - dropped >= 5.0, 10, "the outage to settle")
        cpu_start = {w.worker_id: cpu_seconds(w.pid) for w in workers}
        measured = time.monotonic()
        await wait_for(
            lambda: time.monotonic() - dropped >= outage, outage, "the outage to end", interval=0.2
        )
        cpu = {
            w.worker_id: (cpu_seconds(w.pid) - cpu_start[w.worker_id]) / (time.monotonic() - measured)
            for w in workers
        }
        during = {w.worker_id: w.logs()[before[w.worker_id] :] for w in workers}

        proxy.heal()
        healed, healed_wall = time.monotonic(), time.time()
        await runner.publish("quick", key="after-outage")
        after = await wait_for(lambda: done(runner, "after-outage"), 30, "a task published after the outage")
        recovery = time.monotonic() - healed
        victim = await wait_for(lambda: done(runner, "victim"), 30, "the fenced task to be taken over")
        back = {w.worker_id: await discovery_back(w, healed_wall) for w in workers}
        recovered = {
            w.worker_id: [e["event"] for e in w.logs() if str(e.get("event")).endswith("recovered")]
            for w in workers
        }
        assert all(w.alive() for w in workers)

    fence_delay = logged_at(fenced) - dropped_wall
    counts = {worker_id: noisy(lines) for worker_id, lines in during.items()}
    print(
        f"publish failed after {publish_failed_after:.2f}s; self-fenced {fence_delay:.2f}s after the drop; "
        f"CPU {', '.join(f'{k} {v:.1%}' for k, v in cpu.items())}; recovered in {recovery:.2f}s; "
        f"discovery back after {back}; warning/error lines during the outage {counts}; "
        f"recovery lines {recovered}"
    )
    assert 1.5 <= publish_failed_after <= 8.0
    assert fence_delay <= 2.0 + SLACK  # ping_timeout after the last confirmed ping, on a busy host later
    assert [(m["worker_id"], m["ctx_cancelled"]) for m in pool.marks(key="victim", event="cancelled")] == [
        (owner.worker_id, True)
    ]
    assert all(share < 0.05 for share in cpu.values()), cpu
    for worker_id, count in counts.items():
        assert all(n <= 2 for n in count.values()), (worker_id, count)  # per component, not per attempt
        assert sum(count.values()) <= 8, (worker_id, count)
        assert count["discovery lost the server; retrying"] == 1, (worker_id, count)
    # Within the 5 s cap of the outage backoff, with room for a busy host.
    assert all(seconds <= 5.0 + SLACK for seconds in back.values()), back
    assert recovery <= 5.0 + SLACK
    assert after.state is TaskState.SUCCESS
    assert victim.state is TaskState.SUCCESS and len(pool.marks(key="victim", event="finish")) == 1


async def test_slow_server_keeps_leases_alive(
    runner: TaskRunner, proxy: FaultProxy, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """With 0.2 s per chunk (a ping round trip ~0.4 s < ping_timeout 3 s) the first worker finishes; no takeover."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        w1 = pool.start("w1", *through(proxy))
        await wait_for(lambda: w1.find("worker started"), 60, "w1 to start")
        lease: dict[str, Any] = {"ping_interval": 0.5, "ping_timeout": 3.0}
        await runner.publish("sleep", {"seconds": 6}, key="slow", **lease)
        claim = await wait_for(lambda: running(runner, "slow"), 30, "w1 to claim and ping")
        proxy.latency(0.2)
        w2 = pool.start("w2", *WORKER_ARGS)  # direct, ready to take over an expired lease
        final = await wait_for(lambda: done(runner, "slow"), 30, "the task to finish")
        w2_claims = w2.find("claimed")

    assert claim["worker_id"] == "w1"
    assert final.state is TaskState.SUCCESS and (final.attempts, final.failures) == (1, 0)
    assert [(e.worker_id, e.state) for e in final.workers] == [("w1", EntryState.SUCCESS)]
    assert not w1.find("stopping run") and not w2_claims
    assert [m["worker_id"] for m in pool.marks(key="slow", event="start")] == ["w1"]
    # w2 was there to take over, had a lease lapsed: it started before the task finished.
    [w2_started] = w2.find("worker started")
    [entry] = final.workers
    assert entry.finished_at is not None
    assert datetime.fromisoformat(w2_started["timestamp"]) < entry.finished_at, (w2_started, entry)
