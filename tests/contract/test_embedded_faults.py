"""The embedded server's MongoDB behaviours under faults: the test-only ``taskrunnerFault``
command (stepdown, lost replies, ended streams), mongoeco's ``failCommand`` on what the bridge
answers, retryable-write deduplication, the 16 MiB document limit and inserts in constant time."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import bson
import pytest
from bson.binary import Binary
from bson.int64 import Int64
from pymongo import AsyncMongoClient, MongoClient, UpdateOne, monitoring
from pymongo.errors import (
    AutoReconnect,
    DuplicateKeyError,
    NotPrimaryError,
    OperationFailure,
    WriteError,
)
from workers import dev_server

from taskrunner import TaskRunner
from taskrunner.dev.engine import MAX_BSON_OBJECT_SIZE
from taskrunner.dev.retryable import RetryableWrites, retryable_write
from taskrunner.dev.server import EmbeddedServer
from taskrunner.testing import wait_for

pytestmark = pytest.mark.embedded

Doc = dict[str, Any]


class _Recorder(monitoring.CommandListener):
    """Every command started, replied and failed, with the command documents sent."""

    def __init__(self) -> None:
        self.started_commands: list[tuple[str, Doc]] = []
        self.failures: list[tuple[str, Doc]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.started_commands.append((event.command_name, dict(event.command)))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self.failures.append((event.command_name, dict(event.failure)))

    def sent(self, name: str) -> list[Doc]:
        return [command for command_name, command in self.started_commands if command_name == name]

    def failed_with(self, name: str) -> list[Doc]:
        return [failure for command_name, failure in self.failures if command_name == name]


@pytest.fixture
async def server() -> AsyncIterator[EmbeddedServer]:
    """A fresh in-process server per test: faults are server-wide."""
    async with EmbeddedServer() as embedded:
        yield embedded


@pytest.fixture
def recorder() -> _Recorder:
    return _Recorder()


@pytest.fixture
async def client(server: EmbeddedServer, recorder: _Recorder) -> AsyncIterator[AsyncMongoClient[Doc]]:
    mongo: AsyncMongoClient[Doc] = AsyncMongoClient(server.uri, event_listeners=[recorder])
    async with mongo:
        yield mongo


@pytest.fixture
async def admin(server: EmbeddedServer) -> AsyncIterator[AsyncMongoClient[Doc]]:
    """A second client to set faults with, so the tested client's traffic stays its own."""
    mongo: AsyncMongoClient[Doc] = AsyncMongoClient(server.uri)
    async with mongo:
        yield mongo


def _own_fields(reply: Doc) -> Doc:
    """A reply without the cluster time every reply carries."""
    return {k: v for k, v in reply.items() if k not in ("$clusterTime", "operationTime")}


async def _fault(admin: AsyncMongoClient[Doc], mode: str, **options: Any) -> Doc:
    return _own_fields(await admin.admin.command({"taskrunnerFault": mode, **options}))


async def _raw_command(uri: str, command: Doc) -> Doc:
    """Send one OP_MSG as is (no driver-added $readPreference, lsid or retry) and decode the reply."""
    address = urlsplit(uri)
    assert address.hostname is not None and address.port is not None
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        body = bson.encode(command)
        payload = struct.pack("<I", 0) + b"\x00" + body
        writer.write(struct.pack("<iiii", 16 + len(payload), 1, 0, 2013) + payload)
        await writer.drain()
        (length,) = struct.unpack("<i", await reader.readexactly(4))
        reply = await reader.readexactly(length - 4)
    finally:
        writer.close()
        await writer.wait_closed()
    return bson.decode(reply[17:])  # 12 more header bytes, flag bits, section kind


def _session() -> Doc:
    return {"id": Binary.from_uuid(uuid.uuid4())}


# -- the taskrunnerFault command -----------------------------------------------------------


