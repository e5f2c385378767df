"""The parts of workflows that need no store: a flow's keys and wiring, what a publish call
may name in after, the order compensations run in, and the state a flow adds up to."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from support import stored_task

from taskrunner import FlowState, InvalidTask, NewTask, Task, TaskRunner, TaskState, UnknownUpstream
from taskrunner.models import Compensation
from taskrunner.workflows import linking, saga
from taskrunner.workflows.model import flow_state

NOW = datetime(2026, 11, 26, tzinfo=UTC)


def stored(key: str, state: str = "SUCCESS", after: list[str] | None = None, **fields: Any) -> Task:
    """A task as a store would return it."""
    return stored_task(key, state, after=after or [], **fields)


def test_steps_get_keys_from_the_flow_id_and_chain_and_group_wire_after() -> None:
    """A name's first step is <flow>/<name>, the next <flow>/<name>-2; group puts steps side by
    side after the same upstreams; chain puts each after the one before."""
    flow = TaskRunner().flow("f")
    a = flow.add("extract")
    group = flow.group(("t", {"n": 1}), {"name": "t", "params": {"n": 2}, "priority": 5}, after=a)
    chain = flow.chain(("load", None), ("report", None), after=group)
    assert [s.key for s in flow.steps] == ["f/extract", "f/t", "f/t-2", "f/load", "f/report"]
    specs = flow._steps
    assert specs["f/t-2"]["after"] == ["f/extract"] and specs["f/t-2"]["priority"] == 5
    assert specs["f/load"]["after"] == ["f/t", "f/t-2"] and specs["f/report"]["after"] == [chain[0].key]
    assert flow.add("x", key="mine", after="stored-key").key == "mine"
    assert specs["mine"]["after"] == ["stored-key"]


def test_a_flow_refuses_what_it_cannot_publish() -> None:
    """A bad flow id, an after that is not steps or keys, a bad compensate, a step spec of
    the wrong shape and a flow with no steps each name the problem."""
    runner = TaskRunner()
    with pytest.raises(InvalidTask, match="flow id"):
        runner.flow("")
    flow = runner.flow("f")
    with pytest.raises(InvalidTask, match="steps or task keys"):
        flow.add("a", after=[3])  # type: ignore[list-item]
    with pytest.raises(InvalidTask, match=r"\(task name, params\)"):
        flow.add("a", compensate="refund")  # type: ignore[arg-type]
    with pytest.raises(InvalidTask, match="a step is"):
        flow.group(("a",))  # type: ignore[arg-type]
    with pytest.raises(InvalidTask, match="chain and group set"):
        flow.chain({"name": "a", "after": ["x"]})  # type: ignore[arg-type]


async def test_publishing_an_empty_flow_is_an_error() -> None:
    """A flow without steps publishes nothing and says so."""
    with pytest.raises(InvalidTask, match="no steps"):
        await TaskRunner().flow("f").publish()


def new(key: str, *after: str) -> NewTask:
    return NewTask.build(key=key, name="job", after=list(after))


def test_a_batch_may_name_stored_keys_and_earlier_items_only() -> None:
    """Upstreams earlier in the batch are marked dependents; a stored key is fine; a later
    item or an unknown key is an error naming both keys."""
    batch = [new("a"), new("b", "a", "old"), new("c", "b")]
    assert linking.outside(batch) == ["old"]
    marked = linking.linked(batch, {"old"})
    assert [t.dependents for t in marked] == [True, True, False]
    with pytest.raises(UnknownUpstream, match="'b' runs after 'old'"):
        linking.linked(batch, set())
    with pytest.raises(InvalidTask, match="comes later"):
        linking.linked([new("b", "a"), new("a")], set())


def test_after_drops_repeats_and_refuses_its_own_key() -> None:
    """A key named twice counts once; a task cannot run after itself."""
    assert new("d", "a", "b", "a").after == ["a", "b"]
    with pytest.raises(InvalidTask, match="itself"):
        new("d", "d")


def test_compensations_run_in_reverse_dependency_order() -> None:
    """Each compensation runs after its step and after the compensations of the succeeded
    compensated steps downstream of it, through steps that have none; upstreams come first
    in the publish call, and a failed or uncompensated step gets none."""
    undo = Compensation(name="undo")
    steps = [
        stored("a", compensate=undo),
        stored("b", after=["a"]),  # no compensation: the walk goes through it
        stored("c", after=["b"], compensate=undo),
        stored("d", after=["a"], compensate=undo),
        stored("e", "FAIL", after=["c", "d"], compensate=undo),
    ]
    items = saga.compensations("f", steps)
    assert [i["key"] for i in items] == ["d/undo", "c/undo", "a/undo"]
    by_key = {i["key"]: i for i in items}
    assert by_key["a/undo"]["after"] == ["a", "c/undo", "d/undo"]
    assert by_key["c/undo"]["after"] == ["c"] and by_key["c/undo"]["compensates"] == "c"
    assert all(i["on_upstream_failure"] == "run" and i["flow"] == "f" for i in items)


@pytest.mark.parametrize(
    ("steps", "undos", "state"),
    [
        ([("SUCCESS", False), ("SUCCESS", False)], [], FlowState.SUCCESS),
        ([("SUCCESS", False), ("WAITING", False)], [], FlowState.RUNNING),
        ([("FAIL", False), ("CANCELED", False)], [], FlowState.FAIL),
        ([("FAIL", False), ("RUNNING", False)], [], FlowState.RUNNING),
        ([("SUCCESS", True), ("FAIL", False)], [], FlowState.COMPENSATING),
        ([("SUCCESS", True), ("FAIL", False)], ["RUNNING"], FlowState.COMPENSATING),
        ([("SUCCESS", True), ("FAIL", False)], ["SUCCESS"], FlowState.COMPENSATED),
        ([("SUCCESS", True), ("FAIL", False)], ["FAIL"], FlowState.FAIL),
    ],
)
def test_a_flow_state_adds_up_its_steps(
    steps: list[tuple[str, bool]], undos: list[str], state: FlowState
) -> None:
    """SUCCESS when every step succeeded, RUNNING while one runs, COMPENSATING from a failure
    with something to undo until the compensations end, then COMPENSATED or FAIL."""
    tasks = [
        stored(f"s{i}", s, compensate=Compensation(name="u") if c else None) for i, (s, c) in enumerate(steps)
    ]
    compensations = [stored(f"u{i}", s, compensates="s0") for i, s in enumerate(undos)]
    assert flow_state(tasks, compensations) is state
    assert TaskState.WAITING.finished is False


def test_a_sync_runner_builds_publishes_and_reads_a_flow() -> None:
    """SyncTaskRunner.flow builds a flow that publish_flow publishes, blocking; get_flow reads it."""
    from taskrunner import MemoryStore

    with TaskRunner(store=MemoryStore()).sync() as runner:
        flow = runner.flow("s")
        first = flow.add("a")
        flow.add("b", after=first)
        published = runner.publish_flow(flow)
        assert [(t.key, t.state.value) for t in published] == [("s/a", "PENDING"), ("s/b", "WAITING")]
        assert runner.get_flow("s").state is FlowState.RUNNING
        with pytest.raises(ValueError, match="made by this"):
            runner.publish_flow(TaskRunner().flow("other"))


async def test_a_worker_reads_a_succeeded_upstream_once_and_others_fresh() -> None:
    """ctx.upstream's reads keep upstreams that succeeded (they never change) and read the
    others again each time, in after's order, without keys that do not exist."""
    from taskrunner import MemoryStore
    from taskrunner.workflows.upstream import Upstreams

    store = MemoryStore()
    runner = TaskRunner(store=store)
    await runner.publish_many([{"name": "job", "key": "ok"}, {"name": "job", "key": "later"}])
    claim = await store.claim("w", key="ok")
    assert claim is not None
    from taskrunner.store.base import RunWrite

    await store.write_runs([RunWrite("success", "ok", claim.run_id, "w", 1)])
    reads: list[list[str]] = []
    get_many = store.get_many

    async def counted(keys: Any) -> Any:
        reads.append(list(keys))
        return await get_many(keys)

    store.get_many = counted  # type: ignore[method-assign]
    upstreams = Upstreams(store)
    first = await upstreams.read(["later", "ok", "gone"])
    second = await upstreams.read(["ok", "later"])
    assert list(first) == ["later", "ok"] and list(second) == ["ok", "later"]
    assert second["ok"].state is TaskState.SUCCESS and second["later"].state is TaskState.PENDING
    assert reads == [["later", "ok", "gone"], ["later"]]
