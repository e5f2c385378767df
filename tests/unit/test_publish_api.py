"""The services' API: TaskRunner.publish / publish_many and the sync facade (memory store)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import pickle
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import taskrunner
from taskrunner import (
    InvalidParams,
    InvalidTask,
    MemoryStore,
    RunnerClosed,
    SyncTask,
    Task,
    TaskContext,
    TaskRunner,
    TaskState,
    UnknownTaskName,
    WaitTimeout,
)


class ResizeParams(BaseModel):
    width: int
    height: int = 10


pytestmark = pytest.mark.parametrize("runner", ["memory"], indirect=True)


@pytest.fixture(autouse=True)
def resize(runner: TaskRunner) -> None:
    """The runner's one handler: ``resize``, with a params model and ``max_failures=5``."""

    @runner.task("resize", max_failures=5)
    async def resize(params: ResizeParams, ctx: TaskContext) -> dict[str, Any]:
        return {"area": params.width * params.height}


async def test_publish_validates_params_against_the_handler_model(runner: TaskRunner) -> None:
    """Registered names get their params validated and stored as JSON-compatible data."""
    task = await runner.publish("resize", ResizeParams(width=3), key="img:42", priority=5)
    assert task.created and task.params == {"width": 3, "height": 10}
    assert task.options.max_failures == 5 and task.priority == 5


async def test_options_accept_seconds_or_timedelta(runner: TaskRunner) -> None:
    """Durations may be numbers of seconds or timedeltas; both are stored as seconds."""
    task = await runner.publish(
        "resize", {"width": 1}, ping_interval=timedelta(seconds=2), ping_timeout=7.5, retry_backoff=1
    )
    assert (task.options.ping_interval, task.options.ping_timeout, task.options.retry_backoff) == (2, 7.5, 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"params": {"width": "wide"}}, "params.width"),
        ({"params": {}}, "params.width"),
        ({"params": {"width": 1}, "bogus": 1}, "options.bogus"),
        ({"params": {"width": 1}, "concurrency": 0}, "options.concurrency"),
        ({"params": {"width": 1}, "ping_interval": 30, "ping_timeout": 5}, "options"),
        ({"params": {"width": 1}, "key": ""}, "key"),
        ({"params": {"width": 1}, "key": "bad\nkey"}, "key"),
        ({"params": {"width": 1}, "worker_ids": "w1"}, "options.worker_ids"),
        ({"params": {"width": 1}, "retry_backoff": True}, "options.retry_backoff"),
    ],
)
async def test_bad_input_names_the_field_and_writes_nothing(
    runner: TaskRunner, kwargs: dict[str, Any], field: str
) -> None:
    """Every kind of bad publish input raises InvalidTask naming the field; nothing is stored."""
    with pytest.raises(InvalidTask) as info:
        await runner.publish("resize", **kwargs)
    assert info.value.field == field
    assert await runner.store.count() == 0


async def test_invalid_params_raise_invalid_params(runner: TaskRunner) -> None:
    """Params failing the model are InvalidParams (a subclass of InvalidTask)."""
    with pytest.raises(InvalidParams, match=r"params\.width"):
        await runner.publish("resize", {"width": "x"})


async def test_invalid_params_name_every_bad_field(runner: TaskRunner) -> None:
    """InvalidParams names every field the model refuses (pydantic's errors), not only the
    first; ``field`` is the first, ``problems`` all of them, in a batch under its index."""
    bad = {"width": "wide", "height": "tall"}
    with pytest.raises(InvalidParams) as info:
        await runner.publish("resize", bad)
    assert [f for f, _ in info.value.problems] == ["params.width", "params.height"]
    assert info.value.field == "params.width"
    assert "params.width: " in str(info.value) and "; params.height: " in str(info.value)
    with pytest.raises(InvalidTask) as batch:
        await runner.publish_many(
            [{"name": "resize", "params": {"width": 1}}, {"name": "resize", "params": bad}]
        )
    assert [f for f, _ in batch.value.problems] == ["tasks[1].params.width", "tasks[1].params.height"]
    assert str(batch.value).count("tasks[1].params.") == 2
    with pytest.raises(InvalidTask) as options:
        await runner.publish("resize", {"width": 1}, nope=1, bogus=2)  # type: ignore[call-arg]  # as an untyped caller
    assert [f for f, _ in options.value.problems] == ["options.bogus", "options.nope"]
    assert await runner.store.count() == 0


