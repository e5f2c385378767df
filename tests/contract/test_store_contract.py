"""One contract for every store: MemoryStore, MongoStore on the embedded server, and
MongoStore on a real MongoDB when TASKRUNNER_TEST_MONGO_URI is set."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import runs
from pymongo import monitoring
from pymongo.errors import WriteError
from scratch import TEST_MONGO_URI
from stream_ends import StreamEnder

from taskrunner import (
    MalformedTask,
    MemoryStore,
    NewTask,
    TaskError,
    TaskNotFound,
    TaskOptions,
    TaskState,
)
from taskrunner.errors import (
    ChangeHistoryLost,
    ChangeStreamEnded,
    ClaimLost,
    DocumentTooLarge,
    InvalidState,
    ScheduleNotFound,
)
from taskrunner.models import Unreadable, WorkerInfo
from taskrunner.schedules.model import declare
from taskrunner.store import rules
from taskrunner.store.base import (
    ChangeEvent,
    ChangeStream,
    Claimed,
    Failure,
    RunStatus,
    RunWrite,
    RunWriteKind,
    Store,
)
from taskrunner.store.mongo import MongoStore

pytestmark = pytest.mark.mongo
Raw = Callable[[dict[str, Any]], Any]
Elapse = Callable[[float], Awaitable[None]]  # server time passes: the memory clock jumps, a server sleeps


def task(key: str = "k", **values: Any) -> NewTask:
    options = values.pop("options", {})
    return NewTask.build(key=key, name=values.pop("name", "job"), options=options, **values)


async def publish(store: Store, *tasks: NewTask, **kwargs: Any) -> list[Any]:
    return await store.publish(list(tasks), **kwargs)


async def test_publish_writes_a_readable_pending_task(store: Store) -> None:
    """A new key becomes a PENDING document with server timestamps and no entries."""
    [t] = await publish(store, task("a", params={"x": "$not-an-expression"}, priority=3))
    assert t.created and t.state is TaskState.PENDING and t.workers == []
    assert t.params == {"x": "$not-an-expression"} and t.priority == 3
    assert t.run_at == t.claimable_at == t.created_at
    assert (await store.get("a")).key == "a"


async def test_publishing_an_existing_key_writes_nothing(store: Store) -> None:
    """Republishing an active key returns the stored task, not created, unchanged."""
    [first] = await publish(store, task("a", params={"v": 1}))
    [again] = await publish(store, task("a", params={"v": 2}))
    assert not again.created and again.params == {"v": 1} and again.updated_at == first.updated_at


async def test_concurrent_publishers_of_one_key_make_one_document(store: Store) -> None:
    """8 racing publishers of one key leave exactly one document, created once."""
    results = await asyncio.gather(*(publish(store, task("race", params={"n": i})) for i in range(8)))
    assert sum(r[0].created for r in results) == 1
    assert await store.count() == 1


async def test_publish_many_reports_created_per_key(store: Store) -> None:
    """A batch inserts its new keys and returns existing ones as not created."""
    await publish(store, task("old"))
    tasks = await publish(store, task("n1"), task("old"), task("n2"))
    assert [(t.key, t.created) for t in tasks] == [("n1", True), ("old", False), ("n2", True)]


async def test_sixteen_concurrent_claimers_get_one_claim(store: Store) -> None:
    """16 workers racing for a concurrency-1 task: exactly one claim succeeds."""
    await publish(store, task("one"))
    claims = await asyncio.gather(*(store.claim(f"w{i}", key="one") for i in range(16)))
    won = [c for c in claims if c is not None]
    assert len(won) == 1 and len(won[0].task.workers) == 1
    assert (await store.get("one")).state is TaskState.RUNNING


async def test_a_fresh_claim_takes_only_tasks_nobody_ran(store: Store) -> None:
    """``fresh=True`` claims a new task, refuses one with an entry (a second slot, a retry), which the general claim takes."""
    await publish(store, task("new"), task("two", options={"concurrency": 2}))
    fresh = await store.claim("w1", key="new", fresh=True)
    assert fresh is not None and fresh.task.state is TaskState.RUNNING and fresh.entry.attempt == 1
    assert await store.claim("w1", key="two", fresh=True) is not None
    assert await store.claim("w2", key="two", fresh=True) is None
    assert await store.claim("w2", key="two") is not None
    many = await store.claim_many("w3", ["new", "two"], fresh=True)
    assert many.claims == []


async def test_concurrency_admits_that_many_distinct_workers(store: Store) -> None:
    """concurrency=3 lets exactly 3 of 6 racing workers claim."""
    await publish(store, task("three", options={"concurrency": 3}))
    claims = await asyncio.gather(*(store.claim(f"w{i}", key="three") for i in range(6)))
    assert len({c.entry.worker_id for c in claims if c}) == 3


async def test_a_worker_claims_a_task_once(store: Store) -> None:
    """A worker with a live or successful entry cannot claim the task again."""
    await publish(store, task("twice", options={"concurrency": 2}))
    claim = await store.claim("w1", key="twice")
    assert claim is not None and await store.claim("w1", key="twice") is None
    await runs.succeed(store, "twice", claim.run_id, {"ok": True})
    assert await store.claim("w1", key="twice") is None
    assert await store.claim("w2", key="twice") is not None


async def test_stale_run_id_changes_nothing_and_reports_a_lost_claim(store: Store) -> None:
    """Every run write with a run_id that no longer owns a RUNNING entry raises ClaimLost."""
    await publish(store, task("fence"))
    claim = await store.claim("w1", key="fence")
    assert claim is not None
    await runs.succeed(store, "fence", claim.run_id, 1)
    before = await store.get("fence")
    error = TaskError(type="X", message="late")
    for write in (
        runs.ping(store, "fence", claim.run_id),
        runs.succeed(store, "fence", claim.run_id, 2),
        runs.fail(store, "fence", claim.run_id, error),
        store.release("fence", claim.run_id),
        runs.ping(store, "fence", "never-issued"),
    ):
        with pytest.raises(ClaimLost):
            await write
    assert await store.get("fence") == before


async def test_expired_lease_is_taken_over_and_fences_the_old_run(store: Store, elapse: Elapse) -> None:
    """After ping_timeout (server time) another worker claims; the old run can no longer write."""
    await publish(store, task("lease", options={"ping_interval": 0.2, "ping_timeout": 0.6}))
    old = await store.claim("w1", key="lease")
    assert old is not None and await store.claim("w2", key="lease") is None
    await elapse(0.9)
    new = await store.claim("w2", key="lease")
    assert new is not None and [w.worker_id for w in new.task.workers] == ["w2"]
    assert new.task.failures == 1  # a lost lease spends the failure budget
    assert new.entry.took_over == ["w1"] and old.entry.took_over == []
    with pytest.raises(ClaimLost):
        await runs.ping(store, "lease", old.run_id)


async def test_ping_extends_the_lease(store: Store, elapse: Elapse) -> None:
    """Pinging before ping_timeout keeps other workers out past the first deadline."""
    await publish(store, task("alive", options={"ping_interval": 0.3, "ping_timeout": 1.2}))
    claim = await store.claim("w1", key="alive")
    assert claim is not None
    for _ in range(5):  # 1.5 s in all; a server run fails only if one step stalls 0.9 s
        await elapse(0.3)
        pinged = await runs.ping(store, "alive", claim.run_id, progress={"done": 0.5})
    assert pinged.entry(claim.run_id).progress == {"done": 0.5}  # type: ignore[union-attr]
    assert await store.claim("w2", key="alive") is None


async def test_full_slots_are_claimable_at_the_earliest_lease_expiry(store: Store) -> None:
    """With every slot held, claimable_at is the earliest expiry, not the latest, so a freed slot never idles."""
    await publish(store, task("slots", options={"concurrency": 2}))
    a = await store.claim("w1", key="slots")
    b = await store.claim("w2", key="slots")
    assert a is not None and b is not None
    assert b.task.claimable_at == min(w.expires_at for w in b.task.workers)


async def test_failure_spends_budget_and_waits_for_backoff(store: Store, elapse: Elapse) -> None:
    """A failure is recorded with its error, delays the next claim, and max_failures ends the task."""
    await publish(store, task("flaky", options={"max_failures": 2, "retry_backoff": 0.4}))
    first = await store.claim("w1", key="flaky")
    assert first is not None
    failed = await runs.fail(store, "flaky", first.run_id, TaskError(type="ValueError", message="boom"))
    assert failed.state is TaskState.PENDING and failed.failures == 1
    assert failed.workers[0].error == TaskError(type="ValueError", message="boom")
    assert await store.claim("w2", key="flaky") is None
    await elapse(0.6)
    second = await store.claim("w2", key="flaky")
    assert second is not None
    done = await runs.fail(store, "flaky", second.run_id, TaskError(type="ValueError", message="again"))
    assert done.state is TaskState.FAIL and done.claimable_at is None


async def test_failure_waits_the_delay_the_worker_chose(store: Store) -> None:
    """``retry_in`` (the worker's backoff) moves ``run_at`` to server now plus that many seconds."""
    await publish(store, task("later", options={"retry_backoff": 0}))
    claim = await store.claim("w1", key="later")
    assert claim is not None
    failed = await runs.fail(store, "later", claim.run_id, TaskError(type="E", message="m"), retry_in=120)
    finished_at = failed.workers[0].finished_at
    assert failed.state is TaskState.PENDING and failed.failures == 1 and finished_at is not None
    assert failed.run_at == failed.claimable_at
    assert 119 <= (failed.run_at - finished_at).total_seconds() <= 121
    assert await store.claim("w2", key="later") is None


async def test_final_failure_ends_the_task_without_spending_budget(store: Store) -> None:
    """A final failure (``Fail``, invalid params) makes the task FAIL at once with ``fatal``;
    its failure count stays, and an operator's retry clears ``fatal`` for a fresh start."""
    await publish(store, task("doomed", options={"max_failures": 5}))
    claim = await store.claim("w1", key="doomed")
    assert claim is not None
    failed = await runs.fail(store, "doomed", claim.run_id, TaskError(type="Fail", message="no"), final=True)
    assert failed.state is TaskState.FAIL and failed.fatal and failed.failures == 0
    assert failed.claimable_at is None and failed.finished_at is not None
    assert await store.claim("w2", key="doomed") is None
    again = await store.retry("doomed")
    assert again.state is TaskState.PENDING and not again.fatal
    assert await store.claim("w2", key="doomed") is not None


async def test_the_trace_context_is_stored_by_publish_and_replaced_by_retry(store: Store) -> None:
    """A task published with a trace context stores it (docs/observability.md); republishing
    the key keeps the first, a retry with one replaces it, a retry without one keeps it."""
    first, second = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, {"traceparent": "t2"}
    [t] = await publish(store, task("traced", trace=first))
    [again] = await publish(store, task("traced", trace=second))
    assert t.trace == first and not again.created and again.trace == first
    [plain] = await publish(store, task("plain"))
    assert plain.trace is None
    await store.cancel("traced")
    assert (await store.retry("traced", trace=second)).trace == second
    await store.cancel("traced")
    assert (await store.retry("traced")).trace == second


async def test_retry_waits_until_a_canceled_run_has_stopped(store: Store) -> None:
    """Retrying a canceled task whose run still holds its lease raises InvalidState naming the
    state and the worker; once that run gives its claim back, retry makes it PENDING."""
    await publish(store, task("stopping"))
    claim = await store.claim("w1", key="stopping")
    assert claim is not None
    await store.cancel("stopping")
    with pytest.raises(InvalidState, match="it is CANCELED; its run on w1 is still stopping"):
        await store.retry("stopping")
    assert (await store.get("stopping")).state is TaskState.CANCELED
    [status] = await store.write_runs([RunWrite("ping", "stopping", claim.run_id, "w1")])
    assert status is RunStatus.CANCELED  # the old run learns of the cancel and stops
    await store.release("stopping", claim.run_id)
    retried = await store.retry("stopping")
    assert retried.state is TaskState.PENDING and retried.workers == []


async def test_snooze_reschedules_without_a_failure(store: Store) -> None:
    """A snoozed run gives its claim back: PENDING, no failure, no entry, ``snoozes`` counted,
    claimable that many seconds later (server time); the change stream wakes workers."""
    await publish(store, task("nap"))
    claim = await store.claim("w1", key="nap")
    assert claim is not None
    napped = await store.snooze("nap", claim.run_id, 60)
    assert napped.state is TaskState.PENDING and napped.failures == 0 and napped.workers == []
    assert napped.snoozes == 1 and napped.claimable_at == napped.run_at
    assert 59 <= (napped.run_at - napped.updated_at).total_seconds() <= 61
    assert await store.claim("w1", key="nap") is None
    with pytest.raises(ClaimLost):
        await store.snooze("nap", claim.run_id, 1)


async def test_release_returns_the_claim_without_spending_budget(store: Store) -> None:
    """A released claim is claimable at once by another worker; failures stay 0."""
    await publish(store, task("rel"))
    claim = await store.claim("w1", key="rel")
    assert claim is not None
    released = await store.release("rel", claim.run_id)
    assert released.state is TaskState.PENDING and released.failures == 0
    assert await store.claim("w2", key="rel") is not None


async def test_success_needs_concurrency_distinct_workers(store: Store) -> None:
    """A concurrency-2 task is SUCCESS only after two workers succeed."""
    await publish(store, task("pair", options={"concurrency": 2}))
    a, b = await store.claim("w1", key="pair"), await store.claim("w2", key="pair")
    assert a is not None and b is not None
    assert (await runs.succeed(store, "pair", a.run_id, "a")).state is TaskState.RUNNING
    assert (await runs.succeed(store, "pair", b.run_id, "b")).state is TaskState.SUCCESS


async def test_claim_respects_worker_ids_run_at_and_priority(store: Store) -> None:
    """Only listed workers claim; future run_at waits; the best task is highest priority, then oldest."""
    await publish(store, task("only-w9", options={"worker_ids": ["w9"]}, priority=100))
    await publish(store, task("later", delay=60, priority=50))
    await publish(store, task("low", priority=1))
    await publish(store, task("high", priority=5))
    await publish(store, task("high-newer", priority=5))
    order = [c.task.key for c in [await store.claim(f"w{i}") for i in range(4)] if c]
    assert order == ["high", "high-newer", "low"]
    claim = await store.claim("w9")
    assert claim is not None and claim.task.key == "only-w9"


async def test_cancel_stops_a_pending_task_from_being_claimed(store: Store) -> None:
    """A canceled task is CANCELED and never claimable; unknown keys raise TaskNotFound."""
    await publish(store, task("c"))
    assert (await store.cancel("c")).state is TaskState.CANCELED
    assert await store.claim("w1", key="c") is None
    with pytest.raises(TaskNotFound):
        await store.cancel("missing")


async def test_update_pending_and_republish_finished(store: Store) -> None:
    """update_pending rewrites an unstarted task; republish_finished restarts a finished one."""
    await publish(store, task("u", params={"v": 1}))
    [updated] = await publish(store, task("u", params={"v": 2}), update_pending=True)
    assert updated.params == {"v": 2} and not updated.created
    claim = await store.claim("w1", key="u")
    assert claim is not None
    [running] = await publish(store, task("u", params={"v": 3}), update_pending=True)
    assert running.params == {"v": 2}
    await runs.succeed(store, "u", claim.run_id)
    [again] = await publish(store, task("u", params={"v": 4}), republish_finished=True)
    assert again.created and again.state is TaskState.PENDING and again.workers == []
    assert again.params == {"v": 4} and await store.count() == 1


async def test_update_pending_rewrites_only_what_the_call_names(store: Store) -> None:
    """update_pending changes only the fields and options its publish call named: a new
    priority keeps a delayed task's run time, params and options; an option merges into
    the stored ones; ``delay=0`` moves the run time to now; a bare key changes nothing."""
    options = {"concurrency": 2, "max_failures": 5}
    [first] = await publish(store, task("d", params={"v": 1}, delay=3600, priority=1, options=options))
    [prior] = await publish(store, task("d", priority=7), update_pending=True)
    assert (prior.priority, prior.run_at, prior.claimable_at) == (7, first.run_at, first.run_at)
    assert prior.params == {"v": 1} and prior.options == first.options
    assert await store.claim("w1", key="d") is None
    [merged] = await publish(store, task("d", options={"max_failures": 4}), update_pending=True)
    assert (merged.options.max_failures, merged.options.concurrency, merged.run_at) == (4, 2, first.run_at)
    [same] = await publish(store, task("d"), update_pending=True)
    assert same.model_dump(exclude={"updated_at"}) == merged.model_dump(exclude={"updated_at"})
    [due] = await publish(store, task("d", delay=0), update_pending=True)
    assert due.run_at < first.run_at and (due.priority, due.params) == (7, {"v": 1})
    claim = await store.claim("w1", key="d")
    assert claim is not None


BIG_PARAMS = {"blob": "p" * 14_000_000}
"""Params a task document has room for, with a result of at most about 2.6 MB."""


async def test_update_pending_writes_params_as_large_as_a_task_document_allows(store: Store) -> None:
    """update_pending replaces a pending task's params with params of 14 MB, which a task
    document has room for (the write carries them once, within MongoDB's 16 MiB command limit)."""
    await publish(store, task("grown", params={"v": 1}))
    [updated] = await publish(store, task("grown", params=BIG_PARAMS), update_pending=True)
    assert updated.params == BIG_PARAMS and not updated.created
    assert (await store.get("grown")).params == BIG_PARAMS


async def test_an_outcome_that_would_exceed_16_mib_is_refused_and_changes_nothing(store: Store) -> None:
    """A result that would make the document larger than MongoDB's 16 MiB is that write's
    DocumentTooLarge (a worker bounds results before; this is what the store answers when
    a document grew otherwise); the run still owns its RUNNING entry and a failure lands."""
    await publish(store, task("full", params=BIG_PARAMS, options={"max_failures": 1}))
    claim = await store.claim("w1", key="full")
    assert claim is not None
    write = RunWrite("success", "full", claim.run_id, "w1", "r" * 3_000_000)
    [refused] = await store.write_runs([write])
    assert isinstance(refused, DocumentTooLarge), refused
    assert "16 MiB" in str(refused)
    kept = await store.get("full")
    assert kept.state is TaskState.RUNNING and kept.workers[0].result is None
    failed = await runs.fail(
        store, "full", claim.run_id, TaskError(type="DocumentTooLarge", message="m"), final=True
    )
    assert failed.state is TaskState.FAIL and failed.results == []


async def test_a_retry_keeps_the_failed_runs_of_the_last_budget_cycle(store: Store) -> None:
    """Retrying keeps the task's entries as history, but only the last
    max_failures + concurrency - 1 FAIL ones, so that retrying a task again and again does
    not grow its document past 16 MiB."""
    await publish(store, task("again", options={"max_failures": 2, "retry_backoff": 0}))
    run_ids = []
    for _ in range(3):
        for _ in range(2):
            claim = await store.claim("w1", key="again")
            assert claim is not None
            run_ids.append(claim.run_id)
            await runs.fail(store, "again", claim.run_id, TaskError(type="E", message=claim.run_id))
        assert (await store.get("again")).state is TaskState.FAIL
        retried = await store.retry("again")
        assert [w.run_id for w in retried.workers] == run_ids[-2:]
    assert retried.state is TaskState.PENDING and retried.failures == 0


@pytest.mark.parametrize(
    "doc",
    [
        {"claimable_at": None},
        {"claimable_at": "2000-01-01"},
        {"claimable_at": 0},
        {"claimable_at": "MISSING"},
        {"workers": "not-an-array"},
        {"options": None},
        {"failures": "0"},
        {"state": "BOGUS"},
    ],
    ids=["null", "string", "number", "missing", "workers", "options", "failures", "state"],
)
async def test_malformed_documents_are_never_claimed(
    store: Store, raw_insert: Raw, doc: dict[str, Any]
) -> None:
    """Null, missing and wrong-typed claim fields never match (MongoDB's type bracketing)."""
    past = datetime.now(UTC) - timedelta(hours=1)
    base: dict[str, Any] = {
        "key": "bad",
        "name": "job",
        "params": {},
        "priority": 0,
        "created_at": past,
        "updated_at": past,
        "run_at": past,
        "claimable_at": past,
        "state": "PENDING",
        "failures": 0,
        "attempts": 0,
        "workers": [],
        "options": {
            "concurrency": 1,
            "max_failures": 3,
            "local_retries": 0,
            "retry_backoff": 1,
            "ping_interval": 1,
            "ping_timeout": 5,
            "worker_ids": [],
        },
    }
    base.update(doc)
    if base["claimable_at"] == "MISSING":
        del base["claimable_at"]
    await raw_insert(base)
    assert await store.claim("w1") is None


async def test_reads_of_a_malformed_document_carry_its_problem(store: Store, raw_insert: Raw) -> None:
    """get and find read a hand-broken document with ``problem`` naming the field and value,
    placeholders for what does not read; cancel and stats work on such documents."""
    await raw_insert({"key": "broken", "name": "job", "params": "nope", "state": 42})
    task = await store.get("broken")
    assert task.unreadable is not None and task.unreadable.key == task.key
    assert "params" in task.unreadable.problem and "'nope'" in task.unreadable.problem
    assert (task.key, task.name, task.params, task.state) == ("broken", "job", {}, TaskState.PENDING)
    assert [t.key for t in await store.find()] == ["broken"]
    canceled = await store.cancel("broken")
    assert canceled.state is TaskState.CANCELED and canceled.unreadable is not None
    await raw_insert({"key": "bare", "name": "job", "state": "PENDING", "created_at": "yesterday"})
    stats = await store.stats()
    assert stats.counts == {"job": {"CANCELED": 1, "PENDING": 1}} and stats.oldest_pending_seconds is None


MINIMAL = {"key": "by-hand", "name": "job", "params": {"n": 1}}


async def test_a_minimal_document_is_normalized_once_and_then_claimable(
    store: Store, raw_insert: Raw
) -> None:
    """``{key, name, params}`` reaches the sweep as unreadable; ``normalize`` gives it every
    default in server time (claimable_at = run_at) in one write, a second call writes
    nothing, and the task is then claimed like a published one."""
    await raw_insert(dict(MINIMAL))
    before = await store.server_time()
    page = await store.due("w1", ["other"], horizon=before + timedelta(seconds=60))
    assert [u.key for u in page.unreadable] == ["by-hand"] and page.tasks == []
    task = await store.normalize("by-hand")
    assert task.unreadable is None and task.state is TaskState.PENDING and task.params == {"n": 1}
    assert task.options == TaskOptions() and (task.priority, task.failures, task.workers) == (0, 0, [])
    assert task.claimable_at == task.run_at == task.created_at and task.created_at >= before - timedelta(
        seconds=1
    )
    assert await store.normalize("by-hand") == task
    page = await store.due("w1", ["other"], horizon=before + timedelta(seconds=60))
    assert page.unreadable == []
    claim = await store.claim("w1", key="by-hand")
    assert claim is not None and claim.task.state is TaskState.RUNNING


async def test_normalize_fills_only_what_is_missing(store: Store, raw_insert: Raw) -> None:
    """Given fields and options are kept as written; missing options get their defaults
    (``retry_backoff`` alone means a fixed backoff, as when publishing)."""
    run_at = datetime(2030, 1, 1, tzinfo=UTC)
    await raw_insert(
        {**MINIMAL, "priority": 5, "run_at": run_at, "options": {"concurrency": 2, "retry_backoff": 7}}
    )
    task = await store.normalize("by-hand")
    assert task.unreadable is None and task.priority == 5 and task.run_at == task.claimable_at == run_at
    options = task.options
    assert (options.concurrency, options.retry_backoff, options.backoff, options.max_failures) == (
        2,
        7,
        "fixed",
        3,
    )


async def test_racing_normalizations_agree(store: Store, raw_insert: Raw) -> None:
    """Two workers normalizing the same document at once leave one consistent task."""
    await raw_insert(dict(MINIMAL))
    a, b = await asyncio.gather(store.normalize("by-hand"), store.normalize("by-hand"))
    assert a.unreadable is None and b.unreadable is None
    assert a.created_at == b.created_at and a.claimable_at == b.claimable_at


UNREADABLE = [
    ({"state": 42}, "state", "42"),
    ({"state": "PENDING", "claimable_at": "now"}, "claimable_at", "'now'"),
    ({"options": None}, "options", "None"),
    ({"params": ["a"]}, "params", "['a']"),
    ({"options": {"concurrency": 0}}, "options.concurrency", "0"),
]


@pytest.mark.parametrize(("fields", "field", "value"), UNREADABLE)
async def test_a_document_that_still_does_not_read_is_marked_fail(
    store: Store, raw_insert: Raw, fields: dict[str, Any], field: str, value: str
) -> None:
    """Wrong-typed fields are marked in the document: FAIL, fatal, its own error (type
    MalformedTask, naming the field and value); list and stats see it, sweeps no longer
    return it, and a second normalize changes nothing."""
    await raw_insert({**MINIMAL, **fields})
    task = await store.normalize("by-hand")
    assert task.state is TaskState.FAIL and task.fatal and task.error is not None
    assert task.error.type == "MalformedTask" and task.error.message.startswith(f"{field}: ")
    assert value in task.error.message and task.last_error == task.error
    assert [t.state for t in await store.find(state=TaskState.FAIL)] == [TaskState.FAIL]
    assert (await store.stats()).counts == {"job": {"FAIL": 1}}
    now = await store.server_time()
    page = await store.due("w1", ["job"], horizon=now + timedelta(seconds=60))
    assert page.unreadable == [] and page.tasks == []
    assert await store.normalize("by-hand") == task


async def test_a_marked_document_fixed_by_hand_runs_after_retry(
    store: Store, raw_insert: Raw, elapse: Elapse
) -> None:
    """Retrying a marked document sends it back to the sweep: still broken, it is marked
    again; fixed by hand, it is normalized and claimed. Purge removes a marked one."""
    await raw_insert({**MINIMAL, "params": "oops"})
    await store.normalize("by-hand")
    retried = await store.retry("by-hand")
    assert retried.state is TaskState.PENDING and retried.error is None and retried.claimable_at is None
    now = await store.server_time()
    page = await store.due("w1", ["job"], horizon=now + timedelta(seconds=60))
    assert [u.key for u in page.unreadable] == ["by-hand"]
    assert (await store.normalize("by-hand")).state is TaskState.FAIL
    await store.retry("by-hand")
    await _set_by_hand(store, "by-hand", {"params": {"fixed": True}})
    assert (await store.normalize("by-hand")).state is TaskState.PENDING
    claim = await store.claim("w1", key="by-hand")
    assert claim is not None and claim.task.params == {"fixed": True}
    await raw_insert({**MINIMAL, "key": "doomed", "options": None})
    await store.normalize("doomed")
    await elapse(0.01)  # finished before the purge's cutoff
    assert await store.purge([TaskState.FAIL], older_than=0) == 1


async def _set_by_hand(store: Store, key: str, changes: dict[str, Any]) -> None:
    if isinstance(store, MemoryStore):
        store.insert_document({**store.document(key), **changes})
    else:
        assert isinstance(store, MongoStore)
        await store.collection.update_one({"key": key}, {"$set": changes})


async def test_a_scan_names_unreadable_documents_and_pages_past_them(store: Store, raw_insert: Raw) -> None:
    """Scan pages name each unreadable unfinished document and a page holding one does not end the scan."""
    await publish(store, *(task(f"k{i}") for i in range(5)))
    await raw_insert({"key": "k1-broken", "name": "job", "params": "nope", "state": "PENDING"})
    await raw_insert({"key": 7, "name": "job", "state": "PENDING"})  # a key no claim by key can name
    tasks, unreadable, after, pages = [], [], None, 0
    while True:
        page = await store.candidates(after=after, limit=2)
        tasks += [t.key for t in page.tasks]
        unreadable += page.unreadable
        pages += 1
        if page.after is None:
            break
        after = page.after
        assert pages < 10, "the scan does not progress"
    assert tasks == [f"k{i}" for i in range(5)]
    problems = {u.key: u.problem for u in unreadable}
    assert set(problems) == {"k1-broken", None} and "params" in problems["k1-broken"]


async def next_events(stream: ChangeStream, n: int) -> list[ChangeEvent]:
    events: list[ChangeEvent] = []
    for _ in range(n):
        event = await stream.next(5)
        assert event is not None, f"no change event within 5 s (got {len(events)} of {n})"
        events.append(event)
    return events


async def test_watch_delivers_changes_and_resumes_from_a_token(store: Store) -> None:
    """Insert and update events arrive in order; resuming after a token repeats and loses nothing."""
    stream = await store.watch()  # opened before the first write: nothing is missed
    await publish(store, task("w"))
    [first] = await next_events(stream, 1)
    claim = await store.claim("w1", key="w")
    assert claim is not None
    [second] = await next_events(stream, 1)
    await stream.close()
    await runs.succeed(store, "w", claim.run_id, 42)
    await publish(store, task("w2"))
    resumed = await store.watch(resume_after=first.token)
    events = await next_events(resumed, 3)
    assert await resumed.next(0.3) is None
    await resumed.close()
    assert (first.kind, first.key) == ("insert", "w")
    assert second.task is not None and second.task.state is TaskState.RUNNING
    assert [(e.kind, e.key) for e in events] == [("update", "w"), ("update", "w"), ("insert", "w2")]
    assert events[1].task is not None and events[1].task.state is TaskState.SUCCESS


async def test_resume_token_advances_without_events(store: Store) -> None:
    """A stream's resume token covers what it has passed over, so a resume does not replay it."""
    stream = await store.watch()
    await publish(store, task("seen"))
    assert (await next_events(stream, 1))[0].key == "seen"
    token = stream.resume_token
    await stream.close()
    await publish(store, task("after"))
    resumed = await store.watch(resume_after=token)
    assert [e.key for e in await next_events(resumed, 1)] == ["after"]
    await resumed.close()


async def test_malformed_documents_arrive_as_events_with_a_problem(store: Store, raw_insert: Raw) -> None:
    """A hand-broken document yields an event without a task that names the problem."""
    stream = await store.watch()
    await raw_insert({"key": "broken", "name": "job", "params": "nope"})
    [event] = await next_events(stream, 1)
    await stream.close()
    assert (
        event.task is None
        and event.key == "broken"
        and event.unreadable
        and "params" in event.unreadable.problem
    )


async def test_a_workers_stream_hears_new_work_and_wakes_but_no_claims_renewals_or_outcomes(
    store: Store,
) -> None:
    """``watch(work_for=names)`` delivers inserts of those names and wakes (a failure that
    leaves budget, a retry); other names, claims, renewals and outcomes never arrive."""
    stream = await store.watch(work_for=["job"])
    await publish(store, task("a"), task("b", options={"max_failures": 1}), task("other", name="elsewhere"))
    inserts = await next_events(stream, 2)
    claim = await store.claim("w1", key="a")
    assert claim is not None
    await runs.ping(store, "a", claim.run_id)
    await runs.fail(store, "a", claim.run_id, TaskError(type="E", message="once"))  # budget left: wakes
    second = await store.claim("w1", key="b")
    assert second is not None
    await runs.succeed(store, "b", second.run_id, 1)
    [wake] = await next_events(stream, 1)
    await publish(store, task("marker"))  # written last: nothing before it may follow the wake
    [after] = await next_events(stream, 1)
    await stream.close()
    assert (after.kind, after.key) == ("insert", "marker")
    assert [(e.kind, e.key) for e in inserts] == [("insert", "a"), ("insert", "b")]
    assert inserts[0].task is not None and not inserts[0].wake
    assert wake.wake and wake.task is None and wake.kind == "update"
    assert wake.wake_at is not None and wake.wake_at >= (await store.get("a")).run_at - timedelta(seconds=1)


async def test_a_stream_for_some_buckets_hears_only_their_inserts(store: Store, raw_insert: Raw) -> None:
    """With ``owned`` buckets per name, inserts of that name in other buckets never arrive;
    names not in ``owned``, and documents whose bucket is missing or out of range, always do."""
    keys = [f"k{i}" for i in range(40)]
    mine = {rules.bucket_of(k) for k in keys[:20]} - {rules.bucket_of(k) for k in keys[20:]}
    stream = await store.watch(work_for=["job", "mail"], owned={"job": sorted(mine)})
    await publish(store, *(task(k) for k in keys), task("m", name="mail"))
    await raw_insert({"key": "nobucket", "name": "job", "params": {}})
    await raw_insert({"key": "outofrange", "name": "job", "params": {}, "bucket": 5000})
    await publish(store, task("marker", name="mail"))  # written last: it follows what was heard
    heard = await next_events(stream, len([k for k in keys if rules.bucket_of(k) in mine]) + 4)
    await stream.close()
    expected = [k for k in keys if rules.bucket_of(k) in mine] + ["m", "nobucket", "outofrange", "marker"]
    assert [e.key for e in heard] == expected and len(expected) > 3


async def test_a_release_and_a_retry_wake_a_workers_stream(store: Store) -> None:
    """Giving a claim back and retrying a failed task each make the task claimable: both wake."""
    await publish(store, task("r", options={"max_failures": 1}), task("f", options={"max_failures": 1}))
    claim = await store.claim("w1", key="r")
    failed = await store.claim("w1", key="f")
    assert claim is not None and failed is not None
    stream = await store.watch(work_for=["job"])
    await store.release("r", claim.run_id)
    await runs.fail(store, "f", failed.run_id, TaskError(type="E", message="final"))  # no budget: no wake
    await store.retry("f")
    await publish(store, task("marker"))  # written last: nothing but the two wakes comes before it
    events = await next_events(stream, 3)
    await stream.close()
    assert all(e.wake and e.task is None for e in events[:2])
    assert (events[2].kind, events[2].key) == ("insert", "marker")


async def test_due_finds_claimable_work_for_a_worker_earliest_first(store: Store) -> None:
    """The sweep returns unfinished tasks of the worker's names claimable by the horizon,
    earliest first: not finished ones, not other names, not ones the worker runs or ran,
    not ones ``worker_ids`` keep from it, not ones due after the horizon."""
    await publish(store, task("old"), task("later", delay=30), task("far", delay=3600))
    await publish(store, task("other", name="elsewhere"), task("theirs", options={"worker_ids": ["w9"]}))
    await publish(store, task("mine", options={"ping_timeout": 90}), task("done"))
    claim = await store.claim("w1", key="mine")
    done = await store.claim("w2", key="done")
    assert claim is not None and done is not None
    await runs.succeed(store, "done", done.run_id)
    now = await store.server_time()
    page = await store.due("w1", ["job"], horizon=now + timedelta(seconds=60))
    assert [t.key for t in page.tasks] == ["old", "later"] and page.after is None
    assert [t.key for t in (await store.due("w1", ["job"], horizon=now, limit=1)).tasks] == ["old"]
    assert (await store.due("w1", ["job"], horizon=now, limit=1)).after is not None
    assert "mine" in [
        t.key for t in (await store.due("w2", ["job"], horizon=now + timedelta(seconds=100))).tasks
    ]


async def test_due_lists_a_task_held_by_the_workers_own_expired_lease(store: Store, elapse: Elapse) -> None:
    """A claim whose reply the worker never got leaves its own RUNNING entry: the sweep
    hides the task from that worker only while the entry is live at the horizon, and
    lists it once it expires there, as the claim filter lets the worker take it over."""
    lease = {"ping_interval": 0.2, "ping_timeout": 0.5}
    await publish(store, task("orphan", options=lease))
    assert await store.claim("w1", key="orphan") is not None  # the reply "lost": nobody runs it
    now = await store.server_time()
    assert [t.key for t in (await store.due("w1", ["job"], horizon=now)).tasks] == []
    ahead = await store.due("w1", ["job"], horizon=now + timedelta(seconds=5))
    assert [t.key for t in ahead.tasks] == ["orphan"]
    await elapse(0.8)
    now = await store.server_time()
    assert [t.key for t in (await store.due("w1", ["job"], horizon=now)).tasks] == ["orphan"]
    claim = await store.claim("w1", key="orphan")
    assert claim is not None and [e.worker_id for e in claim.task.workers] == ["w1"]


async def test_due_reads_each_limited_names_tasks_apart_from_other_backlogs(store: Store) -> None:
    """A backlog published first fills a sweep's ``limit`` only for its own group: the
    tasks of a name swept apart (one with fleet-wide limits) are listed all the same, and
    a limited name's own backlog hides no other name's tasks; a full group sets ``after``."""
    await publish(store, *(task(f"bulk{i}") for i in range(6)))
    await publish(store, *(task(f"gated{i}", name="gated") for i in range(2)))
    await publish(store, task("late", name="other"))
    now = await store.server_time()
    names = ["job", "gated", "other"]
    mixed = await store.due("w1", names, horizon=now, limit=3)
    assert [t.key for t in mixed.tasks] == ["bulk0", "bulk1", "bulk2"] and mixed.after is not None
    page = await store.due("w1", names, horizon=now, limit=3, apart=["gated"])
    assert sorted(t.key for t in page.tasks) == ["bulk0", "bulk1", "bulk2", "gated0", "gated1"]
    assert page.after is not None
    page = await store.due("w1", names, horizon=now, limit=2, apart=["job", "gated"])
    assert sorted(t.key for t in page.tasks) == ["bulk0", "bulk1", "gated0", "gated1", "late"]
    page = await store.due("w1", ["gated", "other"], horizon=now, limit=3, apart=["gated"])
    assert sorted(t.key for t in page.tasks) == ["gated0", "gated1", "late"] and page.after is None


async def test_due_lists_expired_leases_before_a_backlog_of_older_new_tasks(
    store: Store, elapse: Elapse
) -> None:
    """A takeover's claimable_at (its lease expiry) is later than a backlog's, yet the sweep
    lists RUNNING tasks first, each state earliest first and up to ``limit`` of each."""
    await publish(store, task("crashed", options={"ping_interval": 0.2, "ping_timeout": 0.5}))
    claim = await store.claim("w9", key="crashed")
    assert claim is not None
    await publish(store, *(task(f"new{i}") for i in range(3)))
    await elapse(0.8)
    now = await store.server_time()
    page = await store.due("w1", ["job"], horizon=now, limit=2)
    assert [t.key for t in page.tasks] == ["crashed", "new0", "new1"] and page.after is not None
    page = await store.due("w1", ["job"], horizon=now)
    assert [t.key for t in page.tasks] == ["crashed", "new0", "new1", "new2"] and page.after is None


async def test_due_finds_unsettled_documents_by_positive_types(store: Store, raw_insert: Raw) -> None:
    """The sweep's unsettled ranges find every unfinished document whose claimable_at is
    missing, null, empty or of another type than a date (arrays by their elements), and
    every document without a valid state; never one with a date (``rules.unsettled``)."""
    now = await store.server_time()
    values: dict[str, Any] = {
        "null": None,
        "empty": [],
        "text": "2000-01-01",
        "number": 0,
        "long": 2**40,
        "object": {"at": now},
        "bool": True,
        "numbers": [1],
        "with-null": [now, None],
        "date": now,
        "dates": [now],
    }
    for label, value in values.items():
        await raw_insert({"key": label, "name": "job", "state": "PENDING", "claimable_at": value})
    await raw_insert({"key": "missing", "name": "job", "state": "RUNNING"})
    await raw_insert({"key": "no-state", "name": "job", "claimable_at": now})
    await raw_insert({"key": "bad-state", "name": "job", "state": 3, "claimable_at": now})
    await raw_insert({"key": "done", "name": "job", "state": "SUCCESS"})
    page = await store.due("w1", ["other"], horizon=now, limit=100)
    found = sorted([str(u.key) for u in page.unreadable] + [t.key for t in page.tasks])
    expected = [k for k in values if k not in ("date", "dates")] + ["missing", "no-state", "bad-state"]
    assert found == sorted(expected)


async def test_stats_count_by_name_and_state_and_the_last_hours_runs(store: Store, raw_insert: Raw) -> None:
    """Counts by name and state; runs that ended within the last hour (server time), not
    before; the oldest PENDING task by its created_at date (one that is not a date ignored)."""
    now = await store.server_time()
    ago = {m: now - timedelta(minutes=m) for m in (10, 30, 120)}

    def entry(state: str, finished: datetime) -> dict[str, Any]:
        return {
            "worker_id": "w",
            "run_id": f"r{state}{finished.minute}",
            "state": state,
            "finished_at": finished,
        }

    base = {"name": "job", "params": {}, "priority": 0, "failures": 0, "attempts": 1, "run_at": ago[120]}
    await raw_insert(
        {
            **base,
            "key": "old",
            "state": "SUCCESS",
            "created_at": ago[120],
            "updated_at": ago[120],
            "workers": [entry("SUCCESS", ago[120])],
        }
    )
    runs = [entry("FAIL", ago[30]), entry("SUCCESS", ago[10])]
    await raw_insert(
        {
            **base,
            "key": "new",
            "state": "SUCCESS",
            "created_at": ago[30],
            "updated_at": ago[10],
            "workers": runs,
        }
    )
    await raw_insert(
        {**base, "key": "p1", "state": "PENDING", "created_at": ago[30], "updated_at": ago[30], "workers": []}
    )
    await raw_insert(
        {**base, "key": "p2", "state": "PENDING", "created_at": "yesterday", "updated_at": ago[30]}
    )
    await raw_insert(
        {**base, "key": "other", "name": "mail", "state": "CANCELED", "created_at": now, "updated_at": now}
    )
    stats = await store.stats()
    assert stats.counts == {"job": {"SUCCESS": 2, "PENDING": 2}, "mail": {"CANCELED": 1}}
    assert (stats.finished_last_hour, stats.failed_last_hour, stats.running) == (2, 1, 0)
    assert stats.oldest_pending_seconds is not None and 1790 < stats.oldest_pending_seconds < 1900


async def test_pinned_away_groups_unfinished_tasks_pinned_to_no_live_worker(
    store: Store, raw_insert: Raw
) -> None:
    """Unfinished tasks whose worker_ids name none of the live ids, grouped by worker_ids,
    most first, with their first keys in order; finished ones, ones naming a live worker,
    unpinned ones and documents without a string key are left out."""
    await publish(
        store,
        *(task(k, options={"worker_ids": ["ghost"]}) for k in ("g3", "g1", "g2")),
        task("o1", options={"worker_ids": ["other", "gone"]}),
        task("live", options={"worker_ids": ["ghost", "w1"]}),
        task("free"),
        task("done", options={"worker_ids": ["ghost"]}),
    )
    await store.cancel("done")
    await raw_insert({"key": "solo", "name": "job", "state": "PENDING", "options": {"worker_ids": "lone"}})
    await raw_insert({"key": 5, "name": "job", "state": "PENDING", "options": {"worker_ids": ["ghost"]}})
    found = await store.pinned_away(["w1", "w2"], examples=2)
    assert [(p.worker_ids, p.tasks, p.keys) for p in found] == [
        (["ghost"], 3, ["g1", "g2"]),
        (["other", "gone"], 1, ["o1"]),  # ties by worker_ids; an array sorts at its least item
        (["lone"], 1, ["solo"]),
    ]
    assert await store.pinned_away(["ghost", "other", "lone"]) == []


async def test_memory_watch_reports_lost_history() -> None:
    """Resuming from a token older than the kept history raises ChangeHistoryLost."""
    store = MemoryStore(history=2)
    await store.publish([task("a"), task("b"), task("c"), task("d")])
    with pytest.raises(ChangeHistoryLost):
        await store.watch(resume_after={"_data": "1"})


async def test_validator_accepts_every_write_taskrunner_makes(store: Store) -> None:
    """With the $jsonSchema validator installed, a full lifecycle passes and a broken insert is refused."""
    if not isinstance(store, MongoStore):
        pytest.skip("the validator is a MongoDB feature")
    await store.init(validator=True)
    await store.init(validator=True)  # idempotent
    await publish(store, task("v", options={"concurrency": 2, "retry_backoff": 0}))
    first, second = await store.claim("w1"), await store.claim("w2")
    assert first is not None and second is not None
    await runs.ping(store, "v", first.run_id, progress={"p": 1})
    await runs.fail(store, "v", first.run_id, TaskError(type="E", message="m", traceback="tb"))
    await store.release("v", second.run_id)
    third = await store.claim("w1")
    assert third is not None
    assert (
        await runs.succeed(store, "v", third.run_id, {"r": 1})
    ).state is TaskState.PENDING  # 1 of 2 successes
    with pytest.raises(WriteError, match=r"[Vv]alidation"):
        await store.collection.insert_one({"key": "broken"})


async def test_registry_lists_live_workers_until_they_expire(store: Store, elapse: Elapse) -> None:
    """A worker's beat registers it for ttl seconds of server time; unregister removes it at once."""
    info = WorkerInfo(
        worker_id="w1", host="h", pid=1, started_at=datetime.now(UTC), names=["job"], concurrency=2
    )
    await store.beat(info, ttl=0.6)
    [live] = await store.workers()
    assert (live.worker_id, live.names, live.concurrency) == ("w1", ["job"], 2)
    assert live.beat_at is not None and live.expires_at is not None and live.expires_at > live.beat_at
    await elapse(0.9)
    assert await store.workers() == []
    await store.beat(info.model_copy(update={"running": ["k"]}), ttl=30)
    assert [w.running for w in await store.workers()] == [["k"]]
    await store.unregister("w1")
    assert await store.workers() == []


async def test_claiming_an_unreadable_document_records_a_failure(store: Store, raw_insert: Raw) -> None:
    """A claimable document that cannot be read fails at once (MalformedTask, ``fatal``), with
    budget left, instead of looping; its failure count is not touched."""
    past = datetime.now(UTC) - timedelta(hours=1)
    await raw_insert(
        {
            "key": "odd",
            "name": "job",
            "params": "not-an-object",
            "priority": "high",
            "created_at": past,
            "updated_at": past,
            "run_at": past,
            "claimable_at": past,
            "state": "PENDING",
            "failures": 0,
            "attempts": 0,
            "workers": [],
            "options": {"concurrency": 1, "max_failures": 3, "ping_timeout": 5, "worker_ids": []},
        }
    )
    with pytest.raises(MalformedTask, match="params"):
        await store.claim("w1")
    assert await store.claim("w2") is None
    [doc] = [d async for d in _raw_docs(store)]
    assert doc["state"] == "FAIL" and doc["failures"] == 0 and doc["fatal"] is True
    assert "claimable_at" not in doc
    assert doc["workers"][0]["state"] == "FAIL" and doc["workers"][0]["error"]["type"] == "MalformedTask"


async def _raw_docs(store: Store) -> AsyncIterator[dict[str, Any]]:
    if isinstance(store, MemoryStore):
        for doc in store.documents():
            yield doc
    else:
        assert isinstance(store, MongoStore)
        async for doc in store.collection.find():
            yield doc


async def test_a_dead_lease_that_spends_the_budget_ends_the_task(store: Store, elapse: Elapse) -> None:
    """When the last allowed run's worker died, the next claim attempt ends the task FAIL
    (instead of leaving it RUNNING forever), records that run FAIL with a LeaseExpired error
    and claims nothing."""
    await publish(store, task("last", options={"ping_interval": 0.2, "ping_timeout": 0.5, "max_failures": 1}))
    dead = await store.claim("w1", key="last")
    assert dead is not None
    await elapse(0.8)
    assert await store.claim("w2", key="last") is None
    ended = await store.get("last")
    assert (ended.state, ended.failures, ended.attempts) == (TaskState.FAIL, 1, 1)
    assert [(w.worker_id, w.run_id, w.state.value) for w in ended.workers] == [("w1", dead.run_id, "FAIL")]
    assert ended.last_error is not None and ended.last_error.type == "LeaseExpired"
    assert ended.finished_at is not None and ended.claimable_at is None and ended.workers[0].finished_at
    assert (await store.retry("last")).state is TaskState.PENDING


async def test_claim_many_claims_each_eligible_key_under_its_own_run_id(store: Store) -> None:
    """One batched claim takes every listed key still claimable, skips taken or unknown ones."""
    await publish(store, *(task(f"b{i}", priority=i) for i in range(4)), task("other", name="else"))
    taken = await store.claim("w2", key="b3")
    assert taken is not None
    claimed = await store.claim_many("w1", ["b0", "b1", "b2", "b3", "gone", "other"], names=["job"])
    assert sorted(c.task.key for c in claimed.claims) == ["b0", "b1", "b2"] and claimed.rejected == []
    assert len({c.run_id for c in claimed.claims}) == 3
    for c in claimed.claims:
        assert c.entry.worker_id == "w1" and c.task.state is TaskState.RUNNING
        assert (await store.get(c.task.key)).entry(c.run_id) is not None
    assert (await store.claim_many("w3", ["b0", "b1"])).claims == []


async def test_a_claim_among_keys_takes_the_best_one_still_claimable(store: Store) -> None:
    """``claim(keys=...)`` takes one task: the best by priority among the listed keys of
    its names still claimable (taken, unknown or unlisted keys are skipped), none when
    every one is gone."""
    await publish(
        store, *(task(f"s{i}", priority=i) for i in range(4)), task("best", name="else", priority=9)
    )
    assert await store.claim("w2", key="s3") is not None
    claim = await store.claim("w1", keys=["s1", "s3", "s2", "gone", "best"], names=["job"])
    assert claim is not None and claim.task.key == "s2" and claim.entry.worker_id == "w1"
    again = await store.claim("w1", keys=["s1", "s2", "s3"], fresh=True)
    assert again is not None and again.task.key == "s1"
    assert await store.claim("w3", keys=["s1", "s2", "s3", "gone"]) is None
    assert (await store.get("s0")).state is TaskState.PENDING


async def test_recover_finds_the_claims_that_still_hold_their_entry(store: Store) -> None:
    """``recover`` returns this worker's claims among the run ids, by key or without keys,
    and not a claim given back, another worker's, or one of a key not asked for."""
    await publish(store, task("a"), task("b"), task("c"))
    claimed = await store.claim_many("w1", ["a", "b", "c"])
    run_ids = {c.task.key: c.run_id for c in claimed.claims}
    await store.release("c", run_ids["c"])
    by_key = await store.recover("w1", list(run_ids.values()), keys=["a", "b", "c"])
    assert sorted((c.task.key, c.run_id) for c in by_key.claims) == [("a", run_ids["a"]), ("b", run_ids["b"])]
    keyless = await store.recover("w1", [run_ids["b"]])
    assert [(c.task.key, c.run_id) for c in keyless.claims] == [("b", run_ids["b"])]
    assert (await store.recover("w2", list(run_ids.values()))).claims == []
    assert (await store.recover("w1", list(run_ids.values()), keys=["c"])).claims == []


async def test_claim_many_records_a_malformed_document_as_its_failure(store: Store, raw_insert: Raw) -> None:
    """A claimable but unreadable document is rejected (not returned) and cannot loop."""
    await publish(store, task("fine"))
    good = (await store.get("fine")).model_dump(by_alias=True)
    await raw_insert(
        {**{k: v for k, v in good.items() if k != "_id"}, "key": "bad", "params": "x", "name": 5}
    )
    claimed = await store.claim_many("w1", ["fine", "bad"])
    assert [c.task.key for c in claimed.claims] == ["fine"]
    assert [(problem.key, problem.field) for problem in claimed.rejected] == [("bad", "name")]
    bad = await store.get("bad")
    assert bad.state is TaskState.FAIL and bad.fatal and [e.type for e in bad.errors] == ["MalformedTask"]
    assert (await store.claim_many("w2", ["bad"])) == Claimed([], [])
    [doc] = [d async for d in _raw_docs(store) if d["key"] == "bad"]
    assert (doc["failures"], doc["attempts"]) == (0, 1)


async def test_write_runs_renews_and_finishes_many_runs_and_names_each_lost_one(store: Store) -> None:
    """One batch: renewals and outcomes land where the run owns its entry; each refusal says why."""
    await publish(store, *(task(f"r{i}", options={"ping_timeout": 30}) for i in range(5)))
    claims = {c.task.key: c for c in (await store.claim_many("w1", [f"r{i}" for i in range(5)])).claims}
    assert len(claims) == 5
    await store.release("r1", claims["r1"].run_id)  # r1: no longer owned
    await store.cancel("r2")
    await runs.succeed(store, "r4", claims["r4"].run_id, "first")  # r4: outcome already written

    def write(kind: Any, key: str, value: Any = None) -> RunWrite:
        return RunWrite(kind, key, claims[key].run_id, "w1", value)

    results = await store.write_runs(
        [
            write("ping", "r0", {"p": 1}),
            write("ping", "r1"),
            write("ping", "r2"),
            write("success", "r3", 42),
            write("failure", "r1", Failure(TaskError(type="X", message="m"))),
        ]
    )
    assert results == [RunStatus.DONE, RunStatus.LOST, RunStatus.CANCELED, RunStatus.DONE, RunStatus.LOST]
    # A retried outcome whose first try landed reports DONE and changes nothing.
    assert await store.write_runs([write("success", "r4", "again")]) == [RunStatus.DONE]
    r0 = await store.get("r0")
    assert r0.entry(claims["r0"].run_id).progress == {"p": 1}  # type: ignore[union-attr]
    assert r0.entry(claims["r0"].run_id).ping_at >= claims["r0"].entry.ping_at  # type: ignore[union-attr]
    assert (await store.get("r3")).state is TaskState.SUCCESS and (await store.get("r3")).results == [42]
    assert (await store.get("r4")).results == ["first"]
    assert (await store.get("r1")).workers == []


async def test_an_outcome_writes_the_runs_last_progress_with_it(store: Store) -> None:
    """A success or failure carrying progress writes it on the run's entry in the same
    write (the quick success and the pipeline alike); one carrying none keeps the entry's."""
    await publish(store, *(task(k, options={"max_failures": 1}) for k in ("one", "fails", "kept")))
    await publish(store, task("shared", options={"concurrency": 2}))
    keys = ["one", "fails", "kept", "shared"]
    claims = {c.task.key: c for c in (await store.claim_many("w1", keys)).claims}
    done = {"fraction": 1.0, "message": "done"}
    await runs.ping(store, "kept", claims["kept"].run_id, progress={"fraction": 0.5, "message": "half"})

    def outcome(key: str, value: Any, progress: Any = done) -> RunWrite:
        kind: RunWriteKind = "failure" if isinstance(value, Failure) else "success"
        return RunWrite(kind, key, claims[key].run_id, "w1", value, progress=progress)

    failure = Failure(TaskError(type="X", message="m"), final=True)
    writes = [outcome("one", 1), outcome("fails", failure), outcome("kept", 3, None), outcome("shared", 4)]
    assert await store.write_runs(writes) == [RunStatus.DONE] * 4
    progress = {
        k: [w.progress for w in (await store.get(k)).workers] for k in ("one", "fails", "kept", "shared")
    }
    assert progress == {
        "one": [done],
        "fails": [done],
        "kept": [{"fraction": 0.5, "message": "half"}],
        "shared": [done],
    }


async def test_write_runs_refuses_a_renewal_once_worker_ids_exclude_the_worker(
    store: Store, raw_insert: Raw, elapse: Elapse
) -> None:
    """A run whose worker an operator removed from worker_ids gets NOT_ALLOWED and no renewal."""
    await publish(store, task("pinned", options={"worker_ids": ["w1"], "ping_timeout": 30}))
    claim = await store.claim("w1", key="pinned")
    assert claim is not None
    ping = RunWrite("ping", "pinned", claim.run_id, "w1")
    assert await store.write_runs([ping]) == [RunStatus.DONE]
    options = (await store.get("pinned")).options.model_dump()
    await _set_by_hand(store, "pinned", {"options": {**options, "worker_ids": ["w9"]}})
    assert (await store.get("pinned")).options.worker_ids == ["w9"]
    before = (await store.get("pinned")).entry(claim.run_id)
    await elapse(0.1)  # a renewal that landed would move ping_at
    assert await store.write_runs([ping]) == [RunStatus.NOT_ALLOWED]
    assert (await store.get("pinned")).entry(claim.run_id) == before  # the lease was not renewed
    assert await store.write_runs([]) == []


# -- schedules ------------------------------------------------------------------------------
async def test_a_declared_schedule_keeps_its_state_and_records_ticks_once(store: Store) -> None:
    """Declaring again updates the definition but keeps paused and last_tick; a tick is recorded only over the tick read."""

    def spec(cron: str) -> Any:
        return declare(
            name="report",
            schedule_id="r",
            cron=cron,
            every=None,
            timezone="Europe/Paris",
            params={},
            priority=0,
            options={},
            catch_up="latest",
            max_catch_up=10,
            jitter=None,
            grace=5,
        )

    now = await store.server_time()
    await store.declare_schedule(spec("*/5 * * * *"), now)
    paused = await store.pause_schedule("r", True)
    assert paused.paused and paused.created_at is not None
    await store.declare_schedule(spec("*/10 * * * *"), now)
    [state] = (await store.schedules(["r", "missing"])).values()
    assert not isinstance(state, Unreadable)
    assert (state.cron, state.paused, state.timezone, state.last_tick) == (
        "*/10 * * * *",
        True,
        "Europe/Paris",
        None,
    )
    tick = now.replace(microsecond=0)
    assert await store.record_tick("r", None, tick, "r@1", tick)
    assert not await store.record_tick("r", None, tick, "r@1", tick)  # another worker got there first
    resumed = await store.pause_schedule("r", False)
    assert (resumed.paused, resumed.last_tick, resumed.last_key) == (False, tick, "r@1")
    assert resumed.resumed_at is not None
    with pytest.raises(ScheduleNotFound):
        await store.pause_schedule("nope", True)


async def test_the_limits_stream_says_when_a_limits_document_changes(store: Store) -> None:
    """``watch_limits`` yields an event after a pause or a throttle is written, and none
    while nothing changes (workers read the documents again on each event)."""
    stream = await store.watch_limits()
    try:
        assert await stream.next(0.3) is None
        await store.pause("quick", True)
        assert await _next_event(stream) is not None
        await store.throttle("quick", 5)
        assert await _next_event(stream) is not None
    finally:
        await stream.close()


async def _next_event(stream: ChangeStream) -> ChangeEvent | None:
    for _ in range(20):  # a look-alike server may deliver the event a getMore later
        event = await stream.next(0.5)
        if event is not None:
            return event
    return None


async def test_a_gate_is_written_only_where_its_expectations_hold(store: Store) -> None:
    """``update_gate`` creates once, then sets paths (array indexes too) only while every
    expected path holds its value, so workers changing different lanes never collide."""
    assert await store.read_gate("g") is None
    lanes = [{"at": datetime(2026, 1, 1, tzinfo=UTC), "holder": None} for _ in range(3)]
    first = await store.update_gate("g", {"shape": None}, {"shape": "3/0", "lanes": lanes}, create=True)
    assert first is not None and first["shape"] == "3/0"
    assert await store.update_gate("g", {"shape": None}, {"shape": "1/0"}, create=True) is None  # exists
    mine = {"shape": "3/0", "lanes.1.holder": None}
    won = await store.update_gate("g", mine, {"lanes.1": {"at": lanes[1]["at"], "holder": "p1"}})
    lost = await store.update_gate("g", mine, {"lanes.1": {"at": lanes[1]["at"], "holder": "p2"}})
    other = await store.update_gate("g", {"shape": "3/0", "lanes.2.holder": None}, {"lanes.2.holder": "p3"})
    assert won is not None and lost is None and other is not None
    stored = await store.read_gate("g")
    assert stored is not None and [lane["holder"] for lane in stored["lanes"]] == [None, "p1", "p3"]


async def test_gates_lists_the_gate_documents_of_the_names_asked(store: Store) -> None:
    """``gates`` returns every gate of the names asked (one per ``limit_by`` value), no other."""
    for gate, name in (("a", "a"), ('a#"x"', "a"), ('a#"y"', "a"), ("b", "b")):
        await store.update_gate(gate, {}, {"name": name, "shape": "1/0"}, create=True)
    assert sorted(doc["_id"] for doc in await store.gates(["a"])) == ["a", 'a#"x"', 'a#"y"']
    assert len(await store.gates(["a", "b"], limit=2)) == 2
    assert await store.gates(["c"]) == []


async def test_a_claim_with_a_window_happens_only_within_it_by_server_time(store: Store) -> None:
    """A gate's permit: outside its window (server time) the task is not claimed, inside it is."""
    await publish(store, task("w1"), task("w2"))
    now = await store.server_time()
    past = (now - timedelta(seconds=60), now - timedelta(seconds=30))
    future = (now + timedelta(seconds=30), now + timedelta(seconds=60))
    open_now = (now - timedelta(seconds=5), now + timedelta(seconds=30))
    assert await store.claim("w", key="w1", window=past) is None
    assert (await store.claim_many("w", ["w1", "w2"], window=future)).claims == []
    claim = await store.claim("w", key="w1", window=open_now)
    assert claim is not None and claim.entry.claimed_at >= open_now[0]
    assert [c.task.key for c in (await store.claim_many("w", ["w2"], window=open_now)).claims] == ["w2"]


async def test_operators_limits_override_and_clear_keeps_the_rest(store: Store) -> None:
    """``set_limits`` sets or lifts (None) a limit; ``clear`` drops operators' limits but
    keeps the pause and what the code declared."""
    await store.declare_limits("quick", {"rate_limit": "5/1s", "max_running": None, "limit_by": None})
    await store.pause("quick", True)
    state = await store.set_limits("quick", {"rate_limit": "10/1s", "max_running": None})
    assert (state.rate_limit, state.max_running, state.paused) == ("10/1s", None, True)
    assert {"rate_limit", "max_running"} <= state.model_fields_set
    cleared = await store.set_limits("quick", {}, clear=True)
    assert cleared.paused and cleared.declared["rate_limit"] == "5/1s"
    assert not {"rate_limit", "max_running"} & cleared.model_fields_set


async def test_a_gate_throttle_keeps_the_longest_end_and_drops_ended_ones(
    store: Store, elapse: Elapse
) -> None:
    """``throttle(gate=...)`` lists each gate once in ``throttled_gates`` with the later of
    its ends (server time), leaves the name-wide throttle alone, and drops ended entries."""
    before = await store.server_time()
    await store.throttle("quick", 30, gate='quick#"a"')
    await store.throttle("quick", 1, gate='quick#"a"')
    await store.throttle("quick", 0.05, gate='quick#"b"')
    await elapse(0.3)
    await store.throttle("quick", 10, gate='quick#"c"')
    state = (await store.limits(["quick"]))["quick"]
    assert not isinstance(state, Unreadable) and state.throttled_until is None
    ends = {t.gate: t.until for t in state.throttled_gates}
    assert set(ends) == {'quick#"a"', 'quick#"c"'}
    assert ends['quick#"a"'] >= before + timedelta(seconds=29)


# -- streams the server ends, and the streams of wait and the dashboard --------------------------
STREAM_KINDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "worker": {"work_for": ["job"]},
    "key": {"key": "k"},
    "summary": {"summary": True},
}


