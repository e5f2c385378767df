"""The handlers `taskrunner demo` runs; its workers load ``taskrunner.dev.demo_app:runner``.

It lives inside the package (not under examples/) so a worker process finds it from
any working directory.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from taskrunner import TaskContext, TaskRunner

runner = TaskRunner()  # mongo URI from $TASKRUNNER_MONGO_URI, which the demo sets


class SleepParams(BaseModel):
    seconds: float = Field(1.0, ge=0, le=60)


class SleepResult(BaseModel):
    slept: float
    worker: str


@runner.task("sleep")
async def sleep(params: SleepParams, ctx: TaskContext) -> SleepResult:
    """Stands in for real work: slow enough to be killed mid-run, or quick."""
    await asyncio.sleep(params.seconds)
    return SleepResult(slept=params.seconds, worker=ctx.worker_id)


@runner.task("flaky")
async def flaky(params: SleepParams, ctx: TaskContext) -> SleepResult:
    """Fails its first attempt, so the demo shows a recorded failure and a retry."""
    await asyncio.sleep(params.seconds)
    if ctx.attempt == 1:
        raise RuntimeError("simulated failure on attempt 1")
    return SleepResult(slept=params.seconds, worker=ctx.worker_id)