async def test_unregistered_names_take_plain_json_dicts(runner: TaskRunner) -> None:
    """A name of another app's handlers (``allow_unknown``) takes plain dicts; non-BSON values are refused."""
    task = await runner.publish("elsewhere", {"any": ["thing", 1]}, allow_unknown=True)
    assert task.params == {"any": ["thing", 1]} and len(task.key) == 32
    with pytest.raises(InvalidTask, match="params"):
        await runner.publish("elsewhere", {"s": {1, 2}}, allow_unknown=True)
    with pytest.raises(InvalidTask, match="params"):
        await runner.publish("elsewhere", {"big": "x" * (16 * 1024 * 1024)}, allow_unknown=True)


async def test_a_runner_with_handlers_refuses_names_it_has_no_handler_for(runner: TaskRunner) -> None:
    """A typo'd name is refused at publish (``UnknownTaskName``, an ``InvalidTask`` naming ``name``
    and the known names), in a batch by its index; nothing is written. A runner without any
    handler (a service that only publishes) accepts every name."""
    with pytest.raises(UnknownTaskName, match=r"^name: .*'resze'.*known: resize"):
        await runner.publish("resze", {"width": 1})
    with pytest.raises(InvalidTask, match=r"tasks\[1\]\.name"):
        await runner.publish_many([{"name": "resize", "params": {"width": 1}}, {"name": "resze"}])
    assert await runner.store.count() == 0
    publisher = TaskRunner(store=runner.store)
    assert (await publisher.publish("resze", key="typo")).name == "resze"


async def test_publish_many_validates_everything_before_writing(runner: TaskRunner) -> None:
    """One bad item in a batch names its index and nothing of the batch is written."""
    with pytest.raises(InvalidTask, match=r"tasks\[1\]\.params\.width"):
        await runner.publish_many(
            [{"name": "resize", "params": {"width": 1}}, {"name": "resize", "params": {}}]
        )
    with pytest.raises(InvalidTask, match=r"tasks\[1\]\.key"):
        await runner.publish_many([{"name": "resize", "params": {"width": 1}, "key": "a"}] * 2)
    assert await runner.store.count() == 0
    tasks = await runner.publish_many([{"name": "resize", "params": {"width": i}} for i in range(3)])
    assert [t.params["width"] for t in tasks] == [0, 1, 2] and all(t.created for t in tasks)


async def test_delay_is_added_to_server_time(runner: TaskRunner) -> None:
    """delay= sets run_at to the store's now plus the delay."""
    task = await runner.publish("resize", {"width": 1}, delay=30)
    assert task.run_at - task.created_at == timedelta(seconds=30)
    assert task.state is TaskState.PENDING


def test_registering_bad_handler_options_fails_at_import_time() -> None:
    """A handler declared with an unknown or invalid option fails when decorated."""
    runner = TaskRunner(store=MemoryStore())
    with pytest.raises(InvalidTask, match=r"options\.nope"):
        runner.task("x", nope=1)(lambda params: None)  # type: ignore[call-arg]  # as an untyped caller
    with pytest.raises(InvalidTask, match=r"options\.concurrency"):
        runner.task("y", concurrency=-1)(lambda params: None)


def test_sync_facade_has_the_same_semantics(runner: TaskRunner) -> None:
    """SyncTaskRunner publishes idempotently and validates like the async API."""
    with runner.sync() as sync:
        assert sync.publish("resize", {"width": 2}, key="s").created
        assert not sync.publish("resize", {"width": 3}, key="s").created
        assert sync.get("s").params["width"] == 2
        with pytest.raises(InvalidParams):
            sync.publish("resize", {"width": "no"})
        assert len(sync.publish_many([{"name": "resize", "params": {"width": 1}}])) == 1


async def test_a_published_task_waits_for_its_own_result(runner: TaskRunner) -> None:
    """``await task.wait()`` on the task publish returned gives the finished task and its results."""
    task = await runner.publish("resize", ResizeParams(width=3, height=4), key="w")
    worker = asyncio.create_task(runner.run_worker(concurrency=1))
    try:
        done = await task.wait(timeout=30)
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
    assert done.state is TaskState.SUCCESS and done.results == [{"area": 12}]
    assert (await done.wait()).state is TaskState.SUCCESS


