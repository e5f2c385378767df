"""The app the crash tests (tests/faults/test_crashes.py) run in worker processes.

Handlers record ``start``/``finish``/``cancelled`` marks like tests/apps/acceptance_app.py
(``$ACCEPTANCE_MARKS/<worker_id>.jsonl``). ``FAULTS_CLOCK_SKEW`` (seconds) shifts this
process's ``time.time`` at import, the way a badly set machine clock would (``faketime``
is not available): ``taskrunner.engine.worker.time`` is the ``time`` module, so the worker's
clock estimate and everything else that reads wall time in the process is off by it.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from pydantic import BaseModel

import taskrunner.engine.worker
from apps.acceptance_app import mark
from taskrunner import TaskContext, TaskRunner

SKEW = float(os.environ.get("FAULTS_CLOCK_SKEW", "0"))
_real_time = time.time


def _skewed_time() -> float:
    return _real_time() + SKEW


if SKEW:
    assert vars(taskrunner.engine.worker)["time"] is time  # the worker reads this very function
    time.time = _skewed_time

runner = TaskRunner()


class SleepParams(BaseModel):
    seconds: float = 0.2
    first_seconds: float | None = None
    """How long the task's first attempt sleeps (``seconds`` when absent)."""


@runner.task("nap")
async def nap(params: SleepParams, ctx: TaskContext) -> dict[str, Any]:
    """Sleep (cancellably), marking start, then finish or cancelled."""
    mark("start", ctx)
    seconds = (
        params.first_seconds if ctx.attempt == 1 and params.first_seconds is not None else params.seconds
    )
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        mark("cancelled", ctx, ctx_cancelled=ctx.cancelled)
        raise
    mark("finish", ctx)
    return {"worker_id": ctx.worker_id, "run_id": ctx.run_id}


@runner.task("crash")
async def crash(params: dict[str, Any], ctx: TaskContext) -> None:
    """A poison task: takes the whole worker process down."""
    mark("start", ctx)
    os._exit(1)


@runner.task("hang")
async def hang(params: dict[str, Any], ctx: TaskContext) -> None:
    """Never returns on its own; only a timeout (or a stop) ends it."""
    mark("start", ctx)
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        mark("cancelled", ctx)
        raise
