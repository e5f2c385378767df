"""MongoDB stores no document over 16 MiB: taskrunner budgets each task's document for every
run its options allow (``taskrunner/store/sizes.py``), refuses at publish what cannot fit, records a
result or an error that would not fit as a clear failure, and takes every server's "too
large" answer as ``DocumentTooLarge``."""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import uuid4

import bson
import pytest
from bson.raw_bson import RawBSONDocument
from pymongo import AsyncMongoClient
from pymongo import errors as pe
from scratch import drop_collection, new_collection
from workers import WorkerPool, WorkerProcess, finished

from taskrunner import DocumentTooLarge, NewTask, TaskRunner, TaskState, WorkerOptions
from taskrunner.dev.server import EmbeddedServer
from taskrunner.engine.execution import error_of
from taskrunner.engine.worker import default_worker_id
from taskrunner.errors import ConfigurationError, InvalidTask, PartialBulkWrite, StoreError
from taskrunner.models import EntryState
from taskrunner.store import fields as f
from taskrunner.store import rules, sizes
from taskrunner.store.base import RunStatus, RunWrite
from taskrunner.store.mongo import MongoStore, mapped_errors
from taskrunner.testing import make_context, wait_for

Doc = dict[str, Any]
LATEST = datetime(9999, 12, 31, tzinfo=UTC)