def _mongo_uri(request: pytest.FixtureRequest) -> str:
    """The URI of the server behind the ``store`` fixture's MongoStore."""
    if request.node.callspec.params.get("store") == "real":
        return os.environ[TEST_MONGO_URI]
    uri: str = request.getfixturevalue("embedded_uri")
    return uri


@pytest.fixture
def end_streams(
    request: pytest.FixtureRequest, store: Store, monkeypatch: pytest.MonkeyPatch
) -> Callable[[], Awaitable[None]]:
    """End every open change stream of ``store`` as the server does after an invalidate its
    ``$match`` hides: MemoryStore's hook; the embedded server's fault; on a real MongoDB a
    drop of the watched collections, which is what invalidates streams there."""
    if isinstance(store, MemoryStore):
        memory = store

        async def hook() -> None:
            memory.end_streams()

        return hook
    assert isinstance(store, MongoStore)
    mongo = store
    if request.node.callspec.params.get("store") == "real":

        async def drop() -> None:
            await mongo.collection.drop()
            await mongo.limit_docs.drop()

        return drop
    ender = StreamEnder(_mongo_uri(request), monkeypatch)

    async def fault() -> None:
        assert await ender.end() > 0

    return fault


async def _ended(stream: ChangeStream) -> ChangeStreamEnded:
    """The ``ChangeStreamEnded`` a stream raises once the server ended it (a look-alike may
    need a getMore or two); fails if it keeps answering instead."""
    for _ in range(20):
        try:
            await stream.next(0.5)
        except ChangeStreamEnded as exc:
            return exc
    raise AssertionError("the stream never said it ended")


