"""Tests of the embedded server: change-stream bridge, Int64 cursor ids, CLI and mongosh."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from bson.int64 import Int64
from mongosh import mongosh_path
from pymongo import AsyncMongoClient, MongoClient, monitoring
from pymongo.errors import OperationFailure
from workers import dev_server

from taskrunner.dev.server import EmbeddedServer
from taskrunner.testing import wait_for

pytestmark = pytest.mark.embedded

_WRITER = """
import json, sys
from pymongo import MongoClient
uri, name, ops = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with MongoClient(uri) as client:
    collection = client.taskrunner[name]
    for op, *args in ops:
        getattr(collection, op)(*args)
"""


async def _write_from_other_process(uri: str, name: str, ops: list[list[Any]]) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WRITER, uri, name, json.dumps(ops), stderr=subprocess.PIPE
    )
    _, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()


def _client(uri: str, **options: Any) -> AsyncMongoClient[dict[str, Any]]:
    return AsyncMongoClient(uri, **options)


def _sync_client(uri: str, **options: Any) -> MongoClient[dict[str, Any]]:
    return MongoClient(uri, **options)


def _summary(event: dict[str, Any]) -> tuple[str, object, object]:
    return event["operationType"], event["documentKey"]["_id"], event.get("fullDocument")


class _Recorder(monitoring.CommandListener):
    """Keeps every command reply and failure so tests can inspect the wire traffic."""

    def __init__(self) -> None:
        self.commands: list[str] = []
        self.replies: list[tuple[str, dict[str, Any]]] = []
        self.failures: list[tuple[str, dict[str, Any]]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.commands.append(event.command_name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self.replies.append((event.command_name, dict(event.reply)))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self.failures.append((event.command_name, dict(event.failure)))


async def test_stream_sees_other_process_writes_and_resumes_exactly(
    embedded_uri: str, collection_name: str
) -> None:
    """A stream gets another process's inserts and updates, then resumes from a token exactly."""
    async with _client(embedded_uri) as client:
        tasks = client.taskrunner[collection_name]
        stream = await tasks.watch(full_document="updateLookup", max_await_time_ms=5000)
        await _write_from_other_process(
            embedded_uri,
            collection_name,
            [["insert_one", {"_id": 1, "n": 1}], ["update_one", {"_id": 1}, {"$set": {"n": 2}}]],
        )
        seen = [_summary(await stream.next()) for _ in range(2)]
        assert seen == [("insert", 1, {"_id": 1, "n": 1}), ("update", 1, {"_id": 1, "n": 2})]
        token = stream.resume_token
        await stream.close()
        await _write_from_other_process(
            embedded_uri,
            collection_name,
            [
                ["insert_one", {"_id": 2, "n": 1}],
                ["update_one", {"_id": 1}, {"$set": {"n": 3}}],
                ["delete_one", {"_id": 2}],
            ],
        )
        async with await tasks.watch(
            full_document="updateLookup", resume_after=token, max_await_time_ms=300
        ) as resumed:
            seen = [_summary(await resumed.next()) for _ in range(3)]
            extra = await resumed.try_next()
    assert seen == [
        ("insert", 2, {"_id": 2, "n": 1}),
        ("update", 1, {"_id": 1, "n": 3}),
        ("delete", 2, None),
    ]
    assert extra is None


async def test_parked_get_more_returns_as_soon_as_a_write_lands(
    embedded_uri: str, collection_name: str
) -> None:
    """A getMore waiting on maxAwaitTimeMS=10s returns soon after a write, not at the deadline."""
    recorder = _Recorder()
    async with _client(embedded_uri, event_listeners=[recorder]) as client:
        tasks = client.taskrunner[collection_name]
        async with await tasks.watch(max_await_time_ms=10_000) as stream:

            async def write_later() -> float:
                await wait_for(lambda: "getMore" in recorder.commands, what="the getMore to be sent")
                written_at = time.monotonic()
                await tasks.insert_one({"_id": "late"})
                return written_at

            writer = asyncio.create_task(write_later())
            event = await stream.next()
            latency = time.monotonic() - await writer
    assert event["documentKey"] == {"_id": "late"}
    assert latency < 5.0  # half the deadline: room for a busy host


