"""Backoff policies, and what a worker writes when a handler fails, gives up or snoozes."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import structlog

from taskrunner import Fail, MemoryStore, RateLimited, Retry, TaskContext, TaskOptions, TaskRunner, TaskState
from taskrunner.engine.retries import delay
from taskrunner.engine.worker import Worker
from taskrunner.limits.watch import LimitWatch
from taskrunner.testing import wait_for


def test_setting_only_retry_backoff_keeps_a_fixed_delay() -> None:
    """The default policy is exponential; ``retry_backoff`` alone means a fixed delay of that many seconds."""
    assert TaskOptions().backoff == "exponential"
    assert TaskOptions(retry_backoff=7).backoff == "fixed"
    assert TaskOptions(retry_backoff=7, backoff="exponential").backoff == "exponential"
    assert TaskOptions(backoff=timedelta(minutes=1)).backoff == 60.0


def test_exponential_backoff_is_full_jitter_under_a_growing_capped_ceiling() -> None:
    """Exponential waits uniformly in [0, min(cap, base * factor ** (n - 1))]; huge n hits the cap."""
    options = TaskOptions(backoff="exponential", retry_backoff=2, backoff_factor=3, backoff_cap=100)
    assert [delay(options, n, lambda: 1.0) for n in (1, 2, 3, 4, 5)] == [2, 6, 18, 54, 100]
    assert delay(options, 10_000, lambda: 1.0) == 100
    assert delay(options, 3, lambda: 0.5) == 9
    assert delay(options, 3, lambda: 0.0) == 0
    draws = [delay(options, 2) for _ in range(200)]
    assert all(0 <= d <= 6 for d in draws) and len(set(draws)) > 100


def test_fixed_and_numeric_backoffs_ignore_the_failure_count() -> None:
    """ "fixed" waits ``retry_backoff``; a number waits that many seconds, whatever the count."""
    fixed, numeric = TaskOptions(backoff="fixed", retry_backoff=4), TaskOptions(backoff=2.5)
    assert {delay(fixed, n) for n in range(1, 20)} == {4}
    assert {delay(numeric, n) for n in range(1, 20)} == {2.5}


def test_retry_rejects_a_negative_delay() -> None:
    """``Retry`` and ``RateLimited`` refuse delays that cannot be scheduled, naming the value."""
    with pytest.raises(ValueError, match="-1"):
        Retry(delay=-1)
    assert RateLimited(30).delay == 30


async def _run_once(runner: TaskRunner, key: str) -> None:
    worker = Worker(runner, worker_id="w")
    running = asyncio.create_task(worker.run())

    async def ran() -> bool:
        task = await runner.get(key)
        return task.state.finished or bool(task.failures or task.snoozes)

    try:
        await wait_for(ran, what=f"{key} to run once", interval=0.01)
    finally:
        worker.stop()
        await running


async def test_a_failure_schedules_the_next_attempt_by_the_tasks_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker draws the exponential delay for the task's failure count; ``run_at`` shows it."""
    monkeypatch.setattr(random, "random", lambda: 1.0)
    runner = TaskRunner(store=MemoryStore())

    @runner.task("boom")
    async def boom(params: dict[str, Any]) -> None:
        raise RuntimeError("boom")

    await runner.publish("boom", key="b", backoff="exponential", retry_backoff=300, backoff_cap=1000)
    await _run_once(runner, "b")
    task = await runner.get("b")
    finished_at = task.workers[0].finished_at
    assert task.state is TaskState.PENDING and task.failures == 1 and finished_at is not None
    assert (task.run_at - finished_at).total_seconds() == pytest.approx(300, abs=1)


async def test_fail_ends_the_task_and_rate_limited_snoozes_it() -> None:
    """``Fail`` is final (FAIL, ``fatal``, no failure spent); ``RateLimited`` reschedules the
    task ``retry_after`` seconds later without a failure."""
    runner = TaskRunner(store=MemoryStore())

    @runner.task("give_up")
    async def give_up(params: dict[str, Any]) -> None:
        raise Fail("no point")

    @runner.task("throttled")
    async def throttled(params: dict[str, Any], ctx: TaskContext) -> None:
        raise RateLimited(retry_after=120)

    await runner.publish("give_up", key="g", max_failures=9)
    await runner.publish("throttled", key="t", max_failures=1)
    await _run_once(runner, "g")
    await _run_once(runner, "t")
    gave_up, limited = await runner.get("g"), await runner.get("t")
    assert gave_up.state is TaskState.FAIL and gave_up.fatal and gave_up.failures == 0
    assert limited.state is TaskState.PENDING and limited.failures == 0 and limited.snoozes == 1
    assert limited.workers == [] and (limited.run_at - limited.updated_at).total_seconds() == pytest.approx(
        120, abs=1
    )


async def test_an_unreadable_limits_document_pauses_nothing_and_is_reported_once() -> None:
    """A limits document broken by hand (``paused: "maybe"``) pauses nothing; the problem,
    naming the field, is logged once, not at every read."""
    store = MemoryStore()
    store._limits["quick"] = {"_id": "quick", "paused": "maybe"}
    changes: list[frozenset[str]] = []
    watch = LimitWatch(store, ["quick"], changes.append, lambda: datetime.now(UTC))
    with structlog.testing.capture_logs() as logs:
        await watch.refresh()
        await watch.refresh()
    assert watch.paused == frozenset() and changes == []
    assert "paused" in watch.problems["quick"]
    assert [e["event"] for e in logs] == ["skipping unreadable limits document"]
    await store.pause("quick", True)
    await watch.refresh()
    assert watch.paused == frozenset({"quick"}) and changes == [frozenset({"quick"})]