async def test_a_stream_the_server_ends_raises_and_a_new_one_follows_on(
    store: Store, end_streams: Callable[[], Awaitable[None]]
) -> None:
    """Once the server ends a stream (MongoDB closes its cursor after an invalidate, even one
    the ``$match`` hides) every kind of stream raises ``ChangeStreamEnded`` (cursor closed)
    on each ``next`` instead of returning None for ever; streams opened anew without a
    token then deliver what follows."""
    opened = {name: await store.watch(**options) for name, options in STREAM_KINDS.items()}
    opened["limits"] = await store.watch_limits()
    await publish(store, task("k"))
    await store.pause("job", True)
    for name, stream in opened.items():
        event = await (next_events(stream, 1) if name != "limits" else _next_event(stream))
        assert event, name
    await end_streams()
    for name, stream in opened.items():
        assert (await _ended(stream)).reason == ChangeStreamEnded.CURSOR_CLOSED, name
        with pytest.raises(ChangeStreamEnded):  # and again: an ended stream never answers None
            await stream.next(0.5)
        await stream.close()
    fresh = {
        name: await store.watch(**{**options, "key": "after"} if name == "key" else options)
        for name, options in STREAM_KINDS.items()
    }
    fresh["limits"] = await store.watch_limits()
    await publish(store, task("after"))
    await store.pause("job", False)
    for name, stream in fresh.items():
        if name == "limits":
            assert await _next_event(stream) is not None
        else:
            [event] = await next_events(stream, 1)
            assert (event.kind, event.key) == ("insert", "after"), name
        await stream.close()


