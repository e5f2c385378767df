"""The bad-input catalogue: every kind of bad input fails only its own task, with a clear message.

One ``taskrunner worker`` process (tests/apps/bad_input_app.py, id ``tough``) serves the
whole module. Each test feeds it bad input (documents written by hand, publish calls,
misbehaving handlers), checks the message that names the problem, and then proves the
worker is still up and unaffected: a normal task published afterwards succeeds on the
same process and no side task ever crashed. Publish-side cases also prove nothing was
written. docs/guarantees.md lists every case.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

import pytest
import runs
from pymongo import AsyncMongoClient
from pymongo.errors import WriteError
from scratch import drop_collection, new_collection
from workers import WorkerPool, WorkerProcess, finished

from taskrunner import NewTask, TaskRunner, TaskSpec, TaskState
from taskrunner.errors import InvalidParams, InvalidTask, WriteRejected
from taskrunner.store import rules
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

Doc = dict[str, Any]
APP = "apps.bad_input_app:runner"
WORKER_ID = "tough"
CRASH_EVENTS = ("side task crashed; restarting", "run crashed")


# -- fixtures: one worker process for the module ----------------------------------------------
@pytest.fixture(scope="module")
def collection() -> Iterator[str]:
    """The module's collection, shared by its worker process; dropped afterwards from a real server."""
    name = new_collection("t_bad")
    yield name
    drop_collection(name)


@pytest.fixture(scope="module")
def pool(mongo_uri: str, collection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerPool]:
    with WorkerPool(mongo_uri, collection, tmp_path_factory.mktemp("bad-input"), app=APP) as pool:
        pool.start(WORKER_ID, "--concurrency", "4")
        yield pool


@pytest.fixture
async def worker(pool: WorkerPool) -> WorkerProcess:
    [process] = pool.workers
    # A document without claimable_at is outside every sweep's range: only the stream sees it.
    await wait_for(lambda: process.find("change stream opened"), 60, "the worker's stream to open")
    return process


@pytest.fixture
def runner_collection(collection: str) -> str:
    """The ``runner`` fixture publishes to the module's collection, which its worker serves."""
    return collection


@pytest.fixture
async def raw(mongo_uri: str, collection: str) -> AsyncIterator[Any]:
    """The module's collection through PyMongo, for documents written by hand."""
    async with AsyncMongoClient[Doc](mongo_uri, tz_aware=True) as client:
        yield client.taskrunner[collection]


async def still_serves(runner: TaskRunner, worker: WorkerProcess) -> None:
    """The worker is up and unaffected: a normal task published now succeeds on it."""
    key = f"normal-{uuid4().hex[:8]}"
    await runner.publish("quick", key=key)
    [done] = await wait_for(lambda: finished(runner, key), 30, "the normal task after the bad input")
    assert done.state is TaskState.SUCCESS and [w.worker_id for w in done.workers] == [WORKER_ID]
    assert worker.alive()
    assert not [e for e in worker.logs() if e.get("event") in CRASH_EVENTS]


# -- documents written by hand ---------------------------------------------------------------
def claimable(key: str, case: str) -> Doc:
    """A valid, due document as taskrunner would write it, tagged with its case."""
    now = datetime.now(UTC)
    doc = rules.new_document(NewTask(key=key, name="quick"), publish_id="by-hand")
    doc.update(
        {
            "created_at": now,
            "updated_at": now,
            "run_at": now,
            "claimable_at": now,
            "priority": 100,
            "case": case,
        }
    )
    return doc


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def apply(doc: Doc) -> None:
        *parents, last = path.split(".")
        target = doc
        for part in parents:
            target = target[part]
        target[last] = value

    return apply


def _drop(path: str) -> Callable[[Doc], None]:
    def apply(doc: Doc) -> None:
        *parents, last = path.split(".")
        target = doc
        for part in parents:
            target = target[part]
        del target[last]

    return apply


def _bare(doc: Doc) -> None:
    for field in list(doc):
        if field not in ("key", "name", "state", "case"):
            del doc[field]


