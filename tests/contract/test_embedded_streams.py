"""The embedded server's change streams and comparisons behave as MongoDB's, seen through PyMongo.

Each test starts its own server (``EmbeddedServer``) so that drops, ended streams and cluster
times of one test never reach another.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator
from typing import Any

import pytest
from bson import Timestamp
from bson.max_key import MaxKey
from bson.min_key import MinKey
from pymongo import AsyncMongoClient, monitoring
from pymongo.asynchronous.change_stream import AsyncChangeStream
from pymongo.errors import OperationFailure

from taskrunner.dev.server import EmbeddedServer
from taskrunner.testing import wait_for

pytestmark = pytest.mark.embedded

Client = AsyncMongoClient[dict[str, Any]]
Stream = AsyncChangeStream[dict[str, Any]]


class _Recorder(monitoring.CommandListener):
    """Keeps every command started, every reply and every failure, in order."""

    def __init__(self) -> None:
        self.started_commands: list[str] = []
        self.replies: list[tuple[str, dict[str, Any]]] = []
        self.failures: list[tuple[str, dict[str, Any]]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.started_commands.append(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self.replies.append((event.command_name, dict(event.reply)))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self.failures.append((event.command_name, dict(event.failure)))

    def last(self, command: str) -> dict[str, Any]:
        return [reply for name, reply in self.replies if name == command][-1]


@pytest.fixture
async def server() -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer() as running:
        yield running


@pytest.fixture
def recorder() -> _Recorder:
    return _Recorder()


@pytest.fixture
async def client(server: EmbeddedServer, recorder: _Recorder) -> AsyncIterator[Client]:
    async with Client(server.uri, event_listeners=[recorder]) as connected:
        yield connected


async def _drain(stream: Stream) -> list[dict[str, Any]]:
    """Every event the stream has now, until a getMore comes back empty or the stream ends."""
    events = []
    while stream.alive and (event := await stream.try_next()) is not None:
        events.append(event)
    return events


def _shape(event: dict[str, Any]) -> tuple[Any, ...]:
    """An event without its token and times: type, namespace, rename target, document key."""
    return (
        event["operationType"],
        event.get("ns"),
        event.get("to"),
        event.get("documentKey"),
    )


# Stream ends: drop, rename and dropDatabase end the streams they invalidate, as on MongoDB.


async def test_drop_sends_drop_then_invalidate_and_closes_the_cursor(
    client: Client, recorder: _Recorder
) -> None:
    """Dropping a watched collection gives a drop event, an invalidate event, then cursor id 0."""
    tasks = client.db.tasks
    stream = await tasks.watch(max_await_time_ms=500)
    await tasks.insert_one({"_id": 1})
    await tasks.drop()
    events = await _drain(stream)
    assert [_shape(event) for event in events] == [
        ("insert", {"db": "db", "coll": "tasks"}, None, {"_id": 1}),
        ("drop", {"db": "db", "coll": "tasks"}, None, None),
        ("invalidate", None, None, None),
    ]
    assert set(events[2]) == {"_id", "operationType", "clusterTime", "wallTime"}
    assert recorder.last("getMore")["cursor"]["id"] == 0
    assert not stream.alive
    assert [name for name, _ in recorder.failures] == []


async def test_invalidate_hidden_by_match_still_closes_the_cursor(
    client: Client, recorder: _Recorder
) -> None:
    """With a $match that hides drop and invalidate, the getMore answers ok, an empty batch and id 0."""
    tasks = client.db.tasks
    stream = await tasks.watch([{"$match": {"operationType": "insert"}}], max_await_time_ms=500)
    await tasks.insert_one({"_id": 1})
    assert (await stream.try_next() or {}).get("documentKey") == {"_id": 1}
    await tasks.drop()
    assert await stream.try_next() is None
    reply = recorder.last("getMore")
    assert (reply["ok"], reply["cursor"]["id"], reply["cursor"]["nextBatch"]) == (1.0, 0, [])
    assert not stream.alive
    assert await stream.try_next() is None  # a dead stream answers at once, without I/O
    assert [name for name, _ in recorder.failures] == []


async def test_rename_invalidates_streams_on_source_and_target(client: Client) -> None:
    """A rename (dropping its target) gives streams on both names a rename event then an invalidate."""
    db = client.db
    await db.source.insert_one({"_id": 1})
    await db.target.insert_one({"_id": 2})
    on_source = await db.source.watch(max_await_time_ms=500)
    on_target = await db.target.watch(max_await_time_ms=500)
    on_db = await db.watch(max_await_time_ms=500)
    await db.source.rename("target", dropTarget=True)
    rename = ("rename", {"db": "db", "coll": "source"}, {"db": "db", "coll": "target"}, None)
    invalidate = ("invalidate", None, None, None)
    assert [_shape(event) for event in await _drain(on_source)] == [rename, invalidate]
    assert [_shape(event) for event in await _drain(on_target)] == [rename, invalidate]
    assert [_shape(event) for event in await _drain(on_db)] == [rename]
    assert on_db.alive
    assert await db.list_collection_names() == ["target"]


async def test_drop_database_ends_collection_and_database_streams_but_not_cluster_streams(
    client: Client,
) -> None:
    """dropDatabase: a collection stream sees its drop, a database stream every drop and
    dropDatabase, each then invalidated; a cluster stream sees the same and stays open."""
    db = client.gone
    await db.a.insert_one({"_id": 1})
    await db.b.insert_one({"_id": 2})
    on_a = await db.a.watch(max_await_time_ms=500)
    on_db = await db.watch(max_await_time_ms=500)
    on_cluster = await client.watch([{"$match": {"ns.db": "gone"}}], max_await_time_ms=500)
    await client.drop_database("gone")
    await db.a.insert_one({"_id": 3})
    drop_a = ("drop", {"db": "gone", "coll": "a"}, None, None)
    drop_b = ("drop", {"db": "gone", "coll": "b"}, None, None)
    dropped = ("dropDatabase", {"db": "gone"}, None, None)
    invalidate = ("invalidate", None, None, None)
    insert = ("insert", {"db": "gone", "coll": "a"}, None, {"_id": 3})
    assert [_shape(event) for event in await _drain(on_a)] == [drop_a, invalidate]
    db_events = [_shape(event) for event in await _drain(on_db)]
    assert sorted(db_events[:2], key=repr) == [drop_a, drop_b]
    assert db_events[2:] == [dropped, invalidate]
    cluster_events = [_shape(event) for event in await _drain(on_cluster)]
    assert sorted(cluster_events[:2], key=repr) == [drop_a, drop_b]
    assert cluster_events[2:] == [dropped, insert]
    assert on_cluster.alive
    assert not on_a.alive
    assert not on_db.alive


async def test_dropping_a_missing_collection_sends_no_event(client: Client) -> None:
    """Dropping a collection that does not exist leaves its streams open and eventless."""
    stream = await client.db.never.watch(max_await_time_ms=300)
    await client.db.never.drop()
    await client.db.never.insert_one({"_id": 1})
    assert [_shape(event) for event in await _drain(stream)] == [
        ("insert", {"db": "db", "coll": "never"}, None, {"_id": 1})
    ]
    assert stream.alive


# Resuming after an invalidate.


async def test_resume_after_invalidate_is_260_and_start_after_opens_a_new_stream(client: Client) -> None:
    """resumeAfter an invalidate token fails with 260 (InvalidResumeToken); startAfter it sees what
    happened after the drop."""
    tasks = client.db.tasks
    stream = await tasks.watch([{"$match": {"operationType": "insert"}}], max_await_time_ms=500)
    await tasks.insert_one({"_id": 1})
    await tasks.drop()
    await tasks.insert_one({"_id": 2})
    assert [event["documentKey"] for event in await _drain(stream)] == [{"_id": 1}]
    assert not stream.alive
    token = stream.resume_token
    with pytest.raises(OperationFailure) as failure:
        await tasks.watch(resume_after=token)
    assert failure.value.code == 260
    assert failure.value.details is not None
    assert failure.value.details["codeName"] == "InvalidResumeToken"
    async with await tasks.watch(start_after=token, max_await_time_ms=500) as after:
        assert [_shape(event) for event in await _drain(after)] == [
            ("insert", {"db": "db", "coll": "tasks"}, None, {"_id": 2})
        ]


async def test_resume_after_the_drop_event_gives_the_invalidate(client: Client) -> None:
    """Resuming after a drop event's token gives that drop's invalidate event, then id 0."""
    tasks = client.db.tasks
    stream = await tasks.watch(max_await_time_ms=500)
    await tasks.insert_one({"_id": 1})
    await tasks.drop()
    events = await _drain(stream)
    drop_token = events[1]["_id"]
    resumed = await tasks.watch(resume_after=drop_token, max_await_time_ms=500)
    assert [event["operationType"] for event in await _drain(resumed)] == ["invalidate"]
    assert not resumed.alive


# The bridge's own divergences.


async def test_drops_lose_no_later_event_on_any_collection(client: Client) -> None:
    """After three drops, three inserts into another collection all reach its stream."""
    db = client.db
    stream = await db.kept.watch(max_await_time_ms=500)
    for name in ("x", "y", "z"):
        await db[name].insert_one({"_id": name})
        await db[name].drop()
    await db.kept.insert_many([{"_id": i} for i in range(3)])
    assert [event["documentKey"] for event in await _drain(stream)] == [{"_id": i} for i in range(3)]


async def test_stream_opened_right_after_a_drop_sees_its_first_events(client: Client) -> None:
    """A stream opened just after a drop gets the inserts that follow, the first included."""
    db = client.db
    await db.old.insert_one({"_id": 0})
    await db.old.drop()
    stream = await db.fresh.watch(max_await_time_ms=500)
    await db.fresh.insert_many([{"_id": 1}, {"_id": 2}])
    assert [event["documentKey"] for event in await _drain(stream)] == [{"_id": 1}, {"_id": 2}]


async def test_collection_drop_leaves_database_and_cluster_streams_open(client: Client) -> None:
    """Database- and cluster-level streams report a collection drop and keep delivering."""
    db = client.db
    await db.dropped.insert_one({"_id": 0})
    on_db = await db.watch(max_await_time_ms=500)
    on_cluster = await client.watch(max_await_time_ms=500)
    await db.dropped.drop()
    await db.other.insert_one({"_id": 1})
    expected = [
        ("drop", {"db": "db", "coll": "dropped"}, None, None),
        ("insert", {"db": "db", "coll": "other"}, None, {"_id": 1}),
    ]
    assert [_shape(event) for event in await _drain(on_db)] == expected
    assert [_shape(event) for event in await _drain(on_cluster)] == expected
    assert on_db.alive
    assert on_cluster.alive


async def test_token_from_another_server_is_not_found_280(client: Client) -> None:
    """A resume token minted by another server is unknown here: once this server's history passes
    the token's time the stream fails with 280 (ChangeStreamFatalError) instead of skipping events."""
    async with EmbeddedServer() as other, Client(other.uri) as elsewhere:
        stream = await elsewhere.db.tasks.watch(max_await_time_ms=500)
        await elsewhere.db.tasks.insert_one({"_id": "elsewhere"})
        foreign = await stream.next()
    tasks = client.db.tasks

    async def resume_and_write() -> None:
        resumed = await tasks.watch(resume_after=foreign["_id"], max_await_time_ms=200)
        # Cluster times are (second, increment); the other server's clock ticked twice (its
        # start and its one insert), so within one second three writes here pass its time.
        for n in range(3):
            await tasks.insert_one({"_id": n})
            await resumed.try_next()

    with pytest.raises(OperationFailure) as failure:
        await resume_and_write()
    assert failure.value.code == 280
    assert failure.value.has_error_label("NonResumableChangeStreamError")