async def test_task_wait_times_out_as_runner_wait_does(runner: TaskRunner) -> None:
    """With no worker, ``task.wait(timeout)`` raises WaitTimeout holding the last state seen,
    which can wait again; tasks from get and list_tasks wait too."""
    task = await runner.publish("resize", {"width": 1}, key="idle")
    with pytest.raises(WaitTimeout) as info:
        await task.wait(timeout=0.05)
    seen = info.value.task
    assert isinstance(seen, Task) and seen.state is TaskState.PENDING
    await runner.cancel("idle")
    assert (await seen.wait(timeout=5)).state is TaskState.CANCELED
    [listed] = await runner.list_tasks()
    assert (await (await runner.get("idle")).wait()).key == (await listed.wait()).key == "idle"


async def test_a_task_not_from_a_runner_says_why_it_cannot_wait(runner: TaskRunner) -> None:
    """A Task read from the store directly has no runner: wait() says so and what to use;
    ``bound(runner)`` gives it one."""
    await runner.publish("resize", {"width": 1}, key="raw")
    raw = await runner.store.get("raw")
    with pytest.raises(RuntimeError, match=r"not returned by a TaskRunner.*runner\.wait\(task\.key\)"):
        await raw.wait()
    await runner.cancel("raw")
    assert (await raw.bound(runner).wait(timeout=5)).state is TaskState.CANCELED


def test_a_closed_sync_facade_says_it_is_closed(runner: TaskRunner) -> None:
    """Every SyncTaskRunner call after close(), and a wait on a task it returned, raises
    RunnerClosed (a TaskRunnerError) naming the call, not asyncio's bare "Event loop is
    closed"; closing again is harmless."""
    sync = runner.sync()
    handle = sync.publish("resize", {"width": 2}, key="c")
    sync.close()
    calls: dict[str, Callable[[], object]] = {
        "publish": lambda: sync.publish("resize", {"width": 2}),
        "get": lambda: sync.get("c"),
        "wait": lambda: handle.wait(timeout=1),
        "cancel": lambda: sync.cancel("c"),
    }
    for operation, call in calls.items():
        with pytest.raises(RunnerClosed, match=rf"^cannot {operation}: this SyncTaskRunner is closed"):
            call()
    sync.close()


def test_sync_facade_tasks_wait_by_blocking(runner: TaskRunner) -> None:
    """A task the sync facade returned is a SyncTask whose ``wait()`` blocks and returns the
    finished task (a coroutine would do nothing when called from sync code); a WaitTimeout
    carries the last state seen as a SyncTask that can wait again."""
    with runner.sync() as sync:
        task = sync.publish("resize", {"width": 2}, key="s")
        assert isinstance(task, SyncTask) and not isinstance(task, Task)
        with pytest.raises(WaitTimeout) as info:
            task.wait(timeout=0.05)
        seen = info.value.task
        assert isinstance(seen, SyncTask) and seen.state is TaskState.PENDING
        done = threading.Thread(target=sync.cancel, args=("s",))
        done.start()
        finished = seen.wait(timeout=30)
        done.join()
        assert isinstance(finished, SyncTask) and finished.state is TaskState.CANCELED
        assert sync.get("s").wait(timeout=5).state is TaskState.CANCELED
        assert [
            t.wait(timeout=5).key
            for t in sync.publish_many([{"name": "resize", "key": "s", "params": {"width": 1}}])
        ] == ["s"]


def test_the_package_ships_its_type_information() -> None:
    """taskrunner/py.typed exists, so type checkers read the package's annotations (PEP 561)."""
    assert (Path(taskrunner.__file__).parent / "py.typed").is_file()


async def test_the_runner_a_task_waits_with_is_no_part_of_its_value(runner: TaskRunner) -> None:
    """A task bound to a runner equals the same task read directly; a deep copy keeps
    the runner, and pickling (a runner holds a connection) gives an unbound equal task."""
    await runner.publish("resize", {"width": 1}, key="v")
    bound, raw = await runner.get("v"), await runner.store.get("v")
    assert bound == raw
    await runner.cancel("v")
    assert (await copy.deepcopy(bound).wait(timeout=5)).state is TaskState.CANCELED
    unpickled = pickle.loads(pickle.dumps(bound))
    assert unpickled == bound
    with pytest.raises(RuntimeError, match="not returned by a TaskRunner"):
        await unpickled.wait()
