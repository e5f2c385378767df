"""Retries with real ``taskrunner worker`` processes: backoff, failures that are never
retried, and runs that ask to run again later without counting a failure."""

from __future__ import annotations

import itertools
from datetime import datetime
from pathlib import Path

import pytest
from workers import WorkerPool, WorkerProcess, finished

from taskrunner import EntryState, LimitState, TaskRunner, TaskState
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo


async def test_final_failures_end_the_task_at_once_with_budget_left(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """``raise Fail`` and params the handler's model rejects end the task FAIL after one run
    (``fatal``, failures 0) although four more failures were allowed; the handler given bad
    params is never called."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        pool.start_many(["w1", "w2"])
        await runner.publish("fails_fast", key="fail", max_failures=5, retry_backoff=0)
        await runner.publish("typed", {"count": "many"}, key="bad-params", max_failures=5, retry_backoff=0)
        fail, bad = await wait_for(lambda: finished(runner, "fail", "bad-params"), 60, "both tasks")
        marks = pool.marks(key="fail") + pool.marks(key="bad-params")
    for task, error_type in ((fail, "Fail"), (bad, "InvalidParams")):
        assert task.state is TaskState.FAIL and task.fatal and task.failures == 0, task
        [entry] = task.workers
        assert entry.state is EntryState.FAIL and entry.error is not None and entry.error.type == error_type
    assert bad.workers[0].error is not None and "count" in bad.workers[0].error.message
    assert [m["key"] for m in marks] == ["fail"]


async def test_snooze_and_retry_run_again_later_without_a_failure(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """``ctx.snooze(s)`` (a sync handler) and ``raise Retry(delay=s)`` put the task back to
    PENDING for ``s`` seconds: no failure counted even with max_failures=1, ``snoozes``
    counts them, and the next call starts no sooner."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        pool.start_many(["w1", "w2"])
        await runner.publish("snoozes", {"times": 2, "seconds": 0.6}, key="nap", max_failures=1)
        await runner.publish("retry_later", {"delay": 1.0}, key="later", max_failures=1)
        nap, later = await wait_for(lambda: finished(runner, "nap", "later"), 60, "both tasks")
        nap_marks, later_marks = pool.marks(key="nap"), pool.marks(key="later")
    assert nap.state is TaskState.SUCCESS and (nap.failures, nap.snoozes, nap.attempts) == (0, 2, 3)
    assert [w.result for w in nap.workers] == [{"calls": 3}]
    assert len(nap_marks) == 3 and all(b["t"] - a["t"] >= 0.55 for a, b in itertools.pairwise(nap_marks))
    assert later.state is TaskState.SUCCESS and (later.failures, later.snoozes) == (0, 1)
    assert len(later_marks) == 2 and later_marks[1]["t"] - later_marks[0]["t"] >= 0.95


async def test_a_numeric_backoff_spaces_every_retry(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """``backoff=1.5`` waits 1.5 s (server time) between a failed run's end and the next claim,
    every time, until max_failures ends the task."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        pool.start_many(["w1", "w2"])
        await runner.publish("always_fails", key="spaced", max_failures=3, backoff=1.5)
        [task] = await wait_for(lambda: finished(runner, "spaced"), 60, "the task")
    assert task.state is TaskState.FAIL and task.failures == 3 and not task.fatal
    assert task.options.backoff == 1.5
    for before, after in itertools.pairwise(task.workers):
        assert before.finished_at is not None
        assert (after.claimed_at - before.finished_at).total_seconds() >= 1.5 - 0.01


async def test_rate_limited_holds_back_the_whole_name_for_its_retry_after(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """``raise RateLimited(retry_after=3)`` snoozes the task (no failure) and holds back its
    name fleet-wide: once the workers have read the throttle no task of the name starts until
    it ends; other names run on; afterwards everything runs."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = pool.start_many(["w1", "w2"])
        await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")
        params = {"limited_key": "first", "retry_after": 3}
        await runner.publish("calls_api", params, key="first")
        throttled = await wait_for(lambda: _throttle_of(runner, "calls_api"), 60, "the throttle")
        await wait_for(lambda: _holding(workers, "calls_api"), 60, "both workers to hold the name back")
        keys = [f"next{i}" for i in range(6)]
        await runner.publish_many([{"name": "calls_api", "params": params, "key": k} for k in keys])
        await runner.publish("quick", key="other-name")
        tasks = await wait_for(lambda: finished(runner, "first", "other-name", *keys), 60, "every task")
    by_key = {t.key: t for t in tasks}
    first = by_key["first"]
    assert first.state is TaskState.SUCCESS and first.failures == 0 and first.snoozes == 1
    until = throttled.throttled_until
    assert until is not None and throttled.updated_at is not None
    early = [k for k in keys if by_key[k].workers[0].claimed_at < until]
    assert early == [], f"started while the name was rate limited: {early}"
    assert all(by_key[k].state is TaskState.SUCCESS for k in keys)
    assert by_key["other-name"].workers[0].claimed_at < until


def _holding(workers: list[WorkerProcess], name: str) -> bool:
    """Whether every worker has logged ``name`` among the names it holds back (it logs each change)."""
    return all(
        any(name in line.get("paused", []) for line in w.find("paused names changed")) for w in workers
    )


async def _throttle_of(runner: TaskRunner, name: str) -> LimitState | None:
    state = (await runner.store.limits([name])).get(name)
    return state if isinstance(state, LimitState) and state.throttled_until is not None else None


async def test_tasks_held_back_by_rate_limited_start_promptly_when_it_ends(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """``RateLimited(retry_after=1)`` of a whole name (calls_api) and of one ``limit_by``
    value (per_tenant, tenant a): the task that raised it and the tasks of the name or
    value published once the workers hold it back start within 0.5 s after the throttle's
    end, or after their publish if that came later (server times), none before it."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = pool.start_many(["w1", "w2"])
        await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")
        params = {"limited_key": "first", "retry_after": 1}
        await runner.publish("calls_api", params, key="first")
        await runner.publish("per_tenant", {"tenant": "a", "throttle": 1.0}, key="a-first")
        name = await wait_for(lambda: _throttle_of(runner, "calls_api"), 60, "the name's throttle")
        gate = await wait_for(lambda: _gate_throttle(runner, 'per_tenant#"a"'), 60, "tenant a's throttle")
        # Other workers hear of a name's throttle through their limits stream (docs/limits.md):
        # the tasks published next are held back once both have.
        await wait_for(lambda: _holding(workers, "calls_api"), 60, "both workers to hold the name back")
        await runner.publish_many(
            [{"name": "calls_api", "params": params, "key": f"api{i}"} for i in range(3)]
        )
        await runner.publish("per_tenant", {"tenant": "a"}, key="a0")
        keys = ["first", "api0", "api1", "api2", "a-first", "a0"]
        tasks = {t.key: t for t in await wait_for(lambda: finished(runner, *keys), 60, "every task")}
    assert name.throttled_until is not None
    ends = {key: name.throttled_until if key in keys[:4] else gate for key in keys}
    starts = {key: tasks[key].workers[-1].claimed_at for key in keys}
    due = {key: max(ends[key], tasks[key].created_at) for key in keys}
    late = {key: round((starts[key] - due[key]).total_seconds(), 3) for key in keys}
    assert all(starts[key] >= ends[key] for key in keys), late
    assert all(0 <= wait <= 0.5 for wait in late.values()), late


async def _gate_throttle(runner: TaskRunner, gate: str) -> datetime | None:
    state = (await runner.limits(gate.split("#")[0])).stored
    return next((t.until for t in state.throttled_gates if t.gate == gate), None) if state else None