async def test_fault_command_replies_with_its_shapes_and_refuses_bad_input(
    server: EmbeddedServer, admin: AsyncMongoClient[Doc]
) -> None:
    """taskrunnerFault answers {ok: 1} (endStreams adds ended: n), runs on admin only, and
    refuses an unknown mode or bad options with BadValue (2)."""
    assert await _fault(admin, "stepDown", seconds=30) == {"ok": 1.0}
    assert await _fault(admin, "loseReplies", every=3, commands=["ping"]) == {"ok": 1.0}
    assert await _fault(admin, "endStreams") == {"ok": 1.0, "ended": 0}
    assert await _fault(admin, "endStreams", ns="taskrunner.tasks") == {"ok": 1.0, "ended": 0}
    assert await _fault(admin, "off") == {"ok": 1.0}
    codes = []
    for bad in (
        {"taskrunnerFault": "explode"},
        {"taskrunnerFault": "stepDown"},
        {"taskrunnerFault": "loseReplies", "every": 0},
        {"taskrunnerFault": "loseReplies", "every": 2, "commands": []},
    ):
        with pytest.raises(OperationFailure) as refused:
            await admin.admin.command(bad)
        codes.append(refused.value.code)
    with pytest.raises(OperationFailure) as not_admin:
        await admin.taskrunner.command({"taskrunnerFault": "off"})
    assert codes == [2, 2, 2, 2]
    assert not_admin.value.code == 13


async def test_step_down_refuses_writes_with_not_writable_primary_until_off(
    client: AsyncMongoClient[Doc], admin: AsyncMongoClient[Doc], recorder: _Recorder
) -> None:
    """While stepped down, a retryable write fails NotWritablePrimary (10107) labelled
    RetryableWriteError and writes nothing (PyMongo, seeing a secondary, does not retry it);
    hello says not writable primary, secondary; after off the server is primary again."""
    tasks = client.taskrunner.tasks
    await tasks.insert_one({"_id": "before"})
    await _fault(admin, "stepDown", seconds=600)
    with pytest.raises(NotPrimaryError):
        await tasks.insert_one({"_id": "during"})
    hello = await admin.admin.command("hello")
    failures = recorder.failed_with("insert")
    await _fault(admin, "off")
    await tasks.insert_one({"_id": "after"})
    assert [(f["code"], f["errmsg"], f["errorLabels"]) for f in failures] == [
        (10107, "not primary", ["RetryableWriteError"])
    ]
    assert (hello["isWritablePrimary"], hello["secondary"], "primary" in hello) == (False, True, False)
    assert (await admin.admin.command("hello"))["isWritablePrimary"] is True
    assert sorted(await tasks.distinct("_id")) == ["after", "before"]


async def test_step_down_ends_by_itself_after_its_seconds(admin: AsyncMongoClient[Doc]) -> None:
    """A stepDown of `seconds` ends without `off`: hello says writable primary again and writes work."""
    started = time.monotonic()
    await _fault(admin, "stepDown", seconds=2)
    during = (await admin.admin.command("hello"))["isWritablePrimary"]
    if time.monotonic() - started < 2:  # a stalled machine may have let the stepdown pass already
        assert during is False

    async def primary() -> bool:
        return bool((await admin.admin.command("hello"))["isWritablePrimary"])

    await wait_for(primary, what="the server to be primary again")
    await admin.taskrunner.tasks.insert_one({"_id": "after"})


async def test_step_down_refuses_primary_reads_but_serves_secondary_reads(
    server: EmbeddedServer, admin: AsyncMongoClient[Doc]
) -> None:
    """While stepped down, a find without a secondary-capable $readPreference fails
    NotPrimaryNoSecondaryOk (13435); with primaryPreferred (what PyMongo sends over a direct
    connection) the secondary serves it, as a MongoDB secondary does."""
    await admin.taskrunner.tasks.insert_one({"_id": 1})
    await _fault(admin, "stepDown", seconds=600)
    primary_read = await _raw_command(server.uri, {"find": "tasks", "$db": "taskrunner"})
    secondary_read = await _raw_command(
        server.uri, {"find": "tasks", "$db": "taskrunner", "$readPreference": {"mode": "primaryPreferred"}}
    )
    direct = await admin.taskrunner.tasks.find_one({"_id": 1})
    assert {k: primary_read[k] for k in ("ok", "code", "codeName", "errmsg")} == {
        "ok": 0.0,
        "code": 13435,
        "codeName": "NotPrimaryNoSecondaryOk",
        "errmsg": "not primary and secondaryOk=false",
    }
    assert secondary_read["cursor"]["firstBatch"] == [{"_id": 1}]
    assert direct == {"_id": 1}