async def test_event_times_are_timestamps_and_replies_carry_cluster_time(
    client: Client, recorder: _Recorder
) -> None:
    """Events carry a BSON Timestamp clusterTime and a wallTime; replies carry operationTime and
    $clusterTime, which advance with each write."""
    tasks = client.db.tasks
    stream = await tasks.watch(max_await_time_ms=500)
    await tasks.insert_one({"_id": 1})
    inserted = recorder.last("insert")
    await tasks.insert_one({"_id": 2})
    events = await _drain(stream)
    first, second = (event["clusterTime"] for event in events)
    assert isinstance(first, Timestamp)
    assert first < second
    assert isinstance(events[0]["wallTime"], datetime.datetime)
    assert inserted["operationTime"] == first
    assert inserted["$clusterTime"]["clusterTime"] == first
    assert set(inserted["$clusterTime"]["signature"]) == {"hash", "keyId"}
    assert recorder.last("getMore")["operationTime"] >= second


async def test_start_at_operation_time_replays_from_that_time(client: Client) -> None:
    """A stream opened with startAtOperationTime sees the writes at and after that cluster time."""
    tasks = client.db.tasks
    await tasks.insert_one({"_id": "before"})
    async with client.start_session() as session:
        await tasks.insert_one({"_id": "at"}, session=session)
        at = session.operation_time
    await tasks.insert_one({"_id": "after"})
    assert at is not None
    stream = await tasks.watch(start_at_operation_time=at, max_await_time_ms=500)
    assert [event["documentKey"]["_id"] for event in await _drain(stream)] == ["at", "after"]