NORMALIZED, MARKED, REJECTED = "normalized", "marked", "rejected"
# (case id, how to break a valid document, field the message names, what the worker does)
# NORMALIZED: only documented defaults are missing; the worker fills them in (one write,
#   server time) and runs the task like a published one.
# MARKED: still unreadable after defaults; the worker marks the document itself: state
#   FAIL, fatal, and its own error (type MalformedTask, naming the field and value),
#   adding only missing fields, so list, show, stats and the mongo shell see it.
# REJECTED: no string key, so nothing can address it: the worker claims it without a key
#   and records a FAIL entry of type MalformedTask (naming the field) instead of running it.
MALFORMED: list[tuple[str, Callable[[Doc], None], str, str]] = [
    ("missing-most-fields", _bare, "", NORMALIZED),
    ("missing-options", _drop("options"), "", NORMALIZED),
    ("options-missing-concurrency", _drop("options.concurrency"), "", NORMALIZED),
    ("options-not-an-object", _set("options", "fast"), "options", MARKED),
    ("options-concurrency-string", _set("options.concurrency", "2"), "options.concurrency", MARKED),
    ("options-negative-ping-timeout", _set("options.ping_timeout", -5), "options.ping_timeout", MARKED),
    ("options-nan-ping-interval", _set("options.ping_interval", math.nan), "options.ping_interval", MARKED),
    ("options-worker-ids-string", _set("options.worker_ids", WORKER_ID), "options.worker_ids", MARKED),
    ("workers-not-an-array", _set("workers", "nobody"), "workers", MARKED),
    ("workers-huge-junk-array", _set("workers", [{"junk": i} for i in range(1_000)]), "workers.0", MARKED),
    ("unknown-state", _set("state", "EXPLODED"), "state", MARKED),
    ("state-wrong-type", _set("state", 7), "state", MARKED),
    ("params-not-an-object", _set("params", "not an object"), "params", MARKED),
    ("priority-string", _set("priority", "high"), "priority", MARKED),
    ("created-at-string", _set("created_at", "yesterday"), "created_at", MARKED),
    ("claimable-at-string", _set("claimable_at", "now"), "claimable_at", MARKED),
    ("failures-string", _set("failures", "none"), "failures", MARKED),
    ("name-not-a-string", _set("name", 42), "name", MARKED),
    ("missing-key", _drop("key"), "key", REJECTED),
]


@pytest.mark.parametrize(("case", "breaks", "field", "mode"), MALFORMED, ids=[case for case, *_ in MALFORMED])
async def test_a_hand_written_document_runs_or_is_marked_and_never_stops_the_worker(
    runner: TaskRunner,
    worker: WorkerProcess,
    pool: WorkerPool,
    raw: Any,
    case: str,
    breaks: Callable[[Doc], None],
    field: str,
    mode: str,
) -> None:
    """A hand-written document missing only defaults runs; any other never reaches a handler
    and is marked FAIL in the document, naming the broken field; the worker keeps serving."""
    key = f"malformed-{case}"
    doc = claimable(key, case)
    breaks(doc)
    await raw.insert_one(doc)
    # The worker hears of the document from its change stream (or a sweep) and normalizes it.
    await still_serves(runner, worker)
    if mode == NORMALIZED:
        [done] = await wait_for(lambda: finished(runner, key), 30, f"{case} to run")
        assert done.state is TaskState.SUCCESS and done.unreadable is None and pool.marks(key=key)
        return
    if mode == MARKED:
        stored = await wait_for(lambda: _marked(raw, case), 30, f"{case} to be marked")
        assert stored["error"]["message"].startswith(f"{field}") and stored["fatal"] is True, stored["error"]
        assert stored.get("workers") == doc.get("workers")  # nothing written by hand is overwritten
        marked = "marked an unreadable task document FAIL"
        await wait_for(
            lambda: [e for e in worker.find(marked, key=key) if field in e["problem"]], 10, "the log"
        )
    else:
        stored = await wait_for(lambda: _rejected(raw, case), 30, f"{case} to be recorded as a failure")
        error = stored["workers"][-1]["error"]
        assert error["type"] == "MalformedTask" and field in error["message"], error
        assert stored["fatal"] is True and stored["state"] == "FAIL"  # ended at once: it cannot loop
        assert [
            e
            for e in worker.find("claimed an unreadable task; recorded as its failure")
            if field in e["error"]
        ]
    assert not pool.marks(key=key)  # no handler ever ran it


