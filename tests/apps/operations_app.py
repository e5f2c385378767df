"""The operations tests' app: the acceptance handlers plus ones reporting progress, one
gated by a file, and one publishing a follow-up task.

Marks go where tests/apps/acceptance_app.py puts them (``$ACCEPTANCE_MARKS``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from apps.acceptance_app import mark, runner
from taskrunner import Fail, TaskContext

__all__ = ["runner"]


class ProgressParams(BaseModel):
    seconds: float
    fraction: float = 0.25
    message: str = "quarter done"


@runner.task("progress_sleep")
async def progress_sleep(params: ProgressParams, ctx: TaskContext) -> dict[str, Any]:
    """Report progress, then sleep (cancellably; a ``cancelled`` mark records ``ctx.cancelled``)."""
    mark("start", ctx)
    await ctx.progress(params.fraction, params.message)
    try:
        await asyncio.sleep(params.seconds)
    except asyncio.CancelledError:
        mark("cancelled", ctx, ctx_cancelled=ctx.cancelled)
        raise
    mark("finish", ctx)
    return {"slept": params.seconds}


class StepParams(BaseModel):
    steps: int
    pause: float = 0.0
    """Seconds to work after the first step (so renewals carry its progress meanwhile)."""
    fail: bool = False


@runner.task("progress_steps", max_failures=1)
async def progress_steps(params: StepParams, ctx: TaskContext) -> int:
    """Report progress at each step, the later ones at once, then return (or fail)."""
    for step in range(1, params.steps + 1):
        await ctx.progress(step / params.steps, f"step {step}")
        if step == 1:
            await asyncio.sleep(params.pause)
    if params.fail:
        raise Fail(f"failed after step {params.steps}")
    return params.steps


class GateParams(BaseModel):
    broken_while: str
    """Path of a marker file: the handler fails while it exists."""


@runner.task("gated")
def gated(params: GateParams, ctx: TaskContext) -> str:
    mark("start", ctx)
    if Path(params.broken_while).exists():
        raise RuntimeError(f"broken while {params.broken_while} exists")
    mark("finish", ctx)
    return "repaired"


@runner.task("follow_up")
async def follow_up(params: dict[str, Any], ctx: TaskContext) -> str:
    """Publish a ``quick`` task keyed ``<key>:next`` through the runner running this one."""
    mark("start", ctx)
    task = await ctx.runner.publish("quick", key=f"{ctx.key}:next")
    mark("finish", ctx)
    return task.key