async def test_start_at_operation_time_before_the_history_is_286(client: Client) -> None:
    """startAtOperationTime older than the retained history fails with 286 (ChangeStreamHistoryLost)."""
    with pytest.raises(OperationFailure) as failure:
        await client.db.tasks.watch(start_at_operation_time=Timestamp(1, 1))
    assert failure.value.code == 286
    assert failure.value.has_error_label("NonResumableChangeStreamError")


# Ending streams on purpose (the endStreams fault).


async def test_end_closes_the_streams_of_one_namespace(server: EmbeddedServer, client: Client) -> None:
    """ChangeStreams.end(ns) closes every stream on ns (None and not alive next), not the others."""
    db = client.taskrunner
    ended = [await db.tasks.watch(max_await_time_ms=300) for _ in range(2)]
    kept = await db.other.watch(max_await_time_ms=300)
    assert server.streams.end("taskrunner.tasks") == 2
    await db.tasks.insert_one({"_id": 1})
    await db.other.insert_one({"_id": 1})
    for stream in ended:
        assert await stream.try_next() is None
        assert not stream.alive
    assert (await kept.try_next() or {}).get("documentKey") == {"_id": 1}
    assert kept.alive
    later = await db.tasks.watch(max_await_time_ms=300)
    await db.tasks.insert_one({"_id": 2})
    assert [event["documentKey"] for event in await _drain(later)] == [{"_id": 2}]