async def _marked(raw: Any, case: str) -> Doc | None:
    stored: Doc | None = await raw.find_one({"case": case})
    error = stored.get("error") if stored else None
    marked = isinstance(error, dict) and error.get("type") == "MalformedTask"
    return stored if marked and stored is not None and stored.get("state") == "FAIL" else None


async def _rejected(raw: Any, case: str) -> Doc | None:
    stored: Doc | None = await raw.find_one({"case": case})
    entries = stored.get("workers") if stored else None
    if isinstance(entries, list) and entries and isinstance(entries[-1], dict) and entries[-1].get("error"):
        return stored
    return None


# -- publish: rejected before anything is written --------------------------------------------
BIG = "x" * (16 * 1024 * 1024)
# (case id, publish keywords, field named, words in the message)
INVALID_PUBLISH: list[tuple[str, dict[str, Any], str, str]] = [
    ("params-lone-surrogate", {"params": {"text": "\ud800"}}, "params", "surrogates"),
    ("params-too-large", {"params": {"blob": BIG}}, "params", "bytes as BSON"),
    ("params-a-set", {"params": {"tags": {1, 2}}}, "params", "cannot be stored as BSON"),
    ("params-custom-object", {"params": {"what": object()}}, "params", "cannot be stored as BSON"),
    ("params-int-over-64-bits", {"params": {"n": 2**70}}, "params", "8-byte ints"),
    ("params-a-list", {"params": [1, 2]}, "params", "must be an object"),
    ("key-10-kB", {"key": "k" * 10_240}, "key", "at most 512"),
    ("key-nul-byte", {"key": "a\x00b"}, "key", "printable"),
    ("key-lone-surrogate", {"key": "\ud800"}, "key", "unicode"),
    ("ping-interval-negative", {"ping_interval": -1}, "options.ping_interval", "greater than 0"),
    ("ping-timeout-absurd", {"ping_timeout": 1e12}, "options.ping_timeout", "less than or equal"),
    ("ping-timeout-infinite", {"ping_timeout": math.inf}, "options.ping_timeout", "finite"),
    ("ping-interval-nan", {"ping_interval": math.nan}, "options.ping_interval", "finite"),
    ("retry-backoff-nan", {"retry_backoff": math.nan}, "options.retry_backoff", "finite"),
    ("retry-backoff-infinite", {"retry_backoff": math.inf}, "options.retry_backoff", "finite"),
    ("delay-nan", {"delay": math.nan}, "delay", "finite"),
    ("delay-negative", {"delay": -5}, "delay", "greater than or equal to 0"),
    ("timeout-not-above-interval", {"ping_interval": 10, "ping_timeout": 5}, "options", "longer than"),
    ("concurrency-zero", {"concurrency": 0}, "options.concurrency", "greater than or equal to 1"),
    ("concurrency-a-million", {"concurrency": 10**6}, "options.concurrency", "less than or equal to 1000"),
    ("concurrency-fractional", {"concurrency": 2.5}, "options.concurrency", "integer"),
    ("max-failures-zero", {"max_failures": 0}, "options.max_failures", "greater than or equal to 1"),
    ("worker-ids-a-string", {"worker_ids": "w1"}, "options.worker_ids", "valid list"),
    ("worker-ids-ints", {"worker_ids": [1, 2]}, "options.worker_ids.0", "valid string"),
    ("worker-ids-empty-string", {"worker_ids": [""]}, "options.worker_ids", "non-empty"),
    ("worker-ids-too-many", {"worker_ids": [f"w{i}" for i in range(10_001)]}, "options.worker_ids", "1000"),
    ("unknown-option", {"retries": 3}, "options.retries", "unknown option"),
    ("priority-over-32-bits", {"priority": 2**40}, "priority", "less than or equal"),
    ("name-with-spaces", {"name": "rm -rf /"}, "name", "letters, digits"),
]