async def test_step_down_interrupts_an_awaiting_change_stream_get_more(
    server: EmbeddedServer, client: AsyncMongoClient[Doc], admin: AsyncMongoClient[Doc], recorder: _Recorder
) -> None:
    """A change-stream getMore waiting for events when the server steps down fails
    InterruptedDueToReplStateChange (11602) labelled ResumableChangeStreamError; its cursor is
    killed, and PyMongo resumes on the secondary and still gets the next event."""
    tasks = client.taskrunner.tasks
    async with await tasks.watch(max_await_time_ms=60_000) as stream:
        waiting = asyncio.create_task(stream.try_next())

        async def interrupted() -> bool:
            await _fault(admin, "stepDown", seconds=600)  # interrupts the getMore once it waits
            return bool(recorder.failed_with("getMore"))

        await wait_for(interrupted, what="the waiting getMore to be interrupted")
        await _fault(admin, "off")
        await admin.taskrunner.tasks.insert_one({"_id": "next"})
        first = await waiting
        event = first or await stream.next()
    [failure] = recorder.failed_with("getMore")
    first_cursor = recorder.sent("getMore")[0]["getMore"]
    stale = await _raw_command(
        server.uri, {"getMore": Int64(first_cursor), "collection": "tasks", "$db": "taskrunner"}
    )
    assert (failure["code"], failure["codeName"], failure["errorLabels"]) == (
        11602,
        "InterruptedDueToReplStateChange",
        ["ResumableChangeStreamError"],
    )
    assert len(recorder.sent("aggregate")) == 2
    assert event["documentKey"] == {"_id": "next"}
    assert stale["code"] == 43


async def test_end_streams_answers_the_waiting_get_more_with_cursor_id_zero(
    client: AsyncMongoClient[Doc], admin: AsyncMongoClient[Doc], recorder: _Recorder
) -> None:
    """endStreams answers a waiting change-stream getMore with an empty batch and cursor id 0
    (PyMongo's stream is then dead); streams on other namespaces and later streams live on."""
    tasks, other = client.taskrunner.tasks, client.taskrunner.other
    async with await tasks.watch(max_await_time_ms=60_000) as stream, await other.watch() as kept:
        waiting = asyncio.create_task(stream.try_next())
        assert await _fault(admin, "endStreams", ns="taskrunner.tasks") == {"ok": 1.0, "ended": 1}
        assert await waiting is None
        assert not stream.alive
        assert kept.alive
        async with await tasks.watch(max_await_time_ms=5000) as later:
            await tasks.insert_one({"_id": "later"})
            assert (await later.next())["documentKey"] == {"_id": "later"}


def test_faults_work_the_same_on_the_dev_server_subprocess() -> None:
    """`taskrunner dev-server` answers taskrunnerFault too: a stepdown refuses writes, off
    restores them, and loseReplies closes the connection of the chosen command."""
    with dev_server() as (_, uri):
        client: MongoClient[Doc] = MongoClient(uri, serverSelectionTimeoutMS=10_000)
        _faults_on_a_sync_client(client)


def _faults_on_a_sync_client(client: MongoClient[Doc]) -> None:
    with client:
        tasks = client.taskrunner.tasks
        client.admin.command({"taskrunnerFault": "stepDown", "seconds": 600})
        with pytest.raises(NotPrimaryError):
            tasks.insert_one({"_id": "during"})
        client.admin.command({"taskrunnerFault": "off"})
        tasks.insert_one({"_id": "after"})
        client.admin.command({"taskrunnerFault": "loseReplies", "every": 1, "commands": ["count"]})
        with pytest.raises(AutoReconnect):
            client.taskrunner.command("count", "tasks")
        client.admin.command({"taskrunnerFault": "off"})
        assert client.taskrunner.command("count", "tasks")["n"] == 1


# -- mongoeco's failCommand on what the bridge answers --------------------------------------


async def _fail_command(admin: AsyncMongoClient[Doc], **data: Any) -> None:
    await admin.admin.command({"configureFailPoint": "failCommand", "mode": {"times": 1}, "data": data})


async def test_fail_command_reaches_change_stream_aggregate_get_more_and_coll_mod(
    client: AsyncMongoClient[Doc], admin: AsyncMongoClient[Doc], recorder: _Recorder
) -> None:
    """configureFailPoint failCommand fails the bridge's change-stream aggregate and getMore
    and its collMod with the configured code and labels (and counts them for `times`)."""
    tasks = client.taskrunner.tasks
    await client.taskrunner.create_collection("tasks")
    await _fail_command(admin, failCommands=["aggregate"], errorCode=14)  # codes no driver retries
    with pytest.raises(OperationFailure) as on_aggregate:
        await tasks.watch()
    await _fail_command(admin, failCommands=["collMod"], errorCode=15)
    with pytest.raises(OperationFailure) as on_coll_mod:
        await client.taskrunner.command("collMod", "tasks", validator={})
    async with await tasks.watch(max_await_time_ms=200) as stream:
        await _fail_command(
            admin, failCommands=["getMore"], errorCode=16, errorLabels=["ResumableChangeStreamError"]
        )
        assert await stream.try_next() is None  # resumed after the failure
        await tasks.insert_one({"_id": 1})
        assert (await stream.next())["documentKey"] == {"_id": 1}
    assert (on_aggregate.value.code, on_coll_mod.value.code) == (14, 15)
    assert [f["code"] for f in recorder.failed_with("getMore")] == [16]