async def test_end_answers_a_parked_get_more_at_once(
    server: EmbeddedServer, client: Client, recorder: _Recorder
) -> None:
    """A getMore waiting on a 30 s maxAwaitTimeMS returns empty with id 0 as soon as end() runs."""
    stream = await client.db.tasks.watch(max_await_time_ms=30_000)
    waiting = asyncio.create_task(stream.try_next())
    await wait_for(lambda: "getMore" in recorder.started_commands, what="the getMore to be sent")
    assert server.streams.end(None) == 1
    assert await asyncio.wait_for(waiting, timeout=20) is None
    assert not stream.alive
    assert recorder.last("getMore")["cursor"] == {
        "nextBatch": [],
        "id": 0,
        "ns": "db.tasks",
        "postBatchResumeToken": stream.resume_token,
    }


async def test_an_ended_stream_resumes_only_with_start_after(server: EmbeddedServer, client: Client) -> None:
    """An ended stream's last token is an invalidate's: resumeAfter fails 260, startAfter continues."""
    tasks = client.db.tasks
    stream = await tasks.watch(max_await_time_ms=300)
    server.streams.end("db.tasks")
    assert await stream.try_next() is None
    await tasks.insert_one({"_id": 1})
    with pytest.raises(OperationFailure) as failure:
        await tasks.watch(resume_after=stream.resume_token)
    assert failure.value.code == 260
    after = await tasks.watch(start_after=stream.resume_token, max_await_time_ms=300)
    assert [event["documentKey"] for event in await _drain(after)] == [{"_id": 1}]