async def test_database_and_cluster_streams_apply_the_rest_of_the_pipeline(
    embedded_uri: str, collection_name: str
) -> None:
    """Database- and cluster-level streams see their scope and apply the stages after $changeStream."""
    only_ours = [{"$match": {"ns.coll": collection_name}}]
    async with _client(embedded_uri) as client:
        db_stream = await client.taskrunner.watch(only_ours, max_await_time_ms=2000)
        cluster_stream = await client.watch(only_ours, max_await_time_ms=2000)
        await client.taskrunner[f"{collection_name}_other"].insert_one({"_id": "noise"})
        await client.elsewhere[collection_name].insert_one({"_id": "other-db"})
        await client.taskrunner[collection_name].insert_one({"_id": "ours"})
        from_db = await db_stream.next()
        from_cluster = [(await cluster_stream.next())["ns"]["db"] for _ in range(2)]
        await db_stream.close()
        await cluster_stream.close()
    assert from_db["documentKey"] == {"_id": "ours"}
    assert from_cluster == ["elsewhere", "taskrunner"]


async def test_change_stream_batches_honour_batch_size(embedded_uri: str, collection_name: str) -> None:
    """getMore replies hold at most batchSize events and together deliver all of them in order."""
    recorder = _Recorder()
    async with _client(embedded_uri, event_listeners=[recorder]) as client:
        tasks = client.taskrunner[collection_name]
        async with await tasks.watch(batch_size=2, max_await_time_ms=2000) as stream:
            await tasks.insert_many([{"_id": i} for i in range(5)])
            keys = [(await stream.next())["documentKey"]["_id"] for _ in range(5)]
    sizes = [len(reply["cursor"]["nextBatch"]) for name, reply in recorder.replies if name == "getMore"]
    assert keys == [0, 1, 2, 3, 4]
    assert sizes[:3] == [2, 2, 1]


async def test_every_cursor_reply_carries_an_int64_id(embedded_uri: str, collection_name: str) -> None:
    """find, getMore, aggregate, listCollections, listIndexes and $changeStream reply Int64 cursor ids."""
    recorder = _Recorder()
    async with _client(embedded_uri, event_listeners=[recorder]) as client:
        tasks = client.taskrunner[collection_name]
        await tasks.insert_many([{"_id": i} for i in range(5)])
        assert len(await tasks.find({}, batch_size=2).to_list()) == 5
        await (await tasks.aggregate([{"$match": {}}])).to_list()
        await client.taskrunner.list_collection_names()
        await (await tasks.list_indexes()).to_list()
        await (await tasks.watch()).close()
    cursor_replies = [(name, reply["cursor"]) for name, reply in recorder.replies if "cursor" in reply]
    assert {name for name, _ in cursor_replies} == {
        "find",
        "getMore",
        "aggregate",
        "listCollections",
        "listIndexes",
    }
    assert {type(cursor["id"]) for _, cursor in cursor_replies} == {Int64}


async def test_get_more_on_unknown_bridge_cursor_is_cursor_not_found(
    embedded_uri: str, collection_name: str
) -> None:
    """A getMore naming a bridge-range cursor id nobody owns fails with CursorNotFound (43)."""
    async with _client(embedded_uri) as client:
        with pytest.raises(OperationFailure) as failure:
            await client.taskrunner.command({"getMore": Int64(2**31 - 1), "collection": collection_name})
    assert failure.value.code == 43
    assert failure.value.details is not None
    assert failure.value.details["codeName"] == "CursorNotFound"


async def test_stream_resumes_transparently_after_its_cursor_is_killed(
    embedded_uri: str, collection_name: str
) -> None:
    """After its bridge cursor is killed, a stream's getMore gets code 43 and PyMongo resumes losslessly."""
    recorder = _Recorder()
    async with (
        _client(embedded_uri, event_listeners=[recorder]) as client,
        _client(embedded_uri) as other,
    ):
        stream = await client.taskrunner[collection_name].watch(max_await_time_ms=2000)
        opened = next(reply for name, reply in recorder.replies if name == "aggregate")
        cursor_id = opened["cursor"]["id"]
        killed = await other.taskrunner.command("killCursors", collection_name, cursors=[Int64(cursor_id)])
        await other.taskrunner[collection_name].insert_one({"_id": "after-kill"})
        event = await stream.next()
        await stream.close()
    assert killed["cursorsKilled"] == [cursor_id]
    assert event["documentKey"] == {"_id": "after-kill"}
    assert [f["code"] for name, f in recorder.failures if name == "getMore"] == [43]
    assert recorder.commands.count("aggregate") == 2