# -- the budget ------------------------------------------------------------------------------
def _fullest(task: NewTask) -> Doc:
    """The task's document with every run its options allow recorded, each payload as large
    as the budget lets a worker write it."""
    budget = task.budget()
    c, failed = task.options.concurrency, budget.failed
    doc = rules.new_document(task, publish_id="p" * 32)
    doc.update({f.ID: bson.ObjectId(), f.CREATED_AT: LATEST, f.UPDATED_AT: LATEST, f.RUN_AT: LATEST})
    doc.update({f.FINISHED_AT: LATEST, f.FATAL: True, f.SNOOZES: 2**40, f.FAILURES: 2**40, f.ATTEMPTS: 2**40})
    worker_id = "é" * (sizes.MAX_WORKER_ID_BYTES // 2)  # two bytes a character
    progress = sizes.fit_progress({"fraction": 0.5, "message": "m" * 10_000})
    kind, message, tb = sizes.fit_error("E" * 1000, "x" * 100_000, "t" * 100_000, budget.error)
    result = "r" * (budget.result - sizes.added_bytes(""))  # a string of exactly the share
    assert sizes.added_bytes(result) <= budget.result < sizes.added_bytes(result + "r")

    def entry(i: int, state: EntryState, payload: Doc) -> Doc:
        times = dict.fromkeys((f.CLAIMED_AT, f.PING_AT, f.EXPIRES_AT, f.FINISHED_AT), LATEST)
        return {
            f.WORKER_ID: worker_id,
            f.RUN_ID: uuid4().hex,
            f.STATE: state.value,
            **times,
            f.ATTEMPT: 2**40 + i,
            f.PROGRESS: progress,
            f.RESULT: None,
            f.ERROR: None,
            f.TOOK_OVER: [worker_id],
            **payload,
        }

    error = {f.ERROR_TYPE: kind, f.ERROR_MESSAGE: message, f.ERROR_TRACEBACK: tb}
    doc[f.WORKERS] = [entry(i, EntryState.FAIL, {f.ERROR: error}) for i in range(failed)] + [
        entry(i, EntryState.SUCCESS, {f.RESULT: result}) for i in range(c)
    ]
    return doc


@pytest.mark.parametrize(
    ("concurrency", "max_failures", "params_bytes"),
    [(1, 1, 0), (1, 3, 14_000_000), (3, 5, 5_000_000), (20, 100, 0), (1, 2000, 1_000_000)],
)
def test_a_document_holding_every_run_its_options_allow_stays_within_16_mib(
    concurrency: int, max_failures: int, params_bytes: int
) -> None:
    """With every failed run its options let it keep (twice max_failures + concurrency - 1)
    and every success, each payload at the most a worker writes, a published task's
    document is still no larger than MongoDB's 16 MiB."""
    options = {"concurrency": concurrency, "max_failures": max_failures}
    task = NewTask.build(key="k" * 512, name="n" * 200, params={"blob": "p" * params_bytes}, options=options)
    size = len(bson.encode(_fullest(task)))
    assert size <= sizes.MAX_DOCUMENT_BYTES - sizes.HEADROOM, (size, task.budget())


def test_params_that_leave_no_room_for_the_runs_are_refused_naming_size_and_limit() -> None:
    """Params the document has no room for beside its runs raise InvalidTask on ``params``
    with both sizes; one byte less is published, and leaves a result the least room."""
    limit = NewTask.build(key="k", name="job").budget().params_limit
    blob = "p" * (limit - sizes.params_bytes({"blob": ""}))
    fits = NewTask.build(key="k", name="job", params={"blob": blob})
    assert fits.budget().params == limit and fits.budget().result >= sizes.MIN_RESULT_BYTES
    with pytest.raises(InvalidTask) as refused:
        NewTask.build(key="k", name="job", params={"blob": blob + "p"})
    assert refused.value.field == "params"
    assert f"{limit + 1:,} bytes as BSON; at most {limit:,} fit" in refused.value.message


def test_options_whose_failed_runs_alone_would_not_fit_are_refused() -> None:
    """max_failures 10000 keeps up to 20,000 failed runs, more than 16 MiB even with the
    smallest errors: InvalidTask on ``options`` saying so; 1000 is published with shorter
    errors."""
    with pytest.raises(InvalidTask) as refused:
        NewTask.build(key="k", name="job", options={"max_failures": 10_000})
    assert refused.value.field == "options" and "20,000 failed runs" in refused.value.message
    many = NewTask.build(key="k", name="job", options={"max_failures": 1000}).budget()
    assert sizes.MIN_ERROR_BYTES <= many.error < sizes.ERROR_BYTES


def test_a_failed_runs_error_is_cut_to_its_share_keeping_where_it_was_raised(tmp_path: Path) -> None:
    """An exception with a 1 MB message raised 600 calls deep is recorded within the task's
    share for an error: the message keeps its start, the traceback its end (the line that
    raised, then the message as cut), each saying how long it was."""
    calls = [f"def f{i}():\n    f{i + 1}()\n" for i in range(600)]
    raising = "def f600():\n    raise ValueError('start of the message ' + 'x' * 1_000_000)\n"
    (tmp_path / "deep_calls.py").write_text("".join(calls) + raising)
    sys.path.insert(0, str(tmp_path))
    try:
        deep = importlib.import_module("deep_calls")
        with pytest.raises(ValueError, match=r"^start of the message") as info:
            deep.f0()
    finally:
        sys.path.remove(str(tmp_path))
    raised = info.value
    full = len("".join(traceback.format_exception(raised)).encode())
    assert full > 1_000_021 + 2 * sizes.ERROR_BYTES
    for limit in (sizes.ERROR_BYTES, sizes.MIN_ERROR_BYTES):
        error = error_of(raised, limit)
        assert sizes.added_bytes(error.model_dump()) <= limit
        assert error.type == "ValueError" and error.message.startswith("start of the message xxx")
        assert error.message.endswith("[... 1,000,021 bytes, cut to fit the task document]")
        assert error.traceback is not None and error.traceback.endswith(f"ValueError: {error.message}\n")
        assert error.traceback.startswith(f"[{full - 1_000_021 + len(error.message):,} bytes, cut")
    assert "raise ValueError('start of the message '" in (error_of(raised).traceback or "")


async def test_a_progress_message_is_cut_to_fit_its_entry() -> None:
    """``ctx.progress`` with a 100 kB message keeps its start within 512 bytes as stored."""
    ctx = make_context({}, key="k")
    await ctx.progress(0.5, "step " + "s" * 100_000)
    progress = ctx.take_progress()
    assert progress is not None and sizes.added_bytes(progress) <= sizes.PROGRESS_BYTES
    assert progress["fraction"] == 0.5 and progress["message"].startswith("step sss")


def test_worker_ids_fit_an_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker id over 128 bytes is refused (every entry names its worker); the default id
    cuts a long host name to fit."""
    with pytest.raises(ConfigurationError, match="at most 128 bytes"):
        WorkerOptions(worker_id="w" * 129)
    with pytest.raises(InvalidTask, match="at most 128 bytes"):
        NewTask.build(key="k", name="job", options={"worker_ids": ["w" * 129]})
    monkeypatch.setattr("socket.gethostname", lambda: "h" * 300)
    assert len(default_worker_id().encode()) <= sizes.MAX_WORKER_ID_BYTES


# -- the store boundary: every server's answer -------------------------------------------------
TOO_LARGE_ANSWERS = [
    (2, "object to insert too large. size in bytes: 16777217, max size: 16777216"),  # insert, up to 8.0
    (17419, "Resulting document after update is larger than 16777216"),  # update, up to 8.0
    (8375908, "Resulting document after update is larger than 16777216"),  # another update path
    (17420, "Document to upsert is larger than 16777216"),  # upsert, up to 8.0
    (10334, "Resulting document after update is larger than 16777216"),  # after SERVER-104405
    (10334, "BSONObj size: 16814023 (0x1008FC7) is invalid. Size must be between 0 and 16793600(16MB)"),
]


@pytest.mark.parametrize(("code", "message"), TOO_LARGE_ANSWERS)
def test_every_servers_too_large_answer_is_document_too_large(code: int, message: str) -> None:
    """A command error or a bulk write error with any code a MongoDB version answers a
    too-large document with is DocumentTooLarge; the driver's own check too."""
    with pytest.raises(DocumentTooLarge), mapped_errors():
        raise pe.OperationFailure(message, code)
    details = {"nMatched": 1, "writeErrors": [{"index": 1, "code": code, "errmsg": message}]}
    with pytest.raises(PartialBulkWrite) as bulk, mapped_errors():
        raise pe.BulkWriteError(details)
    assert isinstance(bulk.value.errors[1], DocumentTooLarge) and bulk.value.matched == 1
    with pytest.raises(DocumentTooLarge), mapped_errors():
        raise pe.DocumentTooLarge("BSON document too large (17000000 bytes)")


def test_other_bad_values_are_no_document_too_large() -> None:
    """BadValue (2) for anything but an insert too large stays a plain StoreError."""
    with pytest.raises(StoreError) as other, mapped_errors():
        raise pe.OperationFailure("Document can't have $ prefixed field names: $x", 2)
    assert not isinstance(other.value, DocumentTooLarge)


@pytest.fixture
async def server() -> AsyncIterator[EmbeddedServer]:
    async with EmbeddedServer() as embedded:
        yield embedded


async def _claimed(server: EmbeddedServer, *keys: str) -> tuple[MongoStore, list[str]]:
    store = MongoStore.connect(server.uri, collection="tasks")
    await store.publish([NewTask.build(key=key, name="job") for key in keys])
    run_ids = []
    for key in keys:
        claim = await store.claim("w1", key=key)
        assert claim is not None
        run_ids.append(claim.run_id)
    return store, run_ids


async def _fail_updates(server: EmbeddedServer, code: int) -> None:
    async with AsyncMongoClient[Doc](server.uri) as admin:
        data = {"failCommands": ["update"], "errorCode": code}
        await admin.admin.command({"configureFailPoint": "failCommand", "mode": {"times": 1}, "data": data})


async def test_a_bson_object_too_large_answer_to_an_outcome_is_that_writes_document_too_large(
    server: EmbeddedServer,
) -> None:
    """An outcome write answered BSONObjectTooLarge (10334), as servers after 8.0 answer, is
    that write's DocumentTooLarge; the run still owns its entry."""
    store, [run_id] = await _claimed(server, "k")
    await _fail_updates(server, 10334)
    [refused] = await store.write_runs([RunWrite("success", "k", run_id, "w1", {"n": 1})])
    assert isinstance(refused, DocumentTooLarge)
    assert (await store.get("k")).state is TaskState.RUNNING
    await store.close()


async def test_a_batch_refused_whole_as_too_large_is_written_one_write_at_a_time(
    server: EmbeddedServer,
) -> None:
    """When a group of outcomes is refused as a whole for size, each is written alone, so
    only one too large itself would fail: here none is, and all land."""
    store, run_ids = await _claimed(server, "a", "b")
    await _fail_updates(server, 10334)
    writes = [RunWrite("success", key, run_id, "w1", key) for key, run_id in zip("ab", run_ids, strict=True)]
    assert await store.write_runs(writes) == [RunStatus.DONE, RunStatus.DONE]
    assert [(await store.get(key)).results for key in "ab"] == [["a"], ["b"]]
    await store.close()


# -- a worker process on documents near 16 MiB ---------------------------------------------------
APP = "apps.size_app:runner"
WORKER_ID = "size-w1"


@pytest.fixture(scope="module")
def collection() -> Iterator[str]:
    name = new_collection("t_size")
    yield name
    drop_collection(name)


@pytest.fixture(scope="module")
def pool(mongo_uri: str, collection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    with WorkerPool(mongo_uri, collection, tmp_path_factory.mktemp("size"), app=APP) as pool:
        pool.start(WORKER_ID)
        yield pool


@pytest.fixture
async def worker(pool: WorkerPool) -> WorkerProcess:
    [process] = pool.workers
    await wait_for(lambda: process.find("worker started"), 60, "the worker to start")
    return process


@pytest.fixture
def runner_collection(collection: str) -> str:
    """The ``runner`` fixture publishes to the module's collection, which its worker serves."""
    return collection


async def _stored_size(mongo_uri: str, collection: str, key: str) -> int:
    async with AsyncMongoClient[RawBSONDocument](mongo_uri, document_class=RawBSONDocument) as client:
        raw = await client.taskrunner[collection].find_one({"key": key})
        assert raw is not None
        return len(raw.raw)


async def _goes_on(runner: TaskRunner, worker: WorkerProcess) -> None:
    """The worker still runs tasks: a small one published now succeeds on it."""
    key = f"small-{uuid4().hex[:8]}"
    await runner.publish("sized", {"result_bytes": 10}, key=key)
    [done] = await wait_for(lambda: finished(runner, key), 60, "a small task after the large one")
    assert done.state is TaskState.SUCCESS and done.results == ["r" * 10]
    assert worker.alive() and not worker.find("could not write the run's outcome")


async def test_a_result_that_does_not_fit_beside_14_mb_params_ends_the_task_clearly(
    runner: TaskRunner, worker: WorkerProcess, pool: WorkerPool, mongo_uri: str, collection: str
) -> None:
    """14 MB params and a 3 MB result (17 MB together, over MongoDB's 16 MiB): the run ends
    FAIL at once with UnstorableResult naming the result's size and the room left, the
    handler ran once, no document over 16 MiB is stored, and the worker goes on."""
    params = {"blob": "p" * 14_000_000, "result_bytes": 3_000_000}
    task = await runner.publish("sized", params, key="big-3mb", max_failures=1)
    room = task.budget().result
    [done] = await wait_for(lambda: finished(runner, "big-3mb"), 120, "the 14 MB task to end")
    error = done.last_error
    assert done.state is TaskState.FAIL and error is not None and error.type == "UnstorableResult", done
    assert f"result is {3_000_000 + 5:,} bytes as BSON" in error.message
    assert f"room for at most {room:,} per successful run" in error.message
    assert (done.attempts, len(pool.marks(key="big-3mb"))) == (1, 1)
    assert await _stored_size(mongo_uri, collection, "big-3mb") <= sizes.MAX_DOCUMENT_BYTES
    await _goes_on(runner, worker)


async def test_a_result_that_fits_beside_14_mb_params_is_stored(
    runner: TaskRunner, worker: WorkerProcess, mongo_uri: str, collection: str
) -> None:
    """14 MB params and a 2 MB result fit the task's budget: SUCCESS with the result, in a
    document of about 16 MB."""
    await runner.publish("sized", {"blob": "p" * 14_000_000, "result_bytes": 2_000_000}, key="big-2mb")
    [done] = await wait_for(lambda: finished(runner, "big-2mb"), 120, "the 14 MB task to succeed")
    assert done.state is TaskState.SUCCESS and done.results == ["r" * 2_000_000]
    size = await _stored_size(mongo_uri, collection, "big-2mb")
    assert 16_000_000 < size <= sizes.MAX_DOCUMENT_BYTES
    await _goes_on(runner, worker)


async def test_an_outcome_the_server_refuses_for_size_is_recorded_as_a_final_failure(
    runner: TaskRunner, worker: WorkerProcess, pool: WorkerPool, mongo_uri: str, collection: str
) -> None:
    """A document another writer filled to 50 kB short of 16 MiB refuses the run's 100 kB
    result: the worker records a DocumentTooLarge failure instead (final: the task ends
    FAIL, the handler ran once) rather than retrying a write that cannot land."""
    await runner.publish("crowded", {"room": 50_000, "result_bytes": 100_000}, key="crowded", max_failures=1)
    [done] = await wait_for(lambda: finished(runner, "crowded"), 120, "the crowded task to end")
    error = done.last_error
    assert done.state is TaskState.FAIL and done.fatal and error is not None, done
    assert error.type == "DocumentTooLarge" and "result did not fit" in error.message
    assert (done.attempts, len(pool.marks(key="crowded"))) == (1, 1)
    assert worker.find("outcome refused: the task document would exceed 16 MiB", key="crowded")
    await _goes_on(runner, worker)