async def test_fail_command_close_connection_closes_it_without_a_reply(
    client: AsyncMongoClient[Doc], admin: AsyncMongoClient[Doc], recorder: _Recorder
) -> None:
    """failCommand with closeConnection: true closes the connection (a network error, not an
    error reply), on mongoeco's commands and on the bridge's change-stream getMore alike."""
    await _fail_command(admin, failCommands=["count"], errorCode=2, closeConnection=True)
    with pytest.raises(AutoReconnect) as on_count:
        await client.taskrunner.command("count", "tasks")
    async with await client.taskrunner.tasks.watch(max_await_time_ms=200) as stream:
        await _fail_command(admin, failCommands=["getMore"], errorCode=2, closeConnection=True)
        assert await stream.try_next() is None  # a network error resumes the stream
    assert not isinstance(on_count.value, OperationFailure)
    [get_more] = recorder.failed_with("getMore")
    assert get_more["errtype"] == "AutoReconnect"


# -- retryable writes ----------------------------------------------------------------------


async def test_pymongo_sends_txn_numbers_to_the_embedded_server(
    client: AsyncMongoClient[Doc], recorder: _Recorder
) -> None:
    """hello names a replica set, so PyMongo sends lsid + txnNumber with retryable writes
    (and none with update_many, which is not retryable)."""
    tasks = client.taskrunner.tasks
    await tasks.insert_one({"_id": 1})
    await tasks.find_one_and_update({"_id": 1}, {"$set": {"n": 1}})
    await tasks.update_many({}, {"$set": {"n": 2}})
    [insert], [find_and_modify], [update] = (recorder.sent(n) for n in ("insert", "findAndModify", "update"))
    assert "lsid" in insert and "txnNumber" in insert and "txnNumber" in find_and_modify
    assert "txnNumber" not in update


async def test_lost_find_one_and_update_reply_is_retried_with_the_first_result(
    client: AsyncMongoClient[Doc], admin: AsyncMongoClient[Doc], recorder: _Recorder
) -> None:
    """A findAndModify whose reply was lost is retried by PyMongo with the same txnNumber and
    gets the first attempt's value; the document was updated once."""
    tasks = client.taskrunner.tasks
    await tasks.insert_one({"_id": 1, "n": 0})
    await _fault(admin, "loseReplies", every=2, commands=["findAndModify"])
    first = await tasks.find_one_and_update({"_id": 1}, {"$inc": {"n": 1}}, return_document=True)
    lost = await tasks.find_one_and_update({"_id": 1}, {"$inc": {"n": 1}}, return_document=True)
    sent = recorder.sent("findAndModify")
    assert (first, lost) == ({"_id": 1, "n": 1}, {"_id": 1, "n": 2})
    assert await tasks.find_one({"_id": 1}) == {"_id": 1, "n": 2}
    assert [c["txnNumber"] for c in sent] == [
        sent[0]["txnNumber"],
        sent[1]["txnNumber"],
        sent[1]["txnNumber"],
    ]
    assert [f["errtype"] for f in recorder.failed_with("findAndModify")] == ["AutoReconnect"]


async def test_lost_update_one_and_bulk_write_replies_are_retried_without_running_twice(
    client: AsyncMongoClient[Doc], admin: AsyncMongoClient[Doc]
) -> None:
    """update_one and a bulk_write of UpdateOne (one update command of several statements)
    retried after a lost reply report the first attempt's counts; each document changed once."""
    tasks = client.taskrunner.tasks
    await tasks.insert_many([{"_id": i, "n": 0} for i in range(3)])
    await _fault(admin, "loseReplies", every=2, commands=["update"])
    await tasks.update_one({"_id": 0}, {"$inc": {"n": 1}})  # the 1st update: replied
    single = await tasks.update_one({"_id": 0}, {"$inc": {"n": 10}})  # the 2nd: lost; the retry replied
    ops = [UpdateOne({"_id": i}, {"$inc": {"n": 100}}) for i in range(3)] + [
        UpdateOne({"_id": 9}, {"$set": {"n": 0}}, upsert=True)
    ]
    bulk = await tasks.bulk_write(ops)  # the 4th: lost; the retry replied
    assert (single.matched_count, single.modified_count) == (1, 1)
    assert (bulk.matched_count, bulk.modified_count, bulk.upserted_ids) == (3, 3, {3: 9})
    assert await tasks.find().sort("_id").to_list() == [
        {"_id": 0, "n": 111},
        {"_id": 1, "n": 100},
        {"_id": 2, "n": 100},
        {"_id": 9, "n": 0},
    ]


