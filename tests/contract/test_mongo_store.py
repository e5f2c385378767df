"""MongoStore on its own (the embedded server, or TASKRUNNER_TEST_MONGO_URI): what only
MongoDB's side has, namely read preferences, undecodable BSON, lost replies and the
shapes of the queries it sends."""

from __future__ import annotations

import asyncio
import struct
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fault_proxy import FaultProxy
from pymongo import ReadPreference, monitoring
from pymongo import errors as pe
from scratch import STORE_DATABASE
from structlog.testing import capture_logs

from taskrunner import MalformedTask, TaskContext, TaskRunner, TaskState
from taskrunner.dashboard import pages
from taskrunner.engine.worker import Worker
from taskrunner.errors import ClaimUnconfirmed, StoreUnavailable
from taskrunner.models import NewTask
from taskrunner.store import expressions as x
from taskrunner.store import fields as f
from taskrunner.store.base import Listing
from taskrunner.store.mongo import MongoStore, _listing_queries
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo


class Commands(monitoring.CommandListener):
    """Every command a client sends, by name."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.sent.append((event.command_name, dict(event.command)))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def with_option(uri: str, option: str) -> str:
    """``uri`` with one more URI option."""
    if "?" in uri:
        return f"{uri}&{option}"
    return f"{uri}{'' if uri.endswith('/') else '/'}?{option}"


@pytest.fixture
async def secondary_preferred(
    mongo_uri: str, collection_name: str
) -> AsyncIterator[tuple[MongoStore, Commands]]:
    """A store whose URI asks for ``readPreference=secondaryPreferred``, and its commands."""
    commands = Commands()
    uri = with_option(mongo_uri, "readPreference=secondaryPreferred")
    store = MongoStore.connect(
        uri, database=STORE_DATABASE, collection=collection_name, event_listeners=[commands]
    )
    await store.init()
    yield store, commands
    await store.close()


async def test_reads_go_to_the_primary_whatever_the_uri_prefers(
    secondary_preferred: tuple[MongoStore, Commands],
) -> None:
    """With ``readPreference=secondaryPreferred`` in the URI, every collection the store reads
    is pinned to the primary, and no read it sends names another mode."""
    store, commands = secondary_preferred
    assert store.client.read_preference == ReadPreference.SECONDARY_PREFERRED
    pinned = [store.collection, store.registry, store.schedule_docs, store.limit_docs, store.gate_docs]
    assert all(c.read_preference == ReadPreference.PRIMARY for c in pinned)
    await store.publish([NewTask.build(key=f"k{i}", name="job") for i in range(2)])
    await store.get("k0")
    await store.limits()
    reads = [body for name, body in commands.sent if name in ("find", "aggregate", "count")]
    assert reads, "the store read nothing"
    modes = {body.get("$readPreference", {}).get("mode", "primary") for body in reads}
    assert modes == {_primary_read_mode(store)}


def _primary_read_mode(store: MongoStore) -> str:
    """The mode PyMongo sends for a primary read: over a direct connection to a replica-set
    member (the embedded server's URI, or a real one with directConnection=true) it sends
    primaryPreferred for every read, whatever the preference (the Server Selection spec), so
    that member serves it; elsewhere a primary read names no mode."""
    topology = store.client.topology_description
    members = {"RSPrimary", "RSSecondary"}
    direct_to_member = topology.topology_type_name == "Single" and any(
        server.server_type_name in members for server in topology.server_descriptions().values()
    )
    return "primaryPreferred" if direct_to_member else "primary"


# -- documents that do not decode ------------------------------------------------------------
LAST_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, the last date Python can hold
FAR_MS = 2**55  # about year 1,141,000: a date other languages write and Python cannot decode


@pytest.fixture
def proxy(mongo_uri: str) -> Iterator[FaultProxy]:
    with FaultProxy(mongo_uri) as running:
        yield running


@pytest.fixture
async def direct(mongo_uri: str, collection_name: str) -> AsyncIterator[MongoStore]:
    """The test's own store, straight to the server."""
    store = MongoStore.connect(mongo_uri, database=STORE_DATABASE, collection=collection_name)
    await store.init()
    yield store
    await store.close()


@pytest.fixture
async def through(proxy: FaultProxy, collection_name: str) -> AsyncIterator[MongoStore]:
    """A store behind the proxy: it sees what the proxy's swap makes of the server's bytes."""
    store = MongoStore.connect(proxy.uri, database=STORE_DATABASE, collection=collection_name)
    yield store
    await store.close()


async def every_reader_survives(direct: MongoStore, store: MongoStore, bad: str, problem: str) -> None:
    """List, show, the dashboard, a sweep, a claim and normalization each read past the
    document ``bad`` (naming it and ``problem``) and serve the readable ones."""
    listed = {t.key: t for t in await store.find()}
    assert set(listed) == {"a", bad, "b"} and listed["a"].unreadable is None
    assert problem in str(listed[bad].unreadable)
    assert {t.key for t in (await store.browse(Listing(sort="updated_at"))).tasks} == {"a", bad, "b"}
    assert problem in str((await store.get(bad)).unreadable)
    runner = TaskRunner(store=store)
    assert (await pages.overview(runner))["by_state"]["PENDING"] == 3
    assert len((await pages.task_list(runner, pages.TaskFilter()))["tasks"]) == 3
    now = await store.server_time()
    page = await store.due("w1", ["job"], horizon=now + timedelta(seconds=5))
    assert sorted(t.key for t in page.tasks) == ["a", "b"]
    assert [u.key for u in page.unreadable] == [bad] and problem in page.unreadable[0].problem
    with pytest.raises(MalformedTask) as raised:
        await store.claim("w1", key=bad)
    assert raised.value.key == bad and problem in raised.value.problem
    claimed = await store.claim("w1", key="a")
    assert claimed is not None and claimed.task.key == "a"
    failed = await direct.get(bad)  # the claim recorded its failure: it cannot loop
    assert failed.state is TaskState.FAIL and failed.workers[0].error is not None
    assert failed.workers[0].error.type == "MalformedTask"


async def test_a_date_out_of_pythons_range_never_stops_a_reader(
    direct: MongoStore, through: MongoStore, proxy: FaultProxy
) -> None:
    """A date Python cannot hold (as another language may write) reads as a malformed task
    naming its field and key, everywhere tasks are read; normalization marks it FAIL."""
    await direct.publish([NewTask.build(key=k, name="job") for k in ("a", "far", "b")])
    await direct.collection.update_one(
        {"key": "far"}, {"$set": {"created_at": datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)}}
    )
    proxy.swap(struct.pack("<q", LAST_MS), struct.pack("<q", FAR_MS))
    await every_reader_survives(direct, through, "far", "created_at")
    await direct.retry("far")
    marked = await through.normalize("far")
    assert (
        marked.state is TaskState.FAIL and marked.error is not None and "created_at" in marked.error.message
    )


