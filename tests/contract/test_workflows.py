"""Workflows on every store: tasks that run after others are released, canceled and re-armed
by follow-ups (docs/workflows.md), whoever does them and however often."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import runs
from pymongo.errors import WriteError

from taskrunner import (
    Fail,
    FlowNotFound,
    FlowState,
    InvalidTask,
    NewTask,
    TaskContext,
    TaskRunner,
    TaskState,
    UnknownTaskName,
    UnknownUpstream,
)
from taskrunner.models import TaskError
from taskrunner.store.base import Store
from taskrunner.store.mongo import MongoStore
from taskrunner.testing import wait_for
from taskrunner.workflows import settling
from taskrunner.workflows.follower import Follower

pytestmark = pytest.mark.mongo
BOOM = TaskError(type="E", message="boom")


def runner_on(store: Store) -> TaskRunner:
    """A runner publishing to ``store`` for any task name."""
    return TaskRunner(store=store)


async def finish(store: Store, key: str, *, ok: bool = True) -> None:
    """Claim ``key`` and end it: SUCCESS, or FAIL at once (a final failure)."""
    claim = await store.claim("w1", key=key)
    assert claim is not None, f"{key} is not claimable"
    if ok:
        await runs.succeed(store, key, claim.run_id, {"from": key})
    else:
        await runs.fail(store, key, claim.run_id, BOOM, final=True)


async def follow_up_all(store: Store) -> None:
    """What any worker's sweep does: every follow-up owed."""
    await settling.follow_up(store, await store.follow_ups(limit=10_000))


async def states(store: Store, *keys: str) -> list[str]:
    return [(await store.get(k)).state.value for k in keys]


async def test_a_dependent_waits_and_is_released_once_its_upstreams_succeed(store: Store) -> None:
    """A task published after two others is WAITING, never claimable, until both are SUCCESS;
    then it is PENDING, claimable from its run_at."""
    runner = runner_on(store)
    await runner.publish("job", key="b-1")
    await runner.publish("job", key="b-2")
    waiting = await runner.publish("job", key="load", after=["b-1", "b-2"])
    assert (waiting.state, waiting.waiting_on, waiting.claimable_at) == (
        TaskState.WAITING,
        ["b-1", "b-2"],
        None,
    )
    assert (await store.get("b-1")).dependents
    assert await store.follow_ups(keys=["load", "b-1", "b-2"]) == []  # the publish linked them
    assert await store.claim("w9", key="load") is None
    await finish(store, "b-1")
    await follow_up_all(store)
    assert (await store.get("load")).waiting_on == ["b-2"]
    assert await store.claim("w9", key="load") is None
    await finish(store, "b-2")
    await follow_up_all(store)
    released = await store.get("load")
    assert (released.state, released.waiting_on) == (TaskState.PENDING, [])
    assert released.claimable_at == released.run_at
    assert await store.claim("w9", key="load") is not None


async def test_a_failed_upstream_cancels_what_runs_after_it_transitively(store: Store) -> None:
    """FAIL cancels the dependents, naming the upstream and its state, and theirs in turn;
    a dependent with on_upstream_failure="run" runs anyway once every upstream finished."""
    runner = runner_on(store)
    await runner.publish_many(
        [
            {"name": "job", "key": "a"},
            {"name": "job", "key": "b", "after": ["a"]},
            {"name": "job", "key": "c", "after": ["b"]},
            {"name": "job", "key": "report", "after": ["a"], "on_upstream_failure": "run"},
        ]
    )
    await finish(store, "a", ok=False)
    await follow_up_all(store)
    assert await states(store, "b", "c", "report") == ["CANCELED", "CANCELED", "PENDING"]
    b = await store.get("b")
    assert b.canceled_by == ["a"] and b.error is not None and b.error.type == "UpstreamFailed"
    assert "'a' ended FAIL" in b.error.message
    assert (await store.get("c")).canceled_by == ["b"]


async def test_retrying_a_failed_upstream_re_arms_what_it_canceled(store: Store) -> None:
    """runner.retry on the failed upstream puts its canceled dependents (and theirs) back to
    WAITING, and they run once it succeeds."""
    runner = runner_on(store)
    await runner.publish_many(
        [
            {"name": "job", "key": "a"},
            {"name": "job", "key": "b", "after": ["a"]},
            {"name": "job", "key": "c", "after": ["b"]},
        ]
    )
    await finish(store, "a", ok=False)
    await follow_up_all(store)
    assert await states(store, "b", "c") == ["CANCELED", "CANCELED"]
    await runner.retry("a")
    assert await states(store, "a", "b", "c") == ["PENDING", "WAITING", "WAITING"]
    assert (await store.get("b")).error is None
    await finish(store, "a")
    await follow_up_all(store)
    assert await states(store, "b", "c") == ["PENDING", "WAITING"]


