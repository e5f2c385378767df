"""The app the fleet-wide limits fault tests (tests/faults/test_limits_faults.py) run in
worker processes: limited names whose handlers sleep, marking ``start``, then ``finish``
or ``cancelled``, like tests/apps/acceptance_app.py (``$ACCEPTANCE_MARKS/<worker_id>.jsonl``).
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from apps.acceptance_app import mark
from taskrunner import TaskContext, TaskRunner

runner = TaskRunner()


class Work(BaseModel):
    seconds: float = 0.2
    tenant: str = ""


async def work(params: Work, ctx: TaskContext) -> None:
    mark("start", ctx)
    try:
        await asyncio.sleep(params.seconds)
    except asyncio.CancelledError:
        mark("cancelled", ctx, ctx_cancelled=ctx.cancelled)
        raise
    mark("finish", ctx)


@runner.task("capped", max_running=2)
async def capped(params: Work, ctx: TaskContext) -> None:
    """At most 2 runs at once across the fleet."""
    await work(params, ctx)


@runner.task("paced", rate_limit="5/s")
async def paced(params: Work, ctx: TaskContext) -> None:
    """At most 5 starts in any second across the fleet."""
    await work(params, ctx)


@runner.task("tenant", rate_limit="2/s", max_running=1, limit_by="tenant")
async def tenant(params: Work, ctx: TaskContext) -> None:
    """Per tenant: at most 2 starts in any second and 1 run at once."""
    await work(params, ctx)