async def test_lost_update_many_reply_raises_and_is_not_run_again(
    client: AsyncMongoClient[Doc], admin: AsyncMongoClient[Doc], recorder: _Recorder
) -> None:
    """update_many is not retryable: a lost reply raises AutoReconnect (ConnectionFailure) and
    the update, applied once, is not run again."""
    tasks = client.taskrunner.tasks
    await tasks.insert_many([{"_id": i, "n": 0} for i in range(3)])
    await _fault(admin, "loseReplies", every=1, commands=["update"])
    with pytest.raises(AutoReconnect):
        await tasks.update_many({}, {"$inc": {"n": 1}})
    await _fault(admin, "off")
    assert len(recorder.sent("update")) == 1
    assert await tasks.distinct("n") == [1]


async def test_a_repeated_txn_number_is_answered_from_the_record(server: EmbeddedServer) -> None:
    """The same lsid + txnNumber sent twice runs once and gets the first reply; statements that
    failed run again; an older txnNumber is refused (225); a multi update is never deduplicated."""
    session = _session()

    async def write(command: Doc, txn: int) -> Doc:
        return await _raw_command(
            server.uri, {**command, "$db": "d", "lsid": session, "txnNumber": Int64(txn)}
        )

    insert = {"insert": "c", "documents": [{"_id": 1}, {"_id": 2}]}
    first, again = await write(insert, 1), await write(insert, 1)
    batch = {"insert": "c", "documents": [{"_id": 3}, {"_id": 1}, {"_id": 4}], "ordered": True}
    partial = await write(batch, 2)
    await _raw_command(server.uri, {"delete": "c", "deletes": [{"q": {"_id": 1}, "limit": 1}], "$db": "d"})
    completed = await write(batch, 2)
    too_old = await write(insert, 1)
    multi = {"update": "c", "updates": [{"q": {}, "u": {"$inc": {"n": 1}}, "multi": True}]}
    await write(multi, 3)
    await write(multi, 3)
    found = await _raw_command(server.uri, {"find": "c", "sort": {"_id": 1}, "$db": "d"})
    assert _own_fields(first) == _own_fields(again) == {"n": 2, "ok": 1.0}
    assert (partial["n"], [e["index"] for e in partial["writeErrors"]]) == (1, [1])
    assert (completed["n"], "writeErrors" in completed) == (3, False)
    assert (too_old["code"], too_old["codeName"]) == (225, "TransactionTooOld")
    assert found["cursor"]["firstBatch"] == [{"_id": i, "n": 2} for i in (1, 2, 3, 4)]


async def test_retryable_records_are_bounded_by_count_and_idle_time() -> None:
    """The records keep one entry per session, at most max_sessions, and drop idle ones."""
    runs: list[Doc] = []

    async def run(body: Doc) -> Doc:
        runs.append(body)
        return {"n": len(body["documents"]), "ok": 1.0}

    def insert(session: str, txn: int) -> Any:
        body = {"insert": "c", "documents": [{"_id": txn}], "txnNumber": txn, "lsid": session}
        write = retryable_write("insert", body, session)
        assert write is not None
        return write

    bounded = RetryableWrites(max_sessions=2)
    for session in ("a", "b", "c", "d"):
        await bounded.execute(insert(session, 1), run)
    await bounded.execute(insert("d", 1), run)  # a retry: answered from the record
    idle = RetryableWrites(idle_seconds=0.0)
    await idle.execute(insert("a", 1), run)
    await idle.execute(insert("b", 1), run)
    assert (len(bounded), len(idle)) == (2, 1)
    assert len(runs) == 6


# -- the 16 MiB document limit -------------------------------------------------------------


def _sized(size: int, **fields: Any) -> Doc:
    """A document of exactly `size` BSON bytes."""
    document = {**fields, "x": ""}
    document["x"] = "a" * (size - len(bson.encode(document)))
    assert len(bson.encode(document)) == size
    return document