async def test_canceling_an_upstream_cancels_its_dependents_and_an_operator_cancel_stays(
    store: Store,
) -> None:
    """runner.cancel of an upstream cancels its dependents at once; a dependent an operator
    canceled is not re-armed by a retry of its upstream."""
    runner = runner_on(store)
    await runner.publish_many([{"name": "job", "key": "a"}, {"name": "job", "key": "b", "after": ["a"]}])
    await runner.publish("job", key="x", after=["a"])
    await runner.cancel("x")
    await runner.cancel("a")
    assert await states(store, "b", "x") == ["CANCELED", "CANCELED"]
    await runner.retry("a")
    assert await states(store, "b", "x") == ["WAITING", "CANCELED"]


async def test_a_task_published_after_a_finished_upstream_is_settled_at_once(store: Store) -> None:
    """Linking to an upstream that already succeeded releases the new task in the publish
    call; to one that already failed cancels it."""
    runner = runner_on(store)
    await runner.publish_many([{"name": "job", "key": "ok"}, {"name": "job", "key": "bad"}])
    await finish(store, "ok")
    await finish(store, "bad", ok=False)
    released = await runner.publish("job", key="after-ok", after=["ok"])
    assert released.state is TaskState.WAITING  # as written; the link settles it before publish returns
    assert await states(store, "after-ok") == ["PENDING"]
    await runner.publish("job", key="after-bad", after=["bad"])
    assert await states(store, "after-bad") == ["CANCELED"]


async def test_a_follow_up_a_killed_worker_left_is_done_by_a_sweep(store: Store) -> None:
    """An outcome write that ends an upstream owes its dependents a notify; if nobody does
    the follow-up then (the worker died), any worker's sweep releases them."""
    runner = runner_on(store)
    await runner.publish_many([{"name": "job", "key": "a"}, {"name": "job", "key": "b", "after": ["a"]}])
    await finish(store, "a")  # the outcome landed; its worker did nothing more
    [owed] = await store.follow_ups()
    assert (owed.key, owed.notify) == ("a", 1)
    follower = Follower(store, runner.publish_specs, lambda: (0.05, 0.05), runner_log())
    stop = asyncio.Event()
    sweeping = asyncio.create_task(follower.run(stop))
    try:
        await wait_for(lambda: _in_state(store, "b", TaskState.PENDING), 20, "b released by the sweep")
    finally:
        stop.set()
        await sweeping
    assert await store.follow_ups() == []


async def test_racing_follow_ups_release_once_and_leave_no_counter(store: Store) -> None:
    """Many follow-ups of the same notify at once settle the dependent once and remove the
    counter; a notify counted after a follow-up read it stays owed."""
    runner = runner_on(store)
    await runner.publish_many([{"name": "job", "key": "a"}, {"name": "job", "key": "b", "after": ["a"]}])
    await finish(store, "a")
    owed = await store.follow_ups()
    await asyncio.gather(*(settling.follow_up(store, owed) for _ in range(5)))
    b = await store.get("b")
    assert (b.state, b.waiting_on) == (TaskState.PENDING, [])
    assert await store.follow_ups() == []
    await runner.publish("job", key="late", after=["a"])  # a's counter was read before this mark
    stale = [up.__class__(**{**_fields(up), "notify": 0}) for up in owed]
    await store.followed_up(stale)
    assert await store.follow_ups() == []  # nothing left owed: the late link settled at once


async def test_bad_after_is_a_clear_error_and_publishes_nothing(store: Store) -> None:
    """An unknown upstream, one later in the batch, the task itself, a string instead of a
    list, or republish_finished with after: each names the problem, and nothing is stored."""
    runner = runner_on(store)
    with pytest.raises(UnknownUpstream, match="'nope'") as unknown:
        await runner.publish_many(
            [{"name": "job", "key": "x1"}, {"name": "job", "key": "x2", "after": ["nope"]}]
        )
    assert (unknown.value.key, unknown.value.upstream) == ("x2", "nope")
    with pytest.raises(InvalidTask, match="comes later"):
        await runner.publish_many(
            [{"name": "job", "key": "x3", "after": ["x4"]}, {"name": "job", "key": "x4"}]
        )
    with pytest.raises(InvalidTask, match="cannot run after itself"):
        await runner.publish("job", key="x5", after=["x5"])
    with pytest.raises(InvalidTask, match="not the string"):
        await runner.publish("job", key="x6", after="x1")  # a str is an Iterable[str]: refused at run time
    with pytest.raises(InvalidTask, match="after"):
        await runner.publish("job", key="x7", after=[1])  # type: ignore[list-item]
    await runner.publish("job", key="up")
    with pytest.raises(InvalidTask, match="republish_finished"):
        await runner.publish("job", key="x8", after=["up"], republish_finished=True)
    assert [t.key for t in await store.find()] == ["up"]