@pytest.mark.parametrize(
    ("case", "spec", "field", "words"), INVALID_PUBLISH, ids=[case for case, *_ in INVALID_PUBLISH]
)
async def test_invalid_publish_names_the_field_and_writes_nothing(
    runner: TaskRunner, raw: Any, case: str, spec: dict[str, Any], field: str, words: str
) -> None:
    """Bad publish input raises InvalidTask naming the field (and the problem); nothing is written."""
    before = await raw.count_documents({})
    spec = {"name": "quick", "key": f"invalid-{case}", **spec}
    with pytest.raises(InvalidTask) as raised:
        await runner.publish(**spec)
    assert raised.value.field == field, raised.value
    assert words in raised.value.message, raised.value
    assert await raw.count_documents({}) == before


async def test_one_invalid_item_rejects_the_whole_publish_many(runner: TaskRunner, raw: Any) -> None:
    """publish_many names the bad item's index and field and writes none of the batch."""
    batch: list[TaskSpec] = [
        {"name": "quick", "key": "batch-ok"},
        {"name": "quick", "key": "batch-bad", "concurrency": 0},
    ]
    with pytest.raises(InvalidTask) as raised:
        await runner.publish_many(batch)
    assert raised.value.field == "tasks[1].options.concurrency"
    assert await raw.count_documents({"key": {"$in": ["batch-ok", "batch-bad"]}}) == 0


async def test_params_failing_a_local_model_are_refused_at_publish(mongo_uri: str, collection: str) -> None:
    """A publisher that registers the handler validates params itself: InvalidParams names params.count."""
    from apps.acceptance_app import runner as app

    async with app.copy(mongo_uri=mongo_uri, collection=collection) as local:
        with pytest.raises(InvalidParams) as raised:
            await local.publish("typed", {"count": "many"}, key="refused-locally")
        assert raised.value.field == "params.count"
        with pytest.raises(LookupError):
            await local.get("refused-locally")


# -- bad input that reaches the worker -------------------------------------------------------
async def test_unknown_handler_name_is_never_claimed(
    runner: TaskRunner, worker: WorkerProcess, pool: WorkerPool
) -> None:
    """A task no registered handler serves stays PENDING with no attempts; the worker keeps serving."""
    await runner.publish("nobody_handles", {"x": 1}, key="unknown-name")
    await still_serves(runner, worker)
    task = await runner.get("unknown-name")
    assert (task.state, task.workers, task.attempts) == (TaskState.PENDING, [], 0)
    assert not pool.marks(key="unknown-name")


async def test_params_failing_the_handlers_model_fail_the_task(
    runner: TaskRunner, worker: WorkerProcess, pool: WorkerPool
) -> None:
    """Params the worker's model rejects → FAIL InvalidParams naming params.count; the handler never runs."""
    await runner.publish("typed", {"count": "many"}, key="bad-params", max_failures=1)
    [task] = await wait_for(lambda: finished(runner, "bad-params"), 30, "the bad params to fail")
    error = task.last_error
    assert task.state is TaskState.FAIL and error is not None
    assert error.type == "InvalidParams" and "params.count" in error.message
    assert not pool.marks(key="bad-params")
    await still_serves(runner, worker)


