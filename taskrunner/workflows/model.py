"""A flow as read back: its steps, its compensations and the state they add up to."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict

from taskrunner.models import Task, TaskState


class FlowState(enum.StrEnum):
    """What a flow's tasks add up to (``FlowView.state``)."""

    RUNNING = "RUNNING"
    """Some step has yet to finish, and none failed in a flow with compensations."""
    SUCCESS = "SUCCESS"
    """Every step succeeded."""
    FAIL = "FAIL"
    """Every step finished, not all succeeded, and there is nothing to undo."""
    COMPENSATING = "COMPENSATING"
    """A step of a flow with compensations failed: its steps that had not started were
    canceled, and the compensations of its succeeded steps run (or will, once nothing runs)."""
    COMPENSATED = "COMPENSATED"
    """Every compensation succeeded."""


class FlowView(BaseModel):
    """A flow as stored now: its id, state, steps (in publish order) and compensations."""

    model_config = ConfigDict(frozen=True)

    id: str
    state: FlowState
    steps: list[Task]
    compensations: list[Task]

    @classmethod
    def of(cls, flow: str, tasks: list[Task]) -> FlowView:
        steps = [t for t in tasks if t.compensates is None]
        compensations = [t for t in tasks if t.compensates is not None]
        return cls(id=flow, state=flow_state(steps, compensations), steps=steps, compensations=compensations)

    def step(self, key: str) -> Task:
        """The step (or compensation) of ``key``; ``KeyError`` if the flow has none."""
        for task in (*self.steps, *self.compensations):
            if task.key == key:
                return task
        raise KeyError(key)


def flow_state(steps: list[Task], compensations: list[Task]) -> FlowState:
    """The state a flow's steps and compensations add up to (``FlowState``)."""
    if compensations:
        if any(not c.state.finished for c in compensations):
            return FlowState.COMPENSATING
        return (
            FlowState.COMPENSATED
            if all(c.state is TaskState.SUCCESS for c in compensations)
            else FlowState.FAIL
        )
    if all(s.state is TaskState.SUCCESS for s in steps):
        return FlowState.SUCCESS
    failed = any(s.state is TaskState.FAIL for s in steps)
    to_undo = any(s.compensate is not None and s.state is TaskState.SUCCESS for s in steps)
    if failed and to_undo:
        return FlowState.COMPENSATING  # the compensations are published once nothing runs
    if any(not s.state.finished for s in steps):
        return FlowState.RUNNING
    return FlowState.FAIL


def is_saga(steps: list[Task]) -> bool:
    """A flow with compensations: a failed step stops it and undoes what succeeded."""
    return any(s.compensate is not None for s in steps)
