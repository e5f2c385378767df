"""Compensation (a saga, TaskFlow's revert): a failed step undoes its flow's finished steps.

When a step of a flow with compensations ends FAIL, the flow stops: its steps no worker
started are canceled (``FlowFailed``). Once none of its steps runs any more, the
compensation of each step that succeeded is published, in one call and under a key derived
from the step's (``<step key>/undo``), so racing workers publish each once. Compensations
run in reverse dependency order: one runs after the compensations of the succeeded steps
that ran after its step, and after its step itself, so ``ctx.upstream`` hands it the
step's result. They run whatever the others' outcomes (``on_upstream_failure="run"``):
undoing goes as far as it can.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from taskrunner.models import Task, TaskError, TaskState
from taskrunner.store import fields as f
from taskrunner.store import rules
from taskrunner.store.base import FlowStore
from taskrunner.workflows.model import is_saga

UNDO_SUFFIX = "/undo"
PublishMany = Callable[[Sequence[Mapping[str, Any]]], Awaitable[object]]
"""Publishes compensation tasks (``TaskClient.publish_many`` for any task name)."""


def undo_key(step: str) -> str:
    """The key of the compensation of ``step``."""
    return f"{step}{UNDO_SUFFIX}"


async def check(store: FlowStore, flow: str, publish: PublishMany) -> None:
    """Stop ``flow`` and publish its compensations if one of its steps failed (see module)."""
    if not await store.count_flow(flow, [TaskState.FAIL]):
        return
    tasks = await store.flow_tasks(flow)
    steps = [t for t in tasks if t.compensates is None]
    if not is_saga(steps):
        return
    failed = next(t.key for t in steps if t.state is TaskState.FAIL)
    error = TaskError.model_validate(rules.flow_error(flow, failed))
    if await store.stop_flow(flow, error):
        steps = [t for t in await store.flow_tasks(flow) if t.compensates is None]
    if any(not t.state.finished for t in steps):
        return  # a step still runs: its end checks again
    undo = compensations(flow, steps)
    if undo:
        await publish(undo)


def compensations(flow: str, steps: Sequence[Task]) -> list[dict[str, Any]]:
    """The compensation tasks of a stopped flow's succeeded steps, each after its step and
    after the compensations of the succeeded steps downstream of it, upstreams first."""
    done = {t.key: t for t in steps if t.state is TaskState.SUCCESS and t.compensate is not None}
    below = _downstream(steps)
    order = [t.key for t in steps if t.key in done]  # publish order: the steps' own order
    items: list[dict[str, Any]] = []
    for key in reversed(order):  # a compensation's upstreams come earlier in the call
        compensate = done[key].compensate
        assert compensate is not None
        later = [undo_key(d) for d in order if d in below[key]]
        items.append(
            {
                "name": compensate.name,
                "params": compensate.params,
                "key": undo_key(key),
                "after": [key, *later],
                "on_upstream_failure": rules.RUN_ANYWAY,
                f.FLOW: flow,
                f.COMPENSATES: key,
            }
        )
    return items


def _downstream(steps: Sequence[Task]) -> dict[str, set[str]]:
    """Each step's transitive dependents within the flow."""
    children: dict[str, list[str]] = {t.key: [] for t in steps}
    for t in steps:
        for up in t.after:
            if up in children:
                children[up].append(t.key)
    reach: dict[str, set[str]] = {}

    def visit(key: str) -> set[str]:
        if key not in reach:
            reach[key] = set()  # a cycle cannot be built; this only guards the walk
            for child in children.get(key, []):
                reach[key] |= {child, *visit(child)}
        return reach[key]

    for key in children:
        visit(key)
    return reach