# Type bracketing: query-language comparisons match one BSON type bracket; $expr compares across.

_DAY = datetime.datetime(2024, 1, 2)
_VALUES: dict[str, Any] = {
    "null": None,
    "int": 5,
    "float": 1.5,
    "string": "s",
    "bool": True,
    "object": {"a": 1},
    "earlier": _DAY - datetime.timedelta(days=1),
    "later": _DAY + datetime.timedelta(days=1),
    "dates-in-array": [1, _DAY - datetime.timedelta(days=2)],
    "numbers-in-array": [1, 2],
    "minkey": MinKey(),
    "maxkey": MaxKey(),
}


async def _seed(client: Client) -> Any:
    things = client.db.things
    await things.insert_many(
        [{"_id": name, "v": value, "n": {"v": value}} for name, value in _VALUES.items()]
        + [{"_id": "missing", "n": {}}]
    )
    return things


async def _ids(cursor: Any) -> list[str]:
    return sorted(document["_id"] for document in await cursor.to_list())


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        ({"$lte": _DAY}, ["dates-in-array", "earlier"]),
        ({"$lt": _DAY}, ["dates-in-array", "earlier"]),
        ({"$gt": _DAY}, ["later"]),
        ({"$gte": _DAY}, ["later"]),
        ({"$lt": 3}, ["dates-in-array", "float", "numbers-in-array"]),
        ({"$gte": "a"}, ["string"]),
        ({"$lte": None}, ["missing", "null"]),
        ({"$gte": None}, ["missing", "null"]),
        ({"$lt": None}, []),
        ({"$gt": MinKey()}, sorted(set(_VALUES) - {"minkey"} | {"missing"})),
        ({"$lt": MaxKey()}, sorted(set(_VALUES) - {"maxkey"} | {"missing"})),
    ],
)
async def test_range_queries_match_only_the_bounds_type_bracket(
    client: Client, condition: dict[str, Any], expected: list[str]
) -> None:
    """$lt/$lte/$gt/$gte in find, dotted paths, aggregate $match, count, update and delete filters
    match only values of the bound's type (arrays by element; null also missing; MinKey/MaxKey all)."""
    things = await _seed(client)
    await things.create_index("v")
    assert await _ids(things.find({"v": condition})) == expected
    assert await _ids(things.find({"n.v": condition})) == expected
    assert await _ids(await things.aggregate([{"$match": {"v": condition}}])) == expected
    assert await things.count_documents({"v": condition}) == len(expected)
    updated = await things.update_many({"v": condition}, {"$set": {"hit": True}})
    assert updated.modified_count == len(expected)
    assert (await things.delete_many({"v": condition})).deleted_count == len(expected)


async def test_expr_comparisons_still_compare_across_types(client: Client) -> None:
    """Aggregation $expr comparisons follow the BSON order across types, as on MongoDB."""
    things = await _seed(client)
    found = await _ids(things.find({"$expr": {"$lte": ["$v", _DAY]}}))
    assert found == sorted(set(_VALUES) - {"later", "maxkey"} | {"missing"})


async def test_change_stream_match_brackets_types(client: Client) -> None:
    """A change stream's $match on a date range skips events whose field is null or a number."""
    things = client.db.things
    stream = await things.watch([{"$match": {"fullDocument.v": {"$lte": _DAY}}}], max_await_time_ms=500)
    await things.insert_many([{"_id": "null", "v": None}, {"_id": "int", "v": 1}, {"_id": "date", "v": _DAY}])
    assert [event["documentKey"]["_id"] for event in await _drain(stream)] == ["date"]