async def test_resume_from_pruned_history_is_history_lost() -> None:
    """Opening a stream with a token older than the retained history fails with code 286."""
    async with EmbeddedServer(history_size=3) as server, _client(server.uri) as client:
        tasks = client.taskrunner.tasks
        async with await tasks.watch(max_await_time_ms=2000) as stream:
            await tasks.insert_one({"_id": 0})
            token = (await stream.next())["_id"]
        await tasks.insert_many([{"_id": i} for i in range(1, 5)])
        with pytest.raises(OperationFailure) as failure:
            await tasks.watch(resume_after=token)
    assert failure.value.code == 286


async def test_stream_that_falls_behind_the_history_is_history_lost() -> None:
    """A getMore on a stream whose unread events were pruned fails with code 286, not silence."""
    async with EmbeddedServer(history_size=3) as server, _client(server.uri) as client:
        tasks = client.taskrunner.tasks
        stream = await tasks.watch(max_await_time_ms=2000)
        await tasks.insert_many([{"_id": i} for i in range(5)])
        with pytest.raises(OperationFailure) as failure:
            await stream.next()
    assert failure.value.code == 286


@pytest.mark.parametrize(("host", "warned"), [("127.0.0.1", False), ("0.0.0.0", True)])
async def test_non_loopback_host_warns_on_stderr(
    host: str, warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Listening beyond loopback prints an unauthenticated-server warning to stderr."""
    async with EmbeddedServer(host=host):
        pass
    assert ("WITHOUT authentication" in capsys.readouterr().err) is warned


def test_missing_mongoeco_imports_but_refuses_to_start() -> None:
    """Without mongoeco the module still imports, and constructing a server raises RuntimeError."""
    script = (
        "import sys; sys.modules['mongoeco'] = None\n"
        "import taskrunner.dev.server as embedded\nimport taskrunner.dev.streams\n"
        "for build in (embedded.EmbeddedServer, embedded.ServerThread):\n"
        "    try: build()\n"
        "    except RuntimeError as error: print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    expected = (
        "the embedded server needs the 'embedded' extra: pip install 'taskrunner[embedded]' (Python >= 3.13)"
    )
    assert result.stdout.splitlines() == [expected, expected]


async def test_mongoeco_pin_and_private_internals_hold() -> None:
    """mongoeco is exactly 4.11.0 and every private internal the bridge relies on still exists."""
    from mongoeco.api import AsyncMongoClient as EcoClient
    from mongoeco.core import compiled_query
    from mongoeco.core.filtering import QueryEngine
    from mongoeco.wire import proxy, requests

    from taskrunner.dev.patches import MONGOECO_VERSION

    assert importlib.metadata.version("mongoeco") == MONGOECO_VERSION, "mongoeco is not the pinned release"
    broken = [
        f"proxy.py no longer calls {call}" for call in _PROXY_CALLS if call not in inspect.getsource(proxy)
    ]
    context_fields = {field.name for field in dataclasses.fields(requests.WireRequestContext)}
    broken += [f"WireRequestContext.{n} missing" for n in _CONTEXT_FIELDS if n not in context_fields]
    broken += [f"QueryEngine.{n} missing" for n in _QUERY_ENGINE_NAMES if not hasattr(QueryEngine, n)]
    broken += [
        f"CompiledQuery.{n} missing" for n in _COMPILED_NAMES if not hasattr(compiled_query.CompiledQuery, n)
    ]
    from mongoeco.core.aggregation import array_string_expressions as sets
    from mongoeco.core.aggregation import stages

    union = list(inspect.signature(stages._apply_union_with).parameters)[:4]  # type: ignore[attr-defined]
    if union != ["documents", "spec", "collection_resolver", "variables"]:
        broken.append(f"stages._apply_union_with takes {union} now")
    unique = inspect.signature(sets._append_unique_values).parameters
    if list(unique) != ["target", "values", "dialect", "collation"]:
        broken.append(f"array_string_expressions._append_unique_values takes {list(unique)} now")
    source = inspect.getsource(compiled_query)
    broken += [f"compiled_query.py no longer has {code}" for code in _COMPILED_CODE if code not in source]
    client = EcoClient(change_stream_history_size=3)
    async with client:
        server = proxy.AsyncMongoEcoProxyServer(client=client)
        broken += [f"executor.{n} missing" for n in _EXECUTOR_NAMES if not hasattr(server._executor, n)]
        stream = client.watch(max_await_time_ms=0)
        broken += [f"hub.{n} missing" for n in _HUB_NAMES if not hasattr(stream._hub, n)]
        await client.d.c.insert_one({"_id": 1})
        await client.d.c.drop()
        events = [(e.operation_type, e.db_name, e.coll_name, e.document_key) for e in stream._hub._events]
        if events != [("insert", "d", "c", {"_id": 1}), ("invalidate", "d", "c", {"_id": "d.c"})]:
            broken.append(
                f"hub events of an insert and a drop are no longer as the oplog reads them: {events}"
            )
        broken += await _transaction_internals_broken(client, server._executor)
        stream.close()
    broken += _engine_and_fail_point_internals_broken()
    assert not broken, (
        "mongoeco internals used by taskrunner/dev/ (patches.py and the modules it names, oplog.py,"
        " streams.py, retryable.py, transactions.py) changed: " + "; ".join(broken)
    )


async def _transaction_internals_broken(client: Any, executor: Any) -> list[str]:
    """What transactions.py reads through patches.py: the wire session store, the engine's
    transaction states and their change payloads, and the dispatch of committed changes."""
    from mongoeco.engines.mvcc import MemoryMvccState

    broken = []
    if not isinstance(getattr(getattr(executor, "_session_store", None), "_sessions", None), dict):
        broken.append("executor._session_store._sessions missing")
    fields = {field.name for field in dataclasses.fields(MemoryMvccState)}
    broken += [f"MemoryMvccState.{n} missing" for n in _MVCC_FIELDS if n not in fields]
    engine = client._engine
    if not isinstance(getattr(engine, "_mvcc_version", None), int):
        broken.append("engine._mvcc_version missing")
    if not isinstance(getattr(engine, "_indexes", None), dict):
        broken.append("engine._indexes missing")
    if not callable(getattr(client._validated_engine_spi, "dispatch_committed_changes", None)):
        broken.append("client._validated_engine_spi.dispatch_committed_changes missing")
    if getattr(client, "_change_hub", None) is None:
        broken.append("client._change_hub missing")
    session = client.start_session()
    session.start_transaction()
    await client.d.t.insert_one({"_id": 1}, session=session)
    changes = engine._mvcc_states[session.session_id].pending_changes
    keys = set(changes[0]) if changes and isinstance(changes[0], dict) else set()
    if not set(_CHANGE_PAYLOAD) <= keys:
        broken.append(f"a transaction's pending change payload has {sorted(keys)}")
    session.abort_transaction()
    session.close()
    return broken


_MVCC_FIELDS = ("snapshot_version", "pending_changes", "has_writes", "touched_namespaces", "indexes")
_CHANGE_PAYLOAD = ("operation_type", "db_name", "coll_name", "document_key", "full_document")


def _engine_and_fail_point_internals_broken() -> list[str]:
    """What engine.py patches and faults.py reads: the engine's unique check (run before every
    stored document) and its arguments, the failCommand state and closeConnection's exception."""
    from mongoeco.api._async import database_commands
    from mongoeco.engines.memory import MemoryEngine
    from mongoeco.wire import _session_identity

    broken = []
    parameters = inspect.signature(MemoryEngine._ensure_unique_indexes).parameters
    broken += [f"_ensure_unique_indexes has no {p}" for p in _UNIQUE_CHECK_ARGS if p not in parameters]
    if not callable(getattr(MemoryEngine, "_borrow_storage_document", None)):
        broken.append("MemoryEngine._borrow_storage_document missing (tests count reads with it)")
    source = inspect.getsource(database_commands)
    broken += [f"database_commands.py lost {text!r}" for text in _FAIL_POINT_SOURCE if text not in source]
    if not callable(getattr(database_commands._CommandFailPointState, "consume_fail_command", None)):
        broken.append("_CommandFailPointState.consume_fail_command missing")
    if not callable(getattr(_session_identity, "wire_session_key", None)):
        broken.append("wire._session_identity.wire_session_key missing")
    return broken


