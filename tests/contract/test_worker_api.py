"""The worker's public API: one ``WorkerOptions`` model, and drain mode on both stores."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from pydantic import BaseModel

from taskrunner import (
    ConfigurationError,
    MemoryStore,
    TaskContext,
    TaskRunner,
    TaskState,
    Worker,
    WorkerOptions,
)
from taskrunner.testing import MemoryRunnerFactory

DRAIN_LIMIT = 60.0  # seconds: a drain that never ends fails the test instead of hanging it


class Job(BaseModel):
    n: int = 0
    follow_ups: int = 0
    """How many more tasks the chain publishes after this one."""


ON_BOTH_STORES = pytest.mark.parametrize(
    "runner", ["memory", pytest.param("mongo", marks=pytest.mark.mongo)], indirect=True
)


@pytest.fixture
def app(runner: TaskRunner) -> TaskRunner:
    """The ``runner`` fixture (the memory store or a MongoDB server) with the handlers below."""
    register(runner)
    return runner


def register(runner: TaskRunner) -> None:
    calls: Counter[str] = Counter()

    @runner.task("job")
    async def job(params: Job, ctx: TaskContext) -> dict[str, int]:
        if params.follow_ups:
            await ctx.runner.publish(
                "job", Job(n=params.n + 1, follow_ups=params.follow_ups - 1), key=f"chain{params.n + 1}"
            )
        return {"n": params.n}

    @runner.task("limited", max_running=1)
    async def limited(params: Job, ctx: TaskContext) -> None:
        await asyncio.sleep(0.01)

    @runner.task("flaky", retry_backoff=0)
    async def flaky(params: Job, ctx: TaskContext) -> None:
        calls[ctx.key] += 1
        if calls[ctx.key] == 1:
            raise RuntimeError("fails once")


async def drain(runner: TaskRunner, **fields: Any) -> None:
    async with asyncio.timeout(DRAIN_LIMIT):
        await runner.run_worker(drain=True, **fields)


async def states(runner: TaskRunner) -> dict[str, TaskState]:
    return {task.key: task.state for task in await runner.list_tasks(limit=1000)}


@ON_BOTH_STORES
async def test_drain_runs_every_claimable_task_then_returns(app: TaskRunner) -> None:
    """Publish N, drain: the call returns once all N are SUCCESS."""
    await app.publish_many([{"name": "job", "params": {"n": i}, "key": f"k{i}"} for i in range(12)])
    await drain(app, concurrency=4)
    assert await states(app) == {f"k{i}": TaskState.SUCCESS for i in range(12)}


@ON_BOTH_STORES
async def test_drain_runs_the_follow_ups_its_handlers_publish(app: TaskRunner) -> None:
    """A handler that publishes the next task of a chain: the drain runs the whole chain."""
    await app.publish("job", Job(follow_ups=3), key="chain0")
    await drain(app)
    assert await states(app) == {f"chain{i}": TaskState.SUCCESS for i in range(4)}
    assert (await app.get("chain3")).results == [{"n": 3}]


@ON_BOTH_STORES
async def test_follow_ups_go_through_the_runner_that_runs_the_handler(
    app: TaskRunner, memory_runner: MemoryRunnerFactory
) -> None:
    """A handler publishing through ``ctx.runner`` reaches the runner running it: on a test's
    copy (``memory_runner(app)``) the whole chain lands and runs on the copy's memory store,
    and the app's own store gets nothing."""
    copy = memory_runner(app)
    await copy.publish("job", Job(follow_ups=2), key="chain0")
    await drain(copy)
    assert await states(copy) == {f"chain{i}": TaskState.SUCCESS for i in range(3)}
    assert await app.store.count() == 0


@ON_BOTH_STORES
async def test_drain_leaves_tasks_due_later_pending(app: TaskRunner) -> None:
    """A task whose run_at is an hour away does not keep the drain alive; it stays PENDING."""
    await app.publish("job", key="now")
    await app.publish("job", key="later", delay=3600)
    await drain(app)
    assert await states(app) == {"now": TaskState.SUCCESS, "later": TaskState.PENDING}


@ON_BOTH_STORES
async def test_drain_waits_for_tasks_a_fleet_wide_limit_holds_back(app: TaskRunner) -> None:
    """Tasks of a max_running=1 name are claimable but start one at a time: the drain runs all."""
    await app.publish_many([{"name": "limited", "key": f"l{i}"} for i in range(4)])
    await drain(app, concurrency=4)
    assert await states(app) == {f"l{i}": TaskState.SUCCESS for i in range(4)}


@ON_BOTH_STORES
async def test_drain_runs_retries_that_are_claimable_at_once(app: TaskRunner) -> None:
    """A failure retried with no backoff is claimable now, so the drain runs it again."""
    await app.publish("flaky", key="f")
    await drain(app)
    task = await app.get("f")
    assert task.state is TaskState.SUCCESS and task.failures == 1


@ON_BOTH_STORES
async def test_drain_of_an_empty_queue_returns(app: TaskRunner) -> None:
    """With nothing to run, a drain starts, finds nothing claimable and stops."""
    await drain(app, options=WorkerOptions(concurrency=2))
    assert await states(app) == {}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"concurrency": 0}, "worker option concurrency"),
        ({"batch": 0}, "worker option batch"),
        ({"poll_interval": -1}, "worker option poll_interval"),
        ({"discovery": "push"}, "worker option discovery"),
        ({"worker_id": ""}, "worker option worker_id"),
        ({"concurency": 4}, "unknown worker option 'concurency'"),
    ],
)
def test_a_bad_worker_option_raises_configuration_error_naming_it(fields: dict[str, Any], named: str) -> None:
    """WorkerOptions, Worker and run_worker's keywords all refuse a bad value naming the option."""
    runner = TaskRunner(store=MemoryStore())
    with pytest.raises(ConfigurationError, match=named):
        WorkerOptions(**fields)
    with pytest.raises(ConfigurationError, match=named):
        Worker(runner, **fields)
    with pytest.raises(ConfigurationError, match=named):
        asyncio.run(runner.run_worker(**fields))


def test_keywords_override_the_options_they_name() -> None:
    """Worker(runner, options, **fields): fields replace those options, the rest stay."""
    runner = TaskRunner(store=MemoryStore())
    options = WorkerOptions(concurrency=3, worker_id="a", batch=5)
    worker = Worker(runner, options, worker_id="b", discovery="poll")
    assert worker.options == WorkerOptions(concurrency=3, worker_id="b", batch=5, discovery="poll")
    assert (worker.worker_id, worker.concurrency, worker.batch) == ("b", 3, 5)
    assert worker.discovery.polling and not worker.drain