async def test_a_closed_stream_raises_on_next(store: Store) -> None:
    """``next`` on a stream this process closed raises ``ChangeStreamEnded`` (closed) at once,
    never returns None without waiting (a loop around it would spin)."""
    for stream in [
        *[await store.watch(**options) for options in STREAM_KINDS.values()],
        await store.watch_limits(),
    ]:
        await stream.close()
        with pytest.raises(ChangeStreamEnded) as ended:
            await stream.next(5)
        assert ended.value.reason == ChangeStreamEnded.CLOSED


async def test_a_keys_stream_hears_its_arrival_state_changes_and_delete_only(
    store: Store, elapse: Elapse
) -> None:
    """``watch(key=...)`` opened before the key exists hears its insert, then follows the
    document: each state change (without the task: read it) and its delete, never a lease
    renewal nor another task's change; a new document under the key is heard and followed."""
    stream = await store.watch(key="k")
    await publish(store, task("k", options={"ping_timeout": 30}), task("other", options={"ping_timeout": 30}))
    claim, other = await store.claim("w1", key="k"), await store.claim("w1", key="other")
    assert claim is not None and other is not None
    await runs.ping(store, "k", claim.run_id)
    await runs.ping(store, "other", other.run_id)
    await runs.succeed(store, "other", other.run_id, 1)
    await runs.succeed(store, "k", claim.run_id, 1)
    await elapse(1)
    assert await store.purge([TaskState.SUCCESS], 0.5) == 2
    await publish(store, task("k"))
    assert await store.claim("w2", key="k") is not None
    events = await next_events(stream, 6)
    assert await stream.next(0.3) is None
    await stream.close()
    heard = [(e.kind, e.key, e.state, e.task.state.value if e.task else None) for e in events]
    assert heard == [
        ("insert", "k", None, "PENDING"),
        ("update", "k", "RUNNING", None),
        ("update", "k", "SUCCESS", None),
        ("delete", "k", None, None),
        ("insert", "k", None, "PENDING"),
        ("update", "k", "RUNNING", None),
    ]
    assert events[1].doc_id is not None and events[1].doc_id == events[3].doc_id != events[5].doc_id