async def test_a_flow_publishes_its_graph_once_under_readable_keys(store: Store) -> None:
    """runner.flow derives step keys from the flow id; chain and group wire after; publishing
    the flow again adds nothing; get_flow reads it back."""
    runner = runner_on(store)

    def build() -> Any:
        flow = runner.flow("nightly")
        extract = flow.add("extract", {"day": 1})
        parts = flow.group(("transform", {"n": 1}), ("transform", {"n": 2}), after=extract)
        load = flow.add("load", after=parts)
        flow.chain(("report", {}), ("notify", {}), after=load)
        return flow

    published = await build().publish()
    keys = [t.key for t in published]
    assert keys == [
        "nightly/extract",
        "nightly/transform",
        "nightly/transform-2",
        "nightly/load",
        "nightly/report",
        "nightly/notify",
    ]
    assert all(t.created for t in published)
    assert (await store.get("nightly/load")).after == ["nightly/transform", "nightly/transform-2"]
    assert (await store.get("nightly/notify")).after == ["nightly/report"]
    again = await build().publish()
    assert not any(t.created for t in again)
    view = await runner.get_flow("nightly")
    assert view.state is FlowState.RUNNING
    assert [s.state.value for s in view.steps] == ["PENDING"] + ["WAITING"] * 5
    with pytest.raises(FlowNotFound):
        await runner.get_flow("other")


async def test_a_flow_refuses_a_duplicate_key_and_an_unknown_compensation(store: Store) -> None:
    """Two steps with one key, and a compensation naming a task no handler has, are errors
    at add and publish time; nothing is published."""
    runner = runner_on(store)
    runner.task("charge")(_noop)
    flow = runner.flow("f")
    flow.add("charge", key="one")
    with pytest.raises(InvalidTask, match="two steps keyed 'one'"):
        flow.add("charge", key="one")
    flow.add("charge", key="two", compensate=("refnud", {}))
    with pytest.raises(UnknownTaskName, match="refnud") as error:
        await flow.publish()
    assert error.value.field.startswith("steps['two'].compensate")
    assert await store.find() == []


@pytest.mark.parametrize("runner", ["memory", "mongo"], indirect=True)
async def test_a_failed_saga_runs_its_compensations_in_reverse_order_once(runner: TaskRunner) -> None:
    """A failed step stops the flow (unstarted steps canceled) and runs the compensations of
    the succeeded steps in reverse dependency order, each once, with the step's result in
    ctx.upstream; the flow ends COMPENSATED."""
    undone: list[tuple[str, Any]] = []

    @runner.task()
    async def step(params: dict[str, Any], ctx: TaskContext) -> str:
        if params.get("fail"):
            raise Fail("card declined")
        return f"done {ctx.key}"

    @runner.task()
    async def undo(params: dict[str, Any], ctx: TaskContext) -> None:
        [compensated] = [t for t in ctx.upstream.values() if t.compensate is not None]
        undone.append((params["what"], compensated.results))

    flow = runner.flow("order-1")
    reserve = flow.add("step", {}, key="reserve", compensate=("undo", {"what": "reserve"}))
    charge = flow.add("step", {}, key="charge", after=reserve, compensate=("undo", {"what": "charge"}))
    side = flow.add("step", {}, key="side", compensate=("undo", {"what": "side"}))
    ship = flow.add("step", {"fail": True}, key="ship", after=[charge, side])
    flow.add("step", {}, key="notify", after=ship)
    await flow.publish()
    worker = asyncio.create_task(runner.run_worker(concurrency=1))
    try:
        view = await wait_for(lambda: _compensated(runner, "order-1"), 60, "the flow compensated")
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    assert sorted(undone) == sorted(
        [("reserve", ["done reserve"]), ("charge", ["done charge"]), ("side", ["done side"])]
    )
    assert [w for w, _ in undone].index("charge") < [w for w, _ in undone].index("reserve")
    assert [(s.key, s.state.value) for s in view.steps] == [
        ("reserve", "SUCCESS"),
        ("charge", "SUCCESS"),
        ("side", "SUCCESS"),
        ("ship", "FAIL"),
        ("notify", "CANCELED"),
    ]
    assert {c.key: c.after for c in view.compensations}["reserve/undo"] == ["reserve", "charge/undo"]
    assert all(len(c.workers) == 1 for c in view.compensations)


