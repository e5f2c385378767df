"""The embedded server's MongoDB behaviours: the 16 MiB document limit and inserts in constant time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import bson
import pytest
from bson.int64 import Int64
from pymongo import AsyncMongoClient
from pymongo.errors import DuplicateKeyError, OperationFailure, WriteError

from taskrunner import TaskRunner
from taskrunner.dev.engine import MAX_BSON_OBJECT_SIZE
from taskrunner.dev.server import EmbeddedServer

pytestmark = pytest.mark.embedded

Doc = dict[str, Any]


@pytest.fixture
async def server() -> AsyncIterator[EmbeddedServer]:
    """A fresh in-process server per test."""
    async with EmbeddedServer() as embedded:
        yield embedded


@pytest.fixture
async def client(server: EmbeddedServer) -> AsyncIterator[AsyncMongoClient[Doc]]:
    mongo: AsyncMongoClient[Doc] = AsyncMongoClient(server.uri)
    async with mongo:
        yield mongo


# -- the 16 MiB document limit -------------------------------------------------------------


def _sized(size: int, **fields: Any) -> Doc:
    """A document of exactly `size` BSON bytes."""
    document = {**fields, "x": ""}
    document["x"] = "a" * (size - len(bson.encode(document)))
    assert len(bson.encode(document)) == size
    return document


async def test_documents_over_16_mib_are_refused_as_mongodb_7_refuses_them(
    client: AsyncMongoClient[Doc],
) -> None:
    """A 16 MiB document is stored; one byte more is refused: insert BadValue (2), an update
    whose result is larger 17419, an upsert 17420 (findAndModify as a command error); nothing
    changes."""
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