async def test_a_summary_stream_says_each_change_without_documents(store: Store, elapse: Elapse) -> None:
    """``watch(summary=True)``: an insert carries its key, ``_id`` and state; an update only
    the ``_id`` and the state it wrote (none for a renewal); a delete the ``_id``; no event
    carries a task, so nothing had to be looked up."""
    stream = await store.watch(summary=True)
    await publish(store, task("s", options={"ping_timeout": 30}))
    claim = await store.claim("w1", key="s")
    assert claim is not None
    await runs.ping(store, "s", claim.run_id)
    await runs.succeed(store, "s", claim.run_id, 1)
    await elapse(1)
    assert await store.purge([TaskState.SUCCESS], 0.5) == 1
    events = await next_events(stream, 5)
    await stream.close()
    assert [(e.kind, e.key, e.state) for e in events] == [
        ("insert", "s", "PENDING"),
        ("update", None, "RUNNING"),
        ("update", None, None),
        ("update", None, "SUCCESS"),
        ("delete", None, None),
    ]
    assert events[0].doc_id is not None and {e.doc_id for e in events} == {events[0].doc_id}
    assert all(e.task is None for e in events)


class _Aggregates(monitoring.CommandListener):
    """Records every ``aggregate`` command a client sends."""

    def __init__(self) -> None:
        self.commands: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "aggregate":
            self.commands.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