@pytest.mark.parametrize(
    ("kind", "words"),
    [("set", "cannot be stored"), ("object", "cannot be stored"), ("huge", "at most")],
)
async def test_unstorable_result_fails_the_task(
    runner: TaskRunner, worker: WorkerProcess, kind: str, words: str
) -> None:
    """A result BSON cannot hold (a set, a custom object, 17 MiB) → FAIL UnstorableResult."""
    key = f"result-{kind}"
    await runner.publish("returns", {"kind": kind}, key=key, max_failures=1)
    [task] = await wait_for(lambda: finished(runner, key), 30, f"the {kind} result to fail")
    error = task.last_error
    assert task.state is TaskState.FAIL and error is not None
    assert error.type == "UnstorableResult" and words in error.message, error
    assert "result" in error.message
    await still_serves(runner, worker)


@pytest.mark.parametrize("handler", ["raises", "raises_sync"])
@pytest.mark.parametrize("kind", ["KeyboardInterrupt", "SystemExit", "CustomBaseError", "GeneratorExit"])
async def test_base_exception_from_a_handler_fails_only_its_task(
    runner: TaskRunner, worker: WorkerProcess, handler: str, kind: str
) -> None:
    """KeyboardInterrupt, SystemExit, GeneratorExit or a custom BaseException from a handler (async or threaded) is that run's FAIL."""
    key = f"{handler}-{kind}"
    await runner.publish(handler, {"kind": kind}, key=key, max_failures=1)
    [task] = await wait_for(lambda: finished(runner, key), 30, f"{key} to fail")
    error = task.last_error
    assert task.state is TaskState.FAIL and error is not None and error.type == kind
    assert error.traceback and handler in error.traceback
    await still_serves(runner, worker)


async def test_odd_keys_and_values_round_trip(runner: TaskRunner, worker: WorkerProcess) -> None:
    """Keys with $ or . and 10 kB long, binary values and NaN are data: published, run, returned intact."""
    params: dict[str, Any] = {
        "$set": {"$in": [1, 2]},
        "a.b": {"c.d": "dotted"},
        "$$NOW": "not an expression",
        "k" * 10_240: "a 10 kB key",
        "bytes": b"\xff\x00\xfe",
        "nan": math.nan,
        "unicode": "żółw 🐢",
    }
    task = await runner.publish("echo", params, key="odd-keys")
    assert task.params.keys() == params.keys() and task.params["$$NOW"] == "not an expression"
    [done] = await wait_for(lambda: finished(runner, "odd-keys"), 30, "the echo task")
    assert done.state is TaskState.SUCCESS
    [result] = done.results
    assert math.isnan(result.pop("nan"))
    assert result == {k: v for k, v in params.items() if k != "nan"}
    await still_serves(runner, worker)


# -- a collection validator ------------------------------------------------------------------
async def test_validator_refuses_bad_writes_and_accepts_taskrunners_own(
    mongo_uri: str, collection_name: str
) -> None:
    """With init(validator=True) a hand-written invalid document is refused; publish, claim and succeed still pass."""
    async with TaskRunner(mongo_uri, collection=collection_name) as runner:
        await runner.init(validator=True)
        async with AsyncMongoClient[Doc](mongo_uri, tz_aware=True) as client:
            collection = client.taskrunner[collection_name]
            with pytest.raises(WriteError):
                await collection.insert_one({"key": "by-hand", "name": 42, "state": "EXPLODED"})
            assert await collection.count_documents({}) == 0
        task = await runner.publish("quick", {"x": 1}, key="valid")
        assert task.created
        claim = await runner.store.claim("w1", key="valid")
        assert claim is not None
        done = await runs.succeed(runner.store, "valid", claim.run_id, {"ok": True})
        assert done.state is TaskState.SUCCESS and done.results == [{"ok": True}]
        with pytest.raises(WriteRejected):
            await _store_write_refused(runner)


async def _store_write_refused(runner: TaskRunner) -> None:
    """A write through the store that breaks the schema surfaces as WriteRejected, not a driver error."""
    from taskrunner.store.mongo import MongoStore

    store = runner.store
    assert isinstance(store, MongoStore)
    from taskrunner.store.mongo import mapped_errors

    with mapped_errors():
        await store.collection.insert_one({"key": "through-store", "state": 7})