_PROXY_CALLS = (
    "self._executor._build_request_context(",
    "self._executor.execute_prepared(",
    "self._executor.error_document(",
    "self._handle_connection(reader, writer)",
    "await self._dispatch_wire_request(",
    "except (asyncio.IncompleteReadError, ConnectionError):",
    "header.message_length",
)
_UNIQUE_CHECK_ARGS = ("db_name", "coll_name", "candidate", "exclude_storage_key", "scan_payload_id")
_FAIL_POINT_SOURCE = (
    '"_command_failpoint_state"',
    "if fail_command.close_connection:\n                        raise ConnectionFailure(",
)
_EXECUTOR_NAMES = ("_build_request_context", "execute_prepared", "error_document")
_CONTEXT_FIELDS = ("command_name", "db_name", "command_document", "raw_body", "connection")
_HUB_NAMES = ("_append_committed_event_locked", "_events")
_QUERY_ENGINE_NAMES = (
    "_comparison_matches_candidate",
    "_match_top_level_comparison",
    "_evaluate_comparison",
    "_extract_values",
)
_COMPILED_NAMES = ("_comparison_code", "_store", "_compile_expression", "_node_to_code", "_field")
_COMPILED_CODE = (
    "'top_compare': QueryEngine._match_top_level_comparison",
    "'match_plan': QueryEngine.match_plan",
    "match_plan(doc, {node_key}, dialect=dialect, '",
    "'extract': QueryEngine.extract_values",
    "case InCondition(",
)