async def test_documents_over_16_mib_are_refused_as_mongodb_6_0_to_8_0_refuse_them(
    client: AsyncMongoClient[Doc],
) -> None:
    """A 16 MiB document is stored; one byte more is refused with the codes MongoDB 6.0, 7.0
    and 8.0 answer (and buildInfo's 7.0.0): insert BadValue (2), an update whose result is
    larger 17419, an upsert 17420 (findAndModify as a command error); nothing changes."""
    tasks = client.taskrunner.tasks
    await tasks.insert_one(_sized(MAX_BSON_OBJECT_SIZE, _id="max"))
    await tasks.insert_one({"_id": "small", "n": 0})
    refused: dict[str, OperationFailure] = {}
    with pytest.raises(WriteError) as insert:
        await tasks.insert_one(_sized(MAX_BSON_OBJECT_SIZE + 1, _id="over"))
    refused["insert"] = insert.value
    with pytest.raises(WriteError) as update:
        await tasks.update_one({"_id": "max"}, {"$set": {"n": 1}})
    refused["update"] = update.value
    with pytest.raises(WriteError) as upsert:
        await tasks.update_one({"_id": "new"}, {"$set": _sized(MAX_BSON_OBJECT_SIZE)}, upsert=True)
    refused["upsert"] = upsert.value
    with pytest.raises(OperationFailure) as find_and_modify:
        await tasks.find_one_and_update({"_id": "max"}, {"$set": {"n": 1}})
    refused["findAndModify"] = find_and_modify.value
    assert {k: e.code for k, e in refused.items()} == {
        "insert": 2,
        "update": 17419,
        "upsert": 17420,
        "findAndModify": 17419,
    }
    assert str(insert.value).startswith(
        f"object to insert too large. size in bytes: {MAX_BSON_OBJECT_SIZE + 1}, max size: {MAX_BSON_OBJECT_SIZE}"
    )
    assert sorted(await tasks.distinct("_id")) == ["max", "small"]
    assert await tasks.count_documents({"n": {"$exists": True}}) == 1


# -- inserts in constant time ----------------------------------------------------------------


async def _task_documents(count: int, start: int) -> list[Doc]:
    now = datetime.now(UTC)
    return [
        {
            "_id": bson.ObjectId(),
            "key": f"task-{start + i}",
            "name": "resize",
            "state": "PENDING",
            "claimable_at": now,
            "priority": 0,
            "created_at": now,
            "updated_at": now,
            "params": {"i": start + i},
            "workers": [],
        }
        for i in range(count)
    ]


async def _documents_read_per_insert(server: EmbeddedServer, tasks: Any, stored: int) -> float:
    engine = server._client._engine
    reads = 0
    borrow: Callable[..., Doc] = engine._borrow_storage_document

    def counted(*args: Any, **kwargs: Any) -> Doc:
        nonlocal reads
        reads += 1
        return borrow(*args, **kwargs)

    engine._borrow_storage_document = counted
    try:
        await tasks.insert_many(await _task_documents(50, stored))
    finally:
        del engine._borrow_storage_document
    return reads / 50


async def test_an_insert_reads_no_stored_documents_however_many_there_are(server: EmbeddedServer) -> None:
    """Inserting task documents (taskrunner's indexes in place) reads the same number of stored
    documents per insert at 100 and at 600 documents: none, where mongoeco read them all."""
    async with TaskRunner(server.uri, collection="tasks") as runner:
        await runner.init()
    async with AsyncMongoClient[Doc](server.uri) as client:
        tasks = client.taskrunner.tasks
        await tasks.insert_many(await _task_documents(100, 0))
        at_100 = await _documents_read_per_insert(server, tasks, 100)
        await tasks.insert_many(await _task_documents(450, 150))
        at_600 = await _documents_read_per_insert(server, tasks, 600)
    assert (at_100, at_600) == (0, 0)


async def test_equal_numeric_ids_are_still_one_id(client: AsyncMongoClient[Doc]) -> None:
    """1, 1.0 and Int64(1) are one _id (mongoeco's scan kept for numeric ids): the second insert fails."""
    tasks = client.taskrunner.tasks
    await tasks.insert_one({"_id": 1})
    refused = []
    for same in (1.0, Int64(1)):
        with pytest.raises(DuplicateKeyError):
            await tasks.insert_one({"_id": same})
        refused.append(same)
    assert refused == [1.0, Int64(1)]
    assert await tasks.count_documents({}) == 1
