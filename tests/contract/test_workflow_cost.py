"""What releasing (or canceling) the dependents of a task costs in commands: a handful for
1,000 dependents as for 10, counted on a MongoStore with the opt-in RoundTripCounter.

The counted follow-up is the worker's own (``taskrunner.workflows.follower``): read what
the ended task owes, settle its dependents (a page of ``CHUNK`` found by key, then one
update for the page), remove the counter, read what the settled ones owe in turn.
"""

from __future__ import annotations

from typing import Any

import pytest

from taskrunner import TaskContext, TaskError, TaskRunner, TaskSpec, TaskState
from taskrunner.observability.roundtrips import RoundTripCounter
from taskrunner.store import fields as f
from taskrunner.store.base import Failure, RunStatus, RunWrite
from taskrunner.store.mongo import CHUNK, MongoStore
from taskrunner.workflows.settling import follow_up

pytestmark = pytest.mark.mongo


async def follow_up_commands(
    runner: TaskRunner, counter: RoundTripCounter, prefix: str, dependents: int, succeed: bool
) -> dict[str, int]:
    """Publish ``<prefix>-up`` and ``dependents`` tasks after it, end it (SUCCESS, or FAIL
    at once), then count the commands of the follow-up its worker does."""
    up = f"{prefix}-up"
    keys = [f"{prefix}-{i:04}" for i in range(dependents)]
    await runner.publish_many(
        [TaskSpec(name="noop", key=up), *[TaskSpec(name="noop", key=k, after=[up]) for k in keys]]
    )
    store = runner.store
    claim = await store.claim("w1", key=up)
    assert claim is not None
    error = TaskError(type="Boom", message="failed on purpose")
    value: Any = None if succeed else Failure(error, final=True)
    write = RunWrite("success" if succeed else "failure", up, claim.run_id, "w1", value)
    assert await store.write_runs([write]) == [RunStatus.DONE]
    counter.reset()
    await follow_up(store, await store.follow_ups(keys=[up]))
    counts = counter.snapshot()
    states = {t.state for t in await store.get_many(keys)}
    assert states == {TaskState.PENDING if succeed else TaskState.CANCELED}
    return counts


@pytest.mark.parametrize("succeed", [True, False], ids=["released", "canceled"])
async def test_settling_1000_dependents_takes_a_bounded_number_of_commands(
    mongo_uri: str, collection_name: str, succeed: bool
) -> None:
    """The follow-up of a task with 1,000 dependents sends a handful of commands, at most a
    find and an update per page of ``CHUNK`` dependents more than for 10, never one per
    dependent; every dependent is released (PENDING) when the task succeeded, canceled
    (UpstreamFailed) when it failed."""
    counter = RoundTripCounter()
    store = MongoStore.connect(mongo_uri, collection=collection_name, event_listeners=[counter])
    runner = TaskRunner(store=store)

    @runner.task("noop")
    async def noop(params: dict[str, Any], ctx: TaskContext) -> None:
        return None

    async with runner:
        await runner.init()
        small = await follow_up_commands(runner, counter, "small", 10, succeed)
        large = await follow_up_commands(runner, counter, "large", 1000, succeed)
        canceled = await store.get("large-0999")
    print(f"10 dependents: {small}; 1,000 dependents: {large}")
    pages = -(-1000 // CHUNK)
    assert set(large) == set(small) == {"find", "update"}
    assert large["find"] - small["find"] <= pages and large["update"] - small["update"] <= pages
    assert sum(large.values()) <= 10
    if not succeed:
        assert canceled.error is not None and canceled.error.type == f.UPSTREAM_FAILED
        assert canceled.canceled_by == ["large-up"]