def test_serve_stops_cleanly_on_sigterm() -> None:
    """The CLI server answers a ping, then exits 0 without a traceback when sent SIGTERM."""
    with dev_server() as (process, uri):
        with _sync_client(uri, serverSelectionTimeoutMS=5000) as client:
            assert client.admin.command("ping")["ok"] == 1.0
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=15)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr


@pytest.mark.timeout(600)  # the first run installs mongosh with npm
def test_mongosh_reads_a_published_task(tmp_path: Path) -> None:
    """mongosh (Node driver) connects to `taskrunner dev-server` and reads a task published by the CLI."""
    mongosh = mongosh_path()
    script = (
        'const tasks = db.getSiblingDB("taskrunner").tasks;'
        "print(EJSON.stringify({docs: tasks.find({}, {_id: 0, key: 1, name: 1, params: 1, state: 1}).toArray(),"
        " count: tasks.countDocuments({state: 'PENDING'})}))"
    )
    with dev_server() as (_, uri):
        env = {**os.environ, "HOME": str(tmp_path), "DO_NOT_TRACK": "1", "TASKRUNNER_MONGO_URI": uri}
        published = subprocess.run(
            [
                sys.executable,
                "-m",
                "taskrunner",
                "publish",
                "resize",
                "--params",
                '{"width": 640}',
                "--key",
                "img:42",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
        assert published.returncode == 0, published.stderr
        result = subprocess.run(
            [str(mongosh), uri, "--quiet", "--norc", "--eval", script],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            check=False,
        )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "docs": [{"key": "img:42", "name": "resize", "params": {"width": 640}, "state": "PENDING"}],
        "count": 1,
    }


def test_the_server_refuses_another_mongoeco_release_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bridge reaches into mongoeco's internals: on a release other than the pinned one
    the server does not start, and the error names the release found and the one to install."""
    from taskrunner.dev import patches

    assert patches.mongoeco_mismatch() is None  # the pinned release is what the suite runs on
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert pyproject.count(f"mongoeco=={patches.MONGOECO_VERSION};") == 2  # the extra and the dev group
    assert importlib.metadata.version("mongoeco") == patches.MONGOECO_VERSION
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.12.0")
    with pytest.raises(RuntimeError) as refused:
        EmbeddedServer()
    message = str(refused.value)
    assert "mongoeco 4.12.0 is installed" in message and f"mongoeco=={patches.MONGOECO_VERSION}" in message
