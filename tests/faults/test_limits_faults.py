"""Fleet-wide limits (docs/limits.md) under faults, with real ``taskrunner worker`` processes
running tests/apps/limits_app.py: connection drops (tests/fault_proxy.py), a worker frozen
(SIGSTOP) past its gate lease, limits changed live, and write replies lost by the server.

In each, every task finishes, and no window and no instant exceeds the limit in force,
judged from the task documents' server times (every run that wrote an outcome keeps its
``claimed_at`` and ``finished_at``) and, where no worker is frozen, from the handlers'
own ``start``/``finish``/``cancelled`` marks too (a frozen process runs nothing, but its
marks would span the freeze).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy
from pymongo import AsyncMongoClient
from pymongo import errors as pe
from workers import WorkerPool, WorkerProcess

from taskrunner import EntryState, Task, TaskOptionsDict, TaskRunner, TaskSpec, TaskState
from taskrunner.dev.server import EmbeddedServer
from taskrunner.limits.gates import gate_id
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

APP = "apps.limits_app:runner"
Doc = dict[str, Any]
Span = tuple[float, float]
TENANTS = "abcd"
# capped: max_running=2; paced: 5/s; tenant: 2/s and max_running=1 per tenant (limits_app).
RUNNING = {"capped": 2, "tenant": 1}
RATES = {"paced": 5, "tenant": 2}
GRACE = 1.0  # a claim sent just before a worker applied new limits may land this much later


@pytest.fixture
def proxy(mongo_uri: str) -> Iterator[FaultProxy]:
    with FaultProxy(mongo_uri) as p:
        yield p


def mix(capped: int, paced: int, per_tenant: int, seconds: float, tag: str = "") -> Iterator[TaskSpec]:
    """Tasks of the three limited names (keys <tag>c*, <tag>p*, <tag>t<tenant>*), per_tenant
    of each tenant in ``TENANTS``; paced ones are short."""
    for i in range(capped):
        yield {"name": "capped", "key": f"{tag}c{i:02}", "params": {"seconds": seconds}}
    for i in range(paced):
        yield {"name": "paced", "key": f"{tag}p{i:02}", "params": {"seconds": 0.05}}
    for t in TENANTS:
        for i in range(per_tenant):
            yield {"name": "tenant", "key": f"{tag}t{t}{i}", "params": {"seconds": seconds, "tenant": t}}


async def start(pool: WorkerPool, runner: TaskRunner, count: int, *args: str) -> list[WorkerProcess]:
    workers = pool.start_many([f"w{i}" for i in range(count)], "--beat-interval", "0.5", *args)
    await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "the workers to start")
    await wait_for(lambda: _registered(runner, count), 30, "every worker in the registry")
    return workers


async def _registered(runner: TaskRunner, count: int) -> bool:
    return len(await runner.workers()) >= count


async def all_done(runner: TaskRunner, count: int) -> list[Task] | None:
    tasks = await runner.list_tasks(limit=count + 100)
    return tasks if len(tasks) == count and all(t.state is TaskState.SUCCESS for t in tasks) else None


def gate_of(task: Task) -> str:
    return gate_id(task.name, "tenant" if task.name == "tenant" else None, task.params)


def by_gate(tasks: list[Task]) -> dict[str, list[Task]]:
    gates: dict[str, list[Task]] = defaultdict(list)
    for task in tasks:
        gates[gate_of(task)].append(task)
    return gates


def spans(tasks: list[Task]) -> list[Span]:
    """Every run with an outcome, from its claim to its outcome (server times)."""
    return [
        (entry.claimed_at.timestamp(), entry.finished_at.timestamp())
        for task in tasks
        for entry in task.workers
        if entry.finished_at is not None
    ]


def marked_spans(pool: WorkerPool, keys: set[str]) -> list[Span]:
    """Every handler call of these keys, from its start mark to its finish or cancelled mark."""
    runs: dict[str, dict[str, float]] = defaultdict(dict)
    for m in pool.marks():
        if m["key"] in keys:
            runs[m["run_id"]][m["event"]] = m["t"]
    return [(run["start"], run.get("finish", run.get("cancelled", float("inf")))) for run in runs.values()]


def most_at_once(runs: list[Span], starting_after: float = float("-inf")) -> int:
    """The most runs at one instant, looking at the start of each run begun after
    ``starting_after`` (an end and a start at one instant do not overlap)."""
    return max(
        (sum(s <= start < e for s, e in runs) for start, _ in runs if start > starting_after),
        default=0,
    )


def most_in_window(starts: list[float], period: float, starting_after: float = float("-inf")) -> int:
    """The most starts in any window of ``period`` seconds that begins after ``starting_after``."""
    times = sorted(t for t in starts if t > starting_after)
    return max((sum(t <= u < t + period for u in times) for t in times), default=0)


def judge(pool: WorkerPool | None, tasks: list[Task], running: dict[str, int], rates: dict[str, int]) -> None:
    """No gate exceeds its limits: runs at once (documents, and marks when ``pool``) and
    starts in any 1 s window (documents)."""
    for gate, its in by_gate(tasks).items():
        name = its[0].name
        if name in running:
            assert most_at_once(spans(its)) <= running[name], gate
            if pool is not None:
                assert most_at_once(marked_spans(pool, {t.key for t in its})) <= running[name], gate
        if name in rates:
            assert most_in_window([s for s, _ in spans(its)], 1.0) <= rates[name], gate


async def test_connection_drops_leak_no_permit_and_keep_every_limit(
    runner: TaskRunner, proxy: FaultProxy, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """Four workers (server selection timing out after 1 s) reach the server through a
    proxy that drops every connection for 3 s (longer than the registry keeps a silent
    worker), three times, while 86 tasks of three
    limited names run, one of them per tenant; a wave of tasks, some of new tenants, comes
    due a second into each drop, so workers make permits and ask gates while cut off. No
    permit leaks (every gate starts tasks again after each drop), every task finishes, and
    no window or instant exceeds a limit."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        await start(pool, runner, 4, "--mongo-uri", proxy.uri, "--timeout", "1")
        specs = list(mix(capped=12, paced=20, per_tenant=3, seconds=0.4))
        for wave in range(3):
            delay = 4.0 + 6 * wave
            specs += [
                *[
                    spec | {"delay": delay}
                    for spec in mix(capped=3, paced=4, per_tenant=0, seconds=0.4, tag=f"w{wave}")
                ],
                *[
                    TaskSpec(
                        name="tenant", key=f"w{wave}{t}{i}", params={"seconds": 0.4, "tenant": t}, delay=delay
                    )
                    for t in ("a", f"new{wave}a", f"new{wave}b")
                    for i in range(2)
                ],
            ]
        await runner.publish_many(specs)
        published = time.monotonic()
        for wave in range(3):  # the fault's schedule: drops from 3 s to 6 s, 9 to 12, 15 to 18
            await asyncio.sleep(max(0.0, published + 3.0 + 6 * wave - time.monotonic()))
            proxy.drop()
            await asyncio.sleep(3.0)
            proxy.heal()
        tasks = await wait_for(lambda: all_done(runner, len(specs)), 180, "every task to finish")
    judge(pool, tasks, RUNNING, RATES)