async def test_wait_and_dashboard_streams_ask_for_no_lookup_and_wait_matches_the_id(
    store: Store, request: pytest.FixtureRequest
) -> None:
    """A key's stream and a summary stream ask for no post-image lookup, and a key's
    ``$match`` names the document's ``_id``: MongoDB applies it while reading the oplog, so
    a waiting client costs no lookup per update of other tasks (a ``fullDocument.key``
    match runs after the lookup of every update)."""
    if not isinstance(store, MongoStore):
        pytest.skip("the pipeline a MongoDB server is sent")
    listener = _Aggregates()
    listened = MongoStore.connect(
        _mongo_uri(request),
        database=store.collection.database.name,
        collection=store.collection.name,
        event_listeners=[listener],
    )
    try:
        await publish(store, task("k"))
        found = await store.collection.find_one({"key": "k"})
        assert found is not None
        for options in ({"key": "k"}, {"summary": True}):
            await (await listened.watch(**options)).close()
    finally:
        await listened.close()
    key_stream, summary_stream = listener.commands
    for command in (key_stream, summary_stream):
        assert command["pipeline"][0]["$changeStream"].get("fullDocument", "default") == "default"
    assert found["_id"] in _values_at(key_stream["pipeline"][1]["$match"], "documentKey._id")


def _values_at(match: Any, path: str) -> list[Any]:
    """Every value a ``$match`` (its ``$or`` and ``$and`` branches too) compares ``path`` with."""
    if isinstance(match, list):
        return [v for branch in match for v in _values_at(branch, path)]
    if not isinstance(match, dict):
        return []
    return [v for k, v in match.items() if k == path] + [
        v for k, branch in match.items() if k in ("$or", "$and") for v in _values_at(branch, path)
    ]
