"""The app the workflow process tests (tests/faults/test_workflow_processes.py) run in workers.

Handlers record ``start``/``finish``/``cancelled`` marks like tests/apps/acceptance_app.py
(``$ACCEPTANCE_MARKS/<worker_id>.jsonl``, one line per event with the run's ``run_id``), so a
test counts executions from a record the handlers write, besides the task documents.

``WORKFLOW_EXIT_AFTER_OUTCOME`` (a task key) is a fault hook: the worker process exits
(``os._exit(EXIT_AFTER_OUTCOME)``) as soon as the outcome of that task's run has been
written, before the worker does the follow-up its dependents are owed, the way a worker
SIGKILLed in that window would.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import taskrunner.workflows.follower
from apps.acceptance_app import mark
from taskrunner import Fail, TaskContext, TaskRunner, TaskState

EXIT_AFTER_OUTCOME = 86
"""The exit code of a worker process the fault hook stopped."""

runner = TaskRunner()


class StepParams(BaseModel):
    seconds: float = 0.0
    touch: str | None = None
    """A file the run creates as it starts (another step's ``gate``)."""
    gate: str | None = None
    """A file the run waits for before its sleep (a test creates it when ready)."""
    fail_without: str | None = None
    """A file without which the run ends with ``Fail`` (a test creates it to fix the step)."""


@runner.task("step")
async def step(params: StepParams, ctx: TaskContext) -> dict[str, Any]:
    """Create ``touch``, wait for the gate, sleep (cancellably), fail while ``fail_without``
    is missing; the result names the run."""
    mark("start", ctx, upstream={k: t.state.value for k, t in ctx.upstream.items()})
    if params.touch:
        await asyncio.to_thread(Path(params.touch).touch)
    try:
        while params.gate and not await asyncio.to_thread(os.path.exists, params.gate):
            await asyncio.sleep(0.05)
        await asyncio.sleep(params.seconds)
    except asyncio.CancelledError:
        mark("cancelled", ctx)
        raise
    if params.fail_without and not await asyncio.to_thread(os.path.exists, params.fail_without):
        mark("failed", ctx)
        raise Fail(f"{params.fail_without} is missing")
    mark("finish", ctx)
    return {"key": ctx.key, "run_id": ctx.run_id}


class FanInParams(BaseModel):
    expect: list[str]
    """The upstream keys the step must be handed, each SUCCESS with a result."""


@runner.task("fan_in")
async def fan_in(params: FanInParams, ctx: TaskContext) -> dict[str, Any]:
    """Check ``ctx.upstream`` holds every expected upstream, SUCCESS, with its result
    (``Fail`` otherwise); the result is what it read, by key."""
    mark("start", ctx, upstream={k: t.state.value for k, t in ctx.upstream.items()})
    seen = {k: (t.state, t.results) for k, t in ctx.upstream.items()}
    if sorted(seen) != sorted(params.expect):
        raise Fail(f"ctx.upstream has {sorted(seen)}, expected {sorted(params.expect)}")
    if any(state is not TaskState.SUCCESS or len(results) != 1 for state, results in seen.values()):
        raise Fail(f"an upstream is not SUCCESS with one result: {seen}")
    mark("finish", ctx)
    return {"inputs": {k: results[0] for k, (_, results) in seen.items()}}


class UndoParams(BaseModel):
    seconds: float = 0.0


@runner.task("undo")
async def undo(params: UndoParams, ctx: TaskContext) -> dict[str, Any]:
    """A compensation: sleeps a little; its result names the step it was handed."""
    mark("start", ctx, upstream={k: t.state.value for k, t in ctx.upstream.items()})
    await asyncio.sleep(params.seconds)
    mark("finish", ctx)
    return {"undid": sorted(ctx.upstream)}


def _exit_after_outcome(doomed: str) -> None:
    """Patch the worker's follow-up trigger, called once the outcome of a run of a task
    others wait on has been written: for ``doomed``, the process ends there."""
    owed = taskrunner.workflows.follower.Follower.owed

    def owed_or_exit(
        self: taskrunner.workflows.follower.Follower, key: str, done: Callable[[], None] | None = None
    ) -> None:
        if key == doomed:
            os._exit(EXIT_AFTER_OUTCOME)
        owed(self, key, done)

    taskrunner.workflows.follower.Follower.owed = owed_or_exit  # type: ignore[method-assign]


if _exit_key := os.environ.get("WORKFLOW_EXIT_AFTER_OUTCOME"):
    _exit_after_outcome(_exit_key)