async def _at_least(runner: TaskRunner, count: int, name: str | None = None) -> bool:
    return await runner.store.count(state=TaskState.SUCCESS, name=name) >= count


async def test_a_worker_frozen_past_its_gate_lease_keeps_no_run_beyond_max_running(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A worker running a task of max_running=2 is frozen (SIGSTOP) until its running
    slot's lease lapses and another worker takes the slot, while the task's own lease
    (ping_timeout 90 s) still holds. Resumed, it does not record that run (its claim is
    released and the task runs again on a slot): every task finishes, and the documents
    never show more than 2 runs at once."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        workers = await start(pool, runner, 3)
        lease: TaskOptionsDict = {"ping_interval": 2.0, "ping_timeout": 90.0}
        specs = [spec | lease for spec in mix(capped=50, paced=0, per_tenant=0, seconds=1.0)]
        await runner.publish_many(specs)
        key, stopped = await freeze_during_a_run(runner, workers)
        frozen = stopped.worker_id
        await wait_for(lambda: _slots_taken_from(runner, frozen), 60, "its running slot to be taken")
        taken_at = time.time()
        await wait_for(lambda: _claimed_since(runner, taken_at, 4), 60, "runs on the slots it lost")
        stopped.resume()
        tasks = await wait_for(lambda: all_done(runner, len(specs)), 180, "every task to finish")
        released = stopped.find("claim released", key=key)
    judge(None, tasks, RUNNING, {})
    assert released and released[0]["reason"] == "running slot lost"
    [victim] = [t for t in tasks if t.key == key]
    assert all(e.worker_id != frozen or e.claimed_at.timestamp() > taken_at for e in victim.workers)


async def freeze_during_a_run(runner: TaskRunner, workers: list[WorkerProcess]) -> tuple[str, WorkerProcess]:
    """SIGSTOP a worker while it runs a capped task (checked once it is stopped)."""
    while True:
        key, worker_id = await wait_for(lambda: _running_capped(runner), 60, "a capped task to run")
        worker = next(w for w in workers if w.worker_id == worker_id)
        worker.pause()
        if (key, worker_id) in await _running(runner):
            return key, worker
        worker.resume()  # it finished in between: try again


async def _running(runner: TaskRunner) -> set[tuple[str, str]]:
    tasks = await runner.list_tasks(state=TaskState.RUNNING, name="capped")
    return {(t.key, e.worker_id) for t in tasks for e in t.workers if e.state is EntryState.RUNNING}


async def _running_capped(runner: TaskRunner) -> tuple[str, str] | None:
    return next(iter(sorted(await _running(runner))), None)


async def _slots_taken_from(runner: TaskRunner, worker_id: str) -> bool:
    """Some running slot of capped that ``worker_id`` held is held by another worker now."""
    [gate] = await runner.store.gates(["capped"])
    slots = gate.get("running", [])
    return bool(slots) and all(slot.get("holder") != worker_id for slot in slots)


async def _claimed_since(runner: TaskRunner, since: float, count: int) -> bool:
    tasks = await runner.list_tasks(name="capped", limit=200)
    claims = [e for t in tasks for e in t.workers if e.claimed_at.timestamp() > since]
    return len(claims) >= count


async def test_limits_lowered_live_apply_to_held_lanes_and_slots(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """Three workers each hold two running slots of capped (an operator set max_running=6)
    and lanes of paced (5/s) when the operator lowers capped to 1 and paced to 2/s: from a
    second after every worker applied it (docs/limits.md: a change applies within a
    second; a claim already on its way may land meanwhile), no start of capped finds
    another run of it going, even one begun before the change, and no second of paced
    holds more than 2 starts; before, the old limits held; every task finishes. Runs of
    a second outlast that second, so the slots held at the change are tested too."""
    await runner.set_limits("capped", max_running=6)
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        workers = await start(pool, runner, 3)
        specs = list(mix(capped=24, paced=30, per_tenant=0, seconds=1.0))
        await runner.publish_many(specs)
        await wait_for(partial(_at_least, runner, 6, "capped"), 120, "6 capped tasks done")
        await runner.set_limits("capped", max_running=1)
        await runner.set_limits("paced", rate_limit="2/s")
        applied = [await wait_for(partial(_applied, w), 30, f"{w.worker_id} to apply them") for w in workers]
        since = max(applied) + GRACE
        tasks = await wait_for(lambda: all_done(runner, len(specs)), 180, "every task to finish")
    judge(pool, tasks, {"capped": 6}, RATES)
    capped = [t for t in tasks if t.name == "capped"]
    paced = [s for s, _ in spans([t for t in tasks if t.name == "paced"])]
    assert most_at_once(spans(capped), starting_after=since) <= 1
    assert most_at_once(marked_spans(pool, {t.key for t in capped}), starting_after=since) <= 1
    assert most_in_window(paced, 1.0, starting_after=since) <= 2
    assert any(s > since for s in paced) and any(s > since for s, _ in spans(capped))


def _applied(worker: WorkerProcess) -> float | None:
    """When (wall clock) the worker logged that it applies the lowered limits."""
    for line in worker.find("limits changed"):
        limits = line.get("limits") or {}
        if limits.get("capped") == "max_running 1" and limits.get("paced") == "rate 2/1s":
            return datetime.fromisoformat(line["timestamp"]).timestamp()
    return None


@pytest.fixture
async def own_server(embedded_uri: str) -> AsyncIterator[EmbeddedServer]:
    """A private embedded server (on this test's loop) whose replies a test may lose."""
    async with EmbeddedServer() as server:
        yield server


async def fault(uri: str, mode: str, **options: Any) -> None:
    """Set the embedded server's test-only fault; skip the test where the server has none."""
    client: AsyncMongoClient[Doc] = AsyncMongoClient(uri)
    try:
        await client.admin.command({"taskrunnerFault": mode, **options})
    except pe.OperationFailure as exc:
        pytest.skip(f"needs the loseReplies fault (the embedded server's taskrunnerFault command): {exc}")
    finally:
        await client.close()


@pytest.mark.timeout(600)  # bounded by the waits inside, which leave a busy host room
async def test_lost_replies_strand_no_task_and_keep_every_limit(
    own_server: EmbeddedServer, collection_name: str, tmp_path: Path
) -> None:
    """The server applies every 7th write and closes the connection instead of replying
    (claims, batched claims, gate writes, renewals, outcomes) while three workers run 70
    tasks of three limited names: every task finishes (none is left RUNNING with a claim
    nobody runs, even on a gate with a single running slot), and no window or instant
    exceeds a limit."""
    await fault(own_server.uri, "off")
    lease: TaskOptionsDict = {"ping_interval": 0.5, "ping_timeout": 3.0}
    specs = [spec | lease for spec in mix(capped=20, paced=30, per_tenant=5, seconds=0.3)]
    async with TaskRunner(own_server.uri, collection=collection_name) as runner:
        await runner.init()
        with WorkerPool(own_server.uri, collection_name, tmp_path, app=APP) as pool:
            await start(pool, runner, 3)
            await fault(own_server.uri, "loseReplies", every=7)
            try:
                await runner.publish_many(specs)
                tasks = await wait_for(lambda: all_done(runner, len(specs)), 240, "every task to finish")
            finally:
                await fault(own_server.uri, "off")
    judge(pool, tasks, RUNNING, RATES)