async def test_a_string_that_is_not_utf8_never_stops_a_reader(
    direct: MongoStore, through: MongoStore, proxy: FaultProxy
) -> None:
    """A document holding a string that is not UTF-8 reads leniently, its key readable and
    its problem named; claims record it as a failed run and normalization marks it FAIL."""
    await direct.publish(
        [NewTask.build(key=k, name="job", params={"note": f"OKUTF8{k}"}) for k in ("a", "b")]
    )
    await direct.publish([NewTask.build(key="odd", name="job", params={"note": "NOTUTF8!"})])
    proxy.swap(b"NOTUTF8!", b"\xff\xfeTUTF8!")
    await every_reader_survives(direct, through, "odd", "does not decode as BSON")
    await direct.retry("odd")
    marked = await through.normalize("odd")
    assert marked.state is TaskState.FAIL and marked.error is not None
    assert "does not decode as BSON" in marked.error.message


# -- claims whose reply was lost --------------------------------------------------------------
class LostReplies:
    """Wraps a store's raw task collection: the next ``writes`` claims (an ``update_many``
    or a ``find_one_and_update`` on the claim filter) are applied and then fail as a
    connection closed before the reply would; the next ``reads`` finds fail likewise."""

    def __init__(
        self, store: MongoStore, monkeypatch: pytest.MonkeyPatch, writes: int, reads: int = 0
    ) -> None:
        self.writes, self.reads, self.lost = writes, reads, 0
        raw = store._raw
        for name in ("update_many", "find_one_and_update"):
            monkeypatch.setattr(raw, name, self._write(getattr(raw, name)))
        monkeypatch.setattr(raw, "find", self._find(raw.find))

    def _write(self, method: Any) -> Any:
        async def write(query: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            result = await method(query, *args, **kwargs)
            if f.CLAIMABLE_AT in query and self.writes > 0:  # a claim filter
                self.writes -= 1
                self.lost += 1
                raise pe.AutoReconnect("connection closed before the reply (injected)")
            return result

        return write

    def _find(self, method: Any) -> Any:
        def find(*args: Any, **kwargs: Any) -> Any:
            if self.reads > 0:
                self.reads -= 1
                raise pe.AutoReconnect("connection closed (injected)")
            return method(*args, **kwargs)

        return find


@pytest.fixture
async def store(mongo_uri: str, collection_name: str) -> AsyncIterator[MongoStore]:
    mongo = MongoStore.connect(mongo_uri, database=STORE_DATABASE, collection=collection_name)
    await mongo.init()
    yield mongo
    await mongo.close()


def new(*keys: str, **options: Any) -> list[NewTask]:
    return [NewTask.build(key=key, name="job", options=options) for key in keys]


async def test_a_batched_claim_whose_reply_was_lost_returns_what_landed(
    store: MongoStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``update_many`` is not a retryable write: after a transport error the claims that
    landed are read back by their run ids and returned, each task claimed once."""
    await store.publish(new("a", "b", "c"))
    faults = LostReplies(store, monkeypatch, writes=1)
    claimed = await store.claim_many("w1", ["a", "b", "c"])
    assert faults.lost == 1 and sorted(c.task.key for c in claimed.claims) == ["a", "b", "c"]
    for claim in claimed.claims:
        assert [w.run_id for w in claim.task.workers] == [claim.run_id]


async def test_a_single_claim_whose_reply_was_lost_returns_what_landed(
    store: MongoStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A findAndModify whose reply (and the driver's retry) was lost: the claim is read back."""
    await store.publish(new("a"))
    faults = LostReplies(store, monkeypatch, writes=1)
    claim = await store.claim("w1", key="a", fresh=True)
    assert faults.lost == 1 and claim is not None and claim.task.key == "a"
    assert [w.run_id for w in claim.task.workers] == [claim.run_id]


async def test_when_the_read_back_fails_too_the_claim_is_recovered_later(
    store: MongoStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both the claim's reply and its read-back lost: ``ClaimUnconfirmed`` carries the run
    ids and keys, with which ``recover`` later finds exactly what landed."""
    await store.publish(new("a", "b"))
    LostReplies(store, monkeypatch, writes=1, reads=1)
    with pytest.raises(ClaimUnconfirmed) as raised:
        await store.claim_many("w1", ["a", "b"])
    assert sorted(raised.value.keys or []) == ["a", "b"] and len(raised.value.run_ids) == 2
    recovered = await store.recover("w1", raised.value.run_ids, keys=raised.value.keys)
    assert sorted(c.task.key for c in recovered.claims) == ["a", "b"]
    assert {c.run_id for c in recovered.claims} == set(raised.value.run_ids)
    assert (await store.recover("w2", raised.value.run_ids)).claims == []  # another worker's ids


@pytest.mark.parametrize("batch", [1, 8])
async def test_a_worker_runs_claims_whose_reply_was_lost_without_spending_budget(
    store: MongoStore, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """A worker whose claims' replies and read-backs are lost runs every task once, all
    SUCCESS with no failure counted (``max_failures=1``: one orphaned lease would have
    failed the task with LeaseExpired without it ever running)."""
    await store.publish(new(*(f"t{i}" for i in range(6)), max_failures=1, ping_interval=0.2, ping_timeout=1))
    runner, ran = TaskRunner(store=store), Counter[str]()

    @runner.task("job")
    async def job(params: dict[str, Any], ctx: TaskContext) -> None:
        ran[ctx.key] += 1

    faults = LostReplies(store, monkeypatch, writes=2, reads=1)

    async def all_done() -> bool:
        return await store.count(state=TaskState.SUCCESS) == 6

    with capture_logs() as logs:  # the worker's loggers are bound with the configuration of their making
        worker = Worker(runner, worker_id="w1", concurrency=4, batch=batch, poll_interval=0.2)
        await run_worker_until(worker, all_done)
    assert faults.lost == 2 and ran == {f"t{i}": 1 for i in range(6)}
    assert "claims recovered after a lost reply" in [e["event"] for e in logs]
    tasks = await store.find()
    assert [(t.failures, t.attempts, len(t.workers)) for t in tasks] == [(0, 1, 1)] * 6


async def test_a_stopping_worker_gives_back_claims_whose_reply_was_lost(
    store: MongoStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped while a claim's reply and its read-back were lost, and the server
    came back only then, finds that claim at shutdown and gives it back: the task is
    PENDING again with no failure counted, instead of RUNNING until its lease expires."""
    await store.publish(new("only", max_failures=1))
    runner = TaskRunner(store=store)

    @runner.task("job")
    async def job(params: dict[str, Any], ctx: TaskContext) -> None:
        raise AssertionError("the claim was lost: the handler must not run")

    faults = LostReplies(store, monkeypatch, writes=1, reads=1)
    away, tries = [True], [0]
    recover = store.recover

    async def recover_when_back(*args: Any, **kwargs: Any) -> Any:
        tries[0] += 1
        if away[0]:
            raise StoreUnavailable("MongoDB unavailable: connection refused (injected)")
        return await recover(*args, **kwargs)

    monkeypatch.setattr(store, "recover", recover_when_back)
    worker = Worker(runner, worker_id="w1", poll_interval=0.2, shutdown_timeout=10)
    running = asyncio.create_task(worker.run())
    await wait_for(lambda: faults.lost == 1 and tries[0] >= 1, 30, "a lost claim the worker cannot confirm")
    worker.stop()
    away[0] = False
    await asyncio.wait_for(running, 30)
    task = await store.get("only")
    assert task.state is TaskState.PENDING and task.failures == 0 and task.workers == [], task


@pytest.mark.parametrize("batch", [1, 8])
async def test_a_worker_says_which_claims_it_read_back_after_a_lost_reply(
    store: MongoStore, monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """Claims whose reply was lost, read back at once by their run ids, run like any other
    (once, no failure counted), and the worker logs one ``claims recovered after a lost
    reply`` line per lost reply, naming them."""
    await store.publish(new(*(f"t{i}" for i in range(6)), max_failures=1))
    runner, ran = TaskRunner(store=store), Counter[str]()

    @runner.task("job")
    async def job(params: dict[str, Any], ctx: TaskContext) -> None:
        ran[ctx.key] += 1

    faults = LostReplies(store, monkeypatch, writes=2)

    async def all_done() -> bool:
        return await store.count(state=TaskState.SUCCESS) == 6

    with capture_logs() as logs:  # the worker's loggers are bound with the configuration of their making
        worker = Worker(runner, worker_id="w1", concurrency=4, batch=batch, poll_interval=0.2)
        await run_worker_until(worker, all_done)
    recovered = [e for e in logs if e["event"] == "claims recovered after a lost reply"]
    assert faults.lost == 2 and ran == {f"t{i}": 1 for i in range(6)}
    assert len(recovered) == 2 and all(e["running"] for e in recovered), recovered
    tasks = await store.find()
    assert [(t.failures, t.attempts, len(t.workers)) for t in tasks] == [(0, 1, 1)] * 6


async def run_worker_until(
    worker: Worker, condition: Callable[[], Awaitable[bool]], within: float = 30.0
) -> None:
    """Run the worker until ``condition()`` holds, then stop it and wait for it to exit."""
    running = asyncio.create_task(worker.run())
    try:
        await wait_for(condition, within, "the worker to get there", interval=0.05)
    finally:
        worker.stop()
        await running


# -- the listing's queries ------------------------------------------------------------------
def test_listing_queries_page_dates_by_range_and_the_rest_by_key() -> None:
    """The shapes MongoDB's type bracketing needs (the embedded server matched ``$lte`` on a
    date loosely, so its results alone could not show this): past the first page the dated
    query is a range on dates only, the rest has a query of its own, by key after an undated
    position, and an undated position never asks for dates again."""
    at = datetime(2026, 1, 1, tzinfo=UTC)
    not_dates = [{f.CREATED_AT: {"$in": [None, []]}}, {f.CREATED_AT: {"$type": x.NOT_DATES}}]
    first, rest = _listing_queries(Listing(key_prefix="b"))
    assert first == {f.KEY: {"$regex": "^b"}, f.CREATED_AT: {"$type": "date"}}
    assert rest == {f.KEY: {"$regex": "^b"}, "$or": not_dates}
    dated, rest = _listing_queries(Listing(after=(at, "k")))
    assert dated == {
        f.CREATED_AT: {"$type": "date", "$lte": at},
        "$or": [{f.CREATED_AT: {"$lt": at}}, {f.KEY: {"$lt": "k"}}],
    }
    assert rest == {"$or": not_dates}
    assert _listing_queries(Listing(after=(None, "k"), key_prefix="b")) == (
        None,
        {f.KEY: {"$regex": "^b", "$lt": "k"}, "$or": not_dates},
    )