async def test_the_validator_accepts_every_workflow_write(store: Store) -> None:
    """With the $jsonSchema validator, WAITING tasks, links, settles and a flow's stop pass."""
    if not isinstance(store, MongoStore):
        pytest.skip("the validator is a MongoDB feature")
    await store.init(validator=True)
    runner = runner_on(store)
    await runner.publish_many([{"name": "job", "key": "a"}, {"name": "job", "key": "b", "after": ["a"]}])
    await finish(store, "a", ok=False)
    await follow_up_all(store)
    await runner.retry("a")
    assert await states(store, "b") == ["WAITING"]
    with pytest.raises(WriteError, match=r"[Vv]alidation"):
        await store.collection.insert_one({"key": "broken", "state": "BLOCKED"})


async def _noop(params: dict[str, Any]) -> None:
    return None


async def _in_state(store: Store, key: str, state: TaskState) -> bool:
    return (await store.get(key)).state is state


async def _compensated(runner: TaskRunner, flow: str) -> Any:
    view = await runner.get_flow(flow)
    return view if view.state is FlowState.COMPENSATED else None


def _fields(up: Any) -> dict[str, Any]:
    return {name: getattr(up, name) for name in up.__slots__}


def runner_log() -> Any:
    from taskrunner.observability.logs import get_logger

    return get_logger("taskrunner.test")


@pytest.mark.parametrize("runner", ["memory", "mongo"], indirect=True)
async def test_a_draining_worker_runs_a_whole_flow_before_it_stops(runner: TaskRunner) -> None:
    """A worker in drain mode does not stop while a follow-up may still release a task:
    a chain and a fan-in run to the end, each step seeing its upstreams' results."""
    seen: dict[str, list[Any]] = {}

    @runner.task()
    async def step(params: dict[str, Any], ctx: TaskContext) -> int:
        seen[ctx.key] = sorted(r for t in ctx.upstream.values() for r in t.results)
        return int(params["n"])

    flow = runner.flow("drained")
    first = flow.add("step", {"n": 1})
    middle = flow.group(*[("step", {"n": n}) for n in (2, 3, 4)], after=first)
    flow.chain(("step", {"n": 5}), ("step", {"n": 6}), after=middle)
    await flow.publish()
    await asyncio.wait_for(runner.run_worker(drain=True, concurrency=2), 60)
    view = await runner.get_flow("drained")
    assert view.state is FlowState.SUCCESS
    assert seen["drained/step-5"] == [2, 3, 4] and seen["drained/step-6"] == [5]


async def test_follow_ups_of_keys_are_those_keys_only(store: Store) -> None:
    """Asking for the follow-ups some keys owe returns theirs, not those other tasks owe."""
    runner = runner_on(store)
    await runner.publish_many([{"name": "job", "key": "u1"}, {"name": "job", "key": "u2"}])
    await store.publish(
        [NewTask.build(key=k, name="job", after=[u]) for k, u in (("d1", "u1"), ("d2", "u2"))]
    )
    assert [up.key for up in await store.follow_ups(keys=["d1"])] == ["d1"]
    assert sorted(up.key for up in await store.follow_ups()) == ["d1", "d2"]


async def test_a_hand_written_task_with_after_waits_for_it(store: Store, raw_insert: Any) -> None:
    """A document written in the mongo shell with ``after`` and no state is normalized to
    WAITING on those keys (not PENDING), and runs once they succeed."""
    runner = runner_on(store)
    await runner.publish("job", key="up")
    await raw_insert({"key": "by-hand", "name": "job", "after": ["up"]})
    normalized = await store.normalize("by-hand")
    assert (normalized.state, normalized.waiting_on, normalized.claimable_at) == (
        TaskState.WAITING,
        ["up"],
        None,
    )
    await follow_up_all(store)  # the link a sweep does
    assert await states(store, "by-hand") == ["WAITING"]
    await finish(store, "up")
    await follow_up_all(store)
    assert await states(store, "by-hand") == ["PENDING"]
