"""Claims whose reply is lost, with real ``taskrunner worker`` processes: the embedded
server's test-only fault ``{"taskrunnerFault": "loseReplies", "every": N}`` applies every
Nth write and then closes its connection without replying (docs/embedded-server.md), as a
network failure after MongoDB applied a write does. ``update_many`` (a batched claim) is
not a retryable write anywhere, and a findAndModify's retry can fail too: each worker reads
back what its claim's run ids landed and runs or releases it, so no task is stranded and
no failure budget is spent by the fault.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient, monitoring
from pymongo import errors as pe
from workers import WorkerPool, WorkerProcess

from taskrunner import TaskOptionsDict, TaskRunner, TaskState
from taskrunner.dev.server import EmbeddedServer
from taskrunner.errors import StoreUnavailable
from taskrunner.store.base import RunStatus, RunWrite
from taskrunner.store.mongo import MongoStore
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

FAULTS_APP = "apps.faults_app:runner"
NEEDS_FAULT = "needs the loseReplies fault (the embedded server's taskrunnerFault command)"
TASKS = 60


@pytest.fixture
async def own_server(embedded_uri: str) -> AsyncIterator[EmbeddedServer]:
    """A private embedded server (on this test's loop) whose replies a test may lose."""
    async with EmbeddedServer() as server:
        yield server


async def fault(uri: str, mode: str, **options: Any) -> None:
    """Set the embedded server's test-only fault; skip the test where the server has none."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
    try:
        await client.admin.command({"taskrunnerFault": mode, **options})
    except pe.OperationFailure as exc:
        pytest.skip(f"{NEEDS_FAULT}: {exc}")
    finally:
        await client.close()


async def test_claims_whose_replies_are_lost_are_read_back_and_say_so(
    own_server: EmbeddedServer, collection_name: str
) -> None:
    """A batched claim (``update_many``, never retried) and a single claim whose reply and
    retry's reply are both lost return what they landed, read back by run id and marked
    ``recovered`` (the worker logs each such recovery); claims that got their reply are not."""
    await fault(own_server.uri, "off")
    async with TaskRunner(own_server.uri, collection=collection_name) as runner:
        await runner.init()
        await runner.publish_many([{"name": "job", "key": k} for k in "abcde"], allow_unknown=True)
    store = MongoStore.connect(own_server.uri, collection=collection_name)
    try:
        await fault(own_server.uri, "loseReplies", every=1, commands=["update"])
        batch = await store.claim_many("w1", ["a", "b", "c"])
        await fault(own_server.uri, "loseReplies", every=1, commands=["findAndModify"])
        single = await store.claim("w1", key="d")
        await fault(own_server.uri, "off")
        plain = await store.claim("w1", key="e")
    finally:
        await fault(own_server.uri, "off")
        await store.close()
    assert sorted((c.task.key, c.recovered) for c in batch.claims) == [("a", True), ("b", True), ("c", True)]
    assert single is not None and (single.task.key, single.recovered) == ("d", True)
    assert plain is not None and (plain.task.key, plain.recovered) == ("e", False)


class Writes(monitoring.CommandListener):
    """Records every write command sent, so a test can see whether it carried a txnNumber."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bool]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in ("findAndModify", "update"):
            self.sent.append((event.command_name, "txnNumber" in event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


async def test_right_after_a_stepdown_lost_replies_of_unretried_writes_are_recovered(
    own_server: EmbeddedServer, collection_name: str
) -> None:
    """Right after a stepdown a driver that saw the server as a secondary keeps it so until
    its next check and sends writes without a txnNumber: a lost reply is not retried. An
    outcome written again after its lost reply finds it landed (DONE, written once), and a
    claim is read back by its run id (``recovered``)."""
    await fault(own_server.uri, "off")
    async with TaskRunner(own_server.uri, collection=collection_name) as runner:
        await runner.init()
        await runner.publish_many([{"name": "job", "key": k} for k in "abc"], allow_unknown=True)
    # No heartbeat during the test: only a failed command makes a driver check the server.
    uri = f"{own_server.uri}&heartbeatFrequencyMS=600000"
    finishing, claiming = Writes(), Writes()
    stores = [
        MongoStore.connect(uri, collection=collection_name, event_listeners=[w])
        for w in (finishing, claiming)
    ]
    finisher, claimer = stores
    try:
        running = await finisher.claim("w1", key="b")
        assert running is not None
        # Long enough that each driver's checks while its refused claim waits (every 0.5 s)
        # end before the stepdown does: each then holds the server for a secondary.
        await fault(own_server.uri, "stepDown", seconds=5)
        for store in stores:
            assert await store.claim("w1", key="a") is None  # refused: nothing landed
        await wait_for(lambda: primary(own_server.uri), 30, "the stepdown to end")
        finishing.sent.clear()
        claiming.sent.clear()
        await fault(own_server.uri, "loseReplies", every=1, commands=["findAndModify", "update"])
        outcome = RunWrite("success", "b", running.run_id, "w1", {"n": 1})
        with pytest.raises(StoreUnavailable):
            await finisher.write_runs([outcome])
        claim = await claimer.claim("w2", key="c")
        await fault(own_server.uri, "off")
        assert await finisher.write_runs([outcome]) == [RunStatus.DONE]
        finished = await finisher.get("b")
    finally:
        await fault(own_server.uri, "off")
        for store in stores:
            await store.close()
    # Each sent once, without a txnNumber: the driver did not retry it.
    assert (finishing.sent[0], claiming.sent[0]) == (("update", False), ("findAndModify", False))
    assert (finished.state, finished.results, finished.failures) == (TaskState.SUCCESS, [{"n": 1}], 0)
    assert claim is not None and (claim.task.key, claim.recovered) == ("c", True)


async def primary(uri: str) -> bool:
    client: AsyncMongoClient[dict[str, Any]]
    async with AsyncMongoClient(uri) as client:
        hello = await client.admin.command("hello")
    return bool(hello.get("isWritablePrimary"))


async def started(*workers: WorkerProcess) -> None:
    await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")


async def succeeded(runner: TaskRunner, n: int = TASKS) -> bool:
    return await runner.store.count(state=TaskState.SUCCESS) == n


@pytest.mark.timeout(600)  # bounded by the waits inside, which leave a busy host room
async def test_lost_claim_replies_strand_nothing_and_spend_no_budget(
    own_server: EmbeddedServer, collection_name: str, tmp_path: Path
) -> None:
    """Every 5th write's reply lost while 3 workers (batched claims of up to 8) run 60 tasks
    that allow one failure: all SUCCESS, each handler started once, no failure counted."""
    await fault(own_server.uri, "off")
    async with TaskRunner(own_server.uri, collection=collection_name) as runner:
        await runner.init()
        with WorkerPool(own_server.uri, collection_name, tmp_path, app=FAULTS_APP) as pool:
            workers = pool.start_many(["l1", "l2", "l3"], "--concurrency", "8", "--batch", "8")
            await started(*workers)
            await fault(own_server.uri, "loseReplies", every=5)
            try:
                options: TaskOptionsDict = {"max_failures": 1, "ping_interval": 0.3, "ping_timeout": 2}
                await runner.publish_many(
                    [
                        {"name": "nap", "key": f"t{i:02d}", "params": {"seconds": 0.05}, **options}
                        for i in range(TASKS)
                    ]
                )
                await wait_for(lambda: succeeded(runner), 120, f"{TASKS} successes", interval=0.2)
            finally:
                await fault(own_server.uri, "off")
            starts = Counter(m["key"] for m in pool.marks(event="start"))
            recovered = [e for w in workers for e in w.find("claims recovered after a lost reply")]
            assert all(w.alive() for w in workers)
        tasks = await runner.store.find()
    assert starts == Counter(f"t{i:02d}" for i in range(TASKS))
    assert [t.failures for t in tasks] == [0] * TASKS
    print(f"claims recovered after a lost reply: {len(recovered)} times")


@pytest.mark.timeout(300)
async def test_batched_claims_whose_replies_are_all_lost_run_once(
    own_server: EmbeddedServer, collection_name: str, tmp_path: Path
) -> None:
    """Every ``update`` reply lost while 3 workers take a backlog of 24 tasks in batched
    claims (``update_many``, which no driver retries): each worker reads back what its
    claims landed by their run ids and says so (``claims recovered after a lost reply``),
    and every task runs once, SUCCESS, no failure counted. The handlers wait for a gate
    opened after the fault, so that no outcome write (an ``update`` too) meets it."""
    await fault(own_server.uri, "off")
    gate = tmp_path / "gate"
    keys = [f"b{i:02d}" for i in range(24)]
    async with TaskRunner(own_server.uri, collection=collection_name) as runner:
        await runner.init()
        with WorkerPool(own_server.uri, collection_name, tmp_path) as pool:
            workers = pool.start_many(["b1", "b2", "b3"], "--concurrency", "8", "--batch", "8")
            await wait_for(lambda: all(w.find("change stream opened") for w in workers), 60, "streams")
            # Paused while the backlog is published, so each worker's sweep finds it all at once on resume.
            await runner.pause("sleep")
            await wait_for(lambda: all(paused(w, ["sleep"]) for w in workers), 30, "the pause")
            params = {"seconds": 0.05, "first_gate": str(gate)}
            await runner.publish_many([{"name": "sleep", "key": k, "params": params} for k in keys])
            await fault(own_server.uri, "loseReplies", every=1, commands=["update"])
            try:
                await runner.resume("sleep")
                await wait_for(lambda: len(pool.marks(event="start")) >= len(keys), 60, "every task to start")
            finally:
                await fault(own_server.uri, "off")
            gate.touch()
            await wait_for(lambda: succeeded(runner, len(keys)), 60, "every task to succeed")
            recovered = [e for w in workers for e in w.find("claims recovered after a lost reply")]
            starts = Counter(m["key"] for m in pool.marks(event="start"))
        tasks = await runner.store.find()
    read_back = [key for line in recovered for key in line["running"]]
    assert len(read_back) >= 3 and len(set(read_back)) == len(read_back) and set(read_back) <= set(keys)
    assert starts == Counter(keys)
    assert [(t.state, t.failures) for t in tasks] == [(TaskState.SUCCESS, 0)] * len(keys)


def paused(worker: WorkerProcess, names: list[str]) -> bool:
    changes = worker.find("paused names changed")
    return bool(changes) and changes[-1]["paused"] == names
