"""Multi-document transactions as a replica-set primary runs them, through PyMongo's async API:
atomic commit, abort, isolation from other sessions and change streams, write conflicts and
``with_transaction`` retries, unique keys, ended sessions, the lifetime limit and the commands
refused inside a transaction. Each test holds on a real MongoDB replica set too
(``TASKRUNNER_TEST_MONGO_URI``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import DuplicateKeyError, ExecutionTimeout, OperationFailure

from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

Doc = dict[str, Any]
TRANSIENT = "TransientTransactionError"


@pytest.fixture
async def client(mongo_uri: str) -> AsyncIterator[AsyncMongoClient[Doc]]:
    connected: AsyncMongoClient[Doc] = AsyncMongoClient(mongo_uri)
    async with connected:
        yield connected


@pytest.fixture
async def other(mongo_uri: str) -> AsyncIterator[AsyncMongoClient[Doc]]:
    """A second client: another application, or a worker, outside the transaction."""
    connected: AsyncMongoClient[Doc] = AsyncMongoClient(mongo_uri)
    async with connected:
        yield connected


@pytest.fixture
async def items(client: AsyncMongoClient[Doc]) -> AsyncIterator[AsyncCollection[Doc]]:
    """A fresh collection, created before the test (as taskrunner's collection is)."""
    collection = client[f"txn_{uuid.uuid4().hex[:12]}"].items
    await collection.insert_one({"_id": "existing", "n": 0})
    yield collection
    await client.drop_database(collection.database.name)


def twin(client: AsyncMongoClient[Doc], collection: AsyncCollection[Doc]) -> AsyncCollection[Doc]:
    return client[collection.database.name][collection.name]


async def test_commit_makes_every_write_visible_at_once_while_others_write(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """A transaction's inserts and update are invisible to another session until commit, then
    all visible together, though other documents were written meanwhile (a worker's heartbeat)."""
    outside = twin(other, items)
    async with client.start_session() as session:
        await session.start_transaction()
        await items.insert_many([{"_id": "a"}, {"_id": "b"}], session=session)
        await items.update_one({"_id": "existing"}, {"$set": {"n": 1}}, session=session)
        await outside.insert_one({"_id": "heartbeat"})
        await outside.update_one({"_id": "heartbeat"}, {"$set": {"beat": 1}})
        assert await outside.find({}, sort=[("_id", 1)]).to_list() == [
            {"_id": "existing", "n": 0},
            {"_id": "heartbeat", "beat": 1},
        ]
        inside = await items.find({}, sort=[("_id", 1)], session=session).to_list()
        assert [d["_id"] for d in inside] == ["a", "b", "existing"]  # its snapshot and its writes
        await session.commit_transaction()
    assert await outside.find({}, sort=[("_id", 1)]).to_list() == [
        {"_id": "a"},
        {"_id": "b"},
        {"_id": "existing", "n": 1},
        {"_id": "heartbeat", "beat": 1},
    ]


async def test_abort_discards_every_write_and_a_retried_commit_commits_once(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """Aborting discards all of a transaction's writes and committing it then fails NoSuchTransaction
    (251); committing a committed transaction again (a driver's retry) succeeds without applying
    anything twice."""
    async with client.start_session() as session:
        async with await session.start_transaction():
            await items.insert_one({"_id": "gone"}, session=session)
            await items.update_one({"_id": "existing"}, {"$inc": {"n": 5}}, session=session)
            await session.abort_transaction()
        assert await twin(other, items).find({}).to_list() == [{"_id": "existing", "n": 0}]
        with pytest.raises(OperationFailure) as no_such:  # committing it anyway, as a raw command
            await client.admin.command(
                {
                    "commitTransaction": 1,
                    "txnNumber": session._server_session.transaction_id,
                    "autocommit": False,
                },
                session=session,
            )
        assert no_such.value.code == 251 and no_such.value.has_error_label(TRANSIENT)
        await session.start_transaction()
        await items.update_one({"_id": "existing"}, {"$inc": {"n": 1}}, session=session)
        await session.commit_transaction()
        await session.commit_transaction()  # PyMongo sends commitTransaction again, as on a retry
    assert await twin(other, items).find({}).to_list() == [{"_id": "existing", "n": 1}]


async def test_change_stream_sees_a_transaction_only_at_commit_with_its_lsid(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """A watching change stream gets nothing of an open transaction; at commit it gets each write,
    in order, with the transaction's lsid and txnNumber and one cluster time."""
    stream = await twin(other, items).watch(max_await_time_ms=200)
    async with client.start_session() as session:
        await session.start_transaction()
        await items.insert_one({"_id": "t1"}, session=session)
        await items.update_one({"_id": "existing"}, {"$set": {"n": 2}}, session=session)
        await items.delete_one({"_id": "t1"}, session=session)
        assert await stream.try_next() is None
        assert await stream.try_next() is None
        await session.commit_transaction()
        lsid = session.session_id
    events = [await wait_for(stream.try_next, what=f"event {i}") for i in range(3)]
    await stream.close()
    assert [(e["operationType"], e["documentKey"]["_id"]) for e in events] == [
        ("insert", "t1"),
        ("update", "existing"),
        ("delete", "t1"),
    ]
    assert all(e["lsid"]["id"] == lsid["id"] for e in events)
    assert len({e["txnNumber"] for e in events}) == 1 and events[0]["txnNumber"] >= 1
    assert len({e["clusterTime"] for e in events}) == 1


async def test_write_conflict_is_transient_and_with_transaction_retries_until_it_commits(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """Writing a document another open transaction wrote fails WriteConflict (112) labelled
    TransientTransactionError; ``with_transaction`` retries until the first commits, then commits."""
    async with client.start_session() as first, other.start_session() as second:
        await first.start_transaction()
        await items.update_one({"_id": "existing"}, {"$inc": {"n": 1}}, session=first)
        await second.start_transaction()
        with pytest.raises(OperationFailure) as conflict:
            await twin(other, items).update_one({"_id": "existing"}, {"$inc": {"n": 10}}, session=second)
        assert conflict.value.code == 112 and conflict.value.has_error_label(TRANSIENT)
        await second.abort_transaction()

        attempts = 0

        async def increment(session: AsyncClientSession) -> None:
            nonlocal attempts
            attempts += 1
            await twin(other, items).update_one({"_id": "existing"}, {"$inc": {"n": 10}}, session=session)

        retrying = asyncio.create_task(second.with_transaction(increment))
        await wait_for(lambda: attempts >= 2, what="with_transaction retrying")
        await first.commit_transaction()
        await retrying
    assert await items.find_one({"_id": "existing"}) == {"_id": "existing", "n": 11}


async def test_concurrent_with_transactions_on_one_document_all_commit_once(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """Eight ``with_transaction`` calls that each insert a document and increment one counter,
    beside writes outside transactions to the counter: every increment and insert lands once."""

    async def increment(i: int) -> None:
        async def body(session: AsyncClientSession) -> None:
            await items.insert_one({"_id": f"t{i}"}, session=session)
            await items.update_one({"_id": "existing"}, {"$inc": {"n": 1}}, session=session)

        async with client.start_session() as session:
            await session.with_transaction(body)

    async def outside() -> None:
        for _ in range(8):
            await twin(other, items).update_one({"_id": "existing"}, {"$inc": {"n": 100}})

    await asyncio.gather(*(increment(i) for i in range(8)), outside())
    assert await items.find_one({"_id": "existing"}) == {"_id": "existing", "n": 808}
    assert await items.count_documents({"_id": {"$regex": "^t"}}) == 8


async def test_a_document_written_after_the_snapshot_conflicts(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """A transaction writing a document that was written outside it after its snapshot fails
    WriteConflict, transient, rather than overwriting the newer write."""
    async with client.start_session() as session:
        await session.start_transaction()
        assert await items.find_one({"_id": "existing"}, session=session) == {"_id": "existing", "n": 0}
        await twin(other, items).update_one({"_id": "existing"}, {"$set": {"n": 7}})
        with pytest.raises(OperationFailure) as conflict:
            await items.update_one({"_id": "existing"}, {"$inc": {"n": 1}}, session=session)
        assert conflict.value.code == 112 and conflict.value.has_error_label(TRANSIENT)
        await session.abort_transaction()
    assert await items.find_one({"_id": "existing"}) == {"_id": "existing", "n": 7}


async def test_same_id_in_two_transactions_conflicts_then_is_a_duplicate_key(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """Two transactions inserting one ``_id``: the second fails WriteConflict while the first is
    open; once the first committed, the second's retry fails DuplicateKey; one document."""
    async with client.start_session() as first, other.start_session() as second:
        await first.start_transaction()
        await items.insert_one({"_id": "key", "by": "first"}, session=first)
        await second.start_transaction()
        with pytest.raises(OperationFailure) as conflict:
            await twin(other, items).insert_one({"_id": "key", "by": "second"}, session=second)
        assert conflict.value.code == 112 and conflict.value.has_error_label(TRANSIENT)
        await second.abort_transaction()
        await first.commit_transaction()
        await second.start_transaction()
        with pytest.raises(DuplicateKeyError):
            await twin(other, items).insert_one({"_id": "key", "by": "second"}, session=second)
        await second.abort_transaction()
    assert await items.find({"_id": "key"}).to_list() == [{"_id": "key", "by": "first"}]


async def test_same_unique_key_in_two_transactions_commits_one(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """Two transactions upserting one value of a unique secondary key (taskrunner's idempotent
    publish): the second fails WriteConflict, transient, while the first is open; an outside
    upsert of it waits for the first; after the first commits, the second's retry updates the
    first's document: one document holds the key."""
    await items.create_index("key", unique=True)
    outside = twin(other, items)

    def publish(by: str) -> dict[str, Any]:
        return {"$setOnInsert": {"_id": by, "by": by}, "$inc": {"seen": 1}}

    async with client.start_session() as first, other.start_session() as second:
        await first.start_transaction()
        await items.find_one_and_update({"key": "k"}, publish("first"), upsert=True, session=first)
        await second.start_transaction()
        with pytest.raises(OperationFailure) as conflict:
            await outside.find_one_and_update({"key": "k"}, publish("second"), upsert=True, session=second)
        assert conflict.value.code == 112 and conflict.value.has_error_label(TRANSIENT)
        await second.abort_transaction()
        with pytest.raises(ExecutionTimeout):
            await outside.find_one_and_update({"key": "k"}, publish("outside"), upsert=True, maxTimeMS=300)
        await first.commit_transaction()
        await second.start_transaction()
        await outside.find_one_and_update({"key": "k"}, publish("second"), upsert=True, session=second)
        await second.commit_transaction()
    assert await items.find({"key": "k"}).to_list() == [
        {"_id": "first", "key": "k", "by": "first", "seen": 2}
    ]


async def test_a_write_outside_waits_for_the_transaction_holding_its_document(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """A write outside transactions to a document an open transaction wrote waits until it ends
    (past ``maxTimeMS`` it fails MaxTimeMSExpired), then applies on top of the committed write."""
    outside = twin(other, items)
    async with client.start_session() as session:
        await session.start_transaction()
        await items.update_one({"_id": "existing"}, {"$set": {"n": 10}}, session=session)
        with pytest.raises(ExecutionTimeout):
            await outside.find_one_and_update({"_id": "existing"}, {"$inc": {"n": 1}}, maxTimeMS=300)
        waiting = asyncio.create_task(outside.update_one({"_id": "existing"}, {"$inc": {"n": 1}}))
        await session.commit_transaction()
        assert (await waiting).modified_count == 1
    assert await items.find_one({"_id": "existing"}) == {"_id": "existing", "n": 11}


async def test_a_write_outside_waits_only_for_the_documents_it_targets(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """Outside writes whose target is not held by the open transaction (a claim that sorts another
    document first) go ahead at once; an upsert of the ``_id`` the transaction inserted waits."""
    outside = twin(other, items)
    await items.insert_many([{"_id": "a", "rank": 1}, {"_id": "b", "rank": 2}])
    async with client.start_session() as session:
        await session.start_transaction()
        await items.update_one({"_id": "b"}, {"$set": {"held": True}}, session=session)
        await items.insert_one({"_id": "new"}, session=session)
        claimed = await outside.find_one_and_update(
            {"rank": {"$gte": 1}}, {"$set": {"claimed": True}}, sort=[("rank", 1)], maxTimeMS=5000
        )
        assert claimed is not None and claimed["_id"] == "a"
        await outside.find_one_and_update({"_id": "existing"}, {"$inc": {"n": 1}}, maxTimeMS=5000)
        with pytest.raises(ExecutionTimeout):
            await outside.find_one_and_update(
                {"rank": {"$gte": 1}}, {"$set": {"claimed": True}}, sort=[("rank", -1)], maxTimeMS=300
            )
        with pytest.raises(ExecutionTimeout):
            await outside.find_one_and_update(
                {"_id": "new"}, {"$set": {"upserted": True}}, upsert=True, maxTimeMS=300
            )
        await session.commit_transaction()
    assert await items.find({}, sort=[("_id", 1)]).to_list() == [
        {"_id": "a", "rank": 1, "claimed": True},
        {"_id": "b", "rank": 2, "held": True},
        {"_id": "existing", "n": 1},
        {"_id": "new"},
    ]


async def test_ending_the_session_aborts_its_transaction(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """Leaving ``start_session()`` with a transaction open aborts it (the driver sends
    abortTransaction): its writes never appear and a write waiting for its document goes on."""
    async with client.start_session() as session:
        await session.start_transaction()
        await items.insert_one({"_id": "pending"}, session=session)
        waiting = asyncio.create_task(twin(other, items).insert_one({"_id": "pending", "by": "other"}))
    await waiting
    assert await items.find({"_id": "pending"}).to_list() == [{"_id": "pending", "by": "other"}]


@pytest.fixture
async def lifetime_of_one_second(client: AsyncMongoClient[Doc]) -> AsyncIterator[None]:
    """transactionLifetimeLimitSeconds set to 1 for the test, then set back."""
    was = await client.admin.command({"setParameter": 1, "transactionLifetimeLimitSeconds": 1})
    try:
        yield
    finally:
        await client.admin.command({"setParameter": 1, "transactionLifetimeLimitSeconds": was["was"]})
    parameter = await client.admin.command({"getParameter": 1, "transactionLifetimeLimitSeconds": 1})
    assert parameter["transactionLifetimeLimitSeconds"] == was["was"]


@pytest.mark.usefixtures("lifetime_of_one_second")
async def test_the_lifetime_limit_aborts_a_transaction(
    client: AsyncMongoClient[Doc], other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """A transaction older than ``transactionLifetimeLimitSeconds`` (set with setParameter) is
    aborted: a write waiting for its document goes on and its commit fails NoSuchTransaction."""
    async with client.start_session() as session:
        await session.start_transaction()
        await items.insert_one({"_id": "abandoned"}, session=session)
        await twin(other, items).insert_one({"_id": "abandoned", "by": "other"})  # waits ~1 s
        with pytest.raises(OperationFailure) as aborted:
            await session.commit_transaction()
        assert aborted.value.code == 251 and aborted.value.has_error_label(TRANSIENT)
    assert await items.find({"_id": "abandoned"}).to_list() == [{"_id": "abandoned", "by": "other"}]


@pytest.mark.usefixtures("lifetime_of_one_second")
async def test_a_client_gone_mid_transaction_leaves_nothing(
    mongo_uri: str, other: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """A client that disappears inside a transaction (its connections closed, its session never
    ended, as when its process crashes) commits nothing; the lifetime limit frees its documents."""
    gone: AsyncMongoClient[Doc] = AsyncMongoClient(mongo_uri)
    session = gone.start_session()
    await session.start_transaction()
    await twin(gone, items).insert_one({"_id": "crashed"}, session=session)
    await twin(gone, items).update_one({"_id": "existing"}, {"$set": {"n": 99}}, session=session)
    await gone.close()  # a checked-out session is not ended: no abortTransaction, no endSessions
    await twin(other, items).update_one({"_id": "existing"}, {"$inc": {"n": 1}})  # waits for the limit
    assert await items.find({}).to_list() == [{"_id": "existing", "n": 1}]


async def test_commands_refused_inside_a_transaction(
    client: AsyncMongoClient[Doc], items: AsyncCollection[Doc]
) -> None:
    """Inside a transaction ``count`` fails OperationNotSupportedInTransaction (263), a
    statement's own writeConcern and a readConcern after the first statement fail InvalidOptions
    (72) without ending the transaction; creating a collection implicitly works."""
    database = items.database
    async with client.start_session() as session:
        await session.start_transaction()
        with pytest.raises(OperationFailure) as count:
            await database.command("count", items.name, session=session)
        assert count.value.code == 263
        await session.abort_transaction()
        async with await session.start_transaction():
            with pytest.raises(OperationFailure) as write_concern:
                await database.command(
                    {"insert": items.name, "documents": [{"_id": "wc"}], "writeConcern": {"w": 1}},
                    session=session,
                )
            assert write_concern.value.code == 72
            await items.insert_one({"_id": "first"}, session=session)
            with pytest.raises(OperationFailure) as read_concern:
                await database.command(
                    {"find": items.name, "readConcern": {"level": "snapshot"}}, session=session
                )
            assert read_concern.value.code == 72
        async with await session.start_transaction():
            await database.created_in_transaction.insert_one({"_id": 1}, session=session)
            assert await items.count_documents({}, session=session) == 2  # an aggregate: allowed
    assert await database.created_in_transaction.find().to_list() == [{"_id": 1}]
    assert await items.find_one({"_id": "first"}) == {"_id": "first"}
