"""The app the worker process tests run: handlers that record every start and finish.

Each handler appends JSON lines to ``$ACCEPTANCE_MARKS/<worker_id>.jsonl`` (one file
per worker process, appends of one short line each), so a test counts executions
exactly instead of trusting task states. Events: ``start``, ``finish``, ``cancelled``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from taskrunner import Fail, RateLimited, Retry, TaskContext, TaskRunner

runner = TaskRunner()


def mark(event: str, ctx: TaskContext, **extra: Any) -> None:
    """Append one line recording ``event`` for this run (a no-op without ACCEPTANCE_MARKS)."""
    where = os.environ.get("ACCEPTANCE_MARKS")
    if not where:
        return
    line = {
        "event": event,
        "key": ctx.key,
        "run_id": ctx.run_id,
        "attempt": ctx.attempt,
        "worker_id": ctx.worker_id,
        "t": time.time(),
        **extra,
    }
    with (Path(where) / f"{ctx.worker_id}.jsonl").open("a") as out:
        out.write(json.dumps(line) + "\n")


def marks_of(key: str) -> list[dict[str, Any]]:
    """Every mark recorded for ``key`` by any worker process."""
    where = os.environ.get("ACCEPTANCE_MARKS")
    lines = (
        [line for path in Path(where).glob("*.jsonl") for line in path.read_text().splitlines()]
        if where
        else []
    )
    return [m for m in map(json.loads, (line for line in lines if line.endswith("}"))) if m["key"] == key]


@runner.task("quick")
async def quick(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    mark("start", ctx)
    mark("finish", ctx)
    return {"worker_id": ctx.worker_id, "run_id": ctx.run_id}


class SleepParams(BaseModel):
    seconds: float
    first_seconds: float | None = None
    """How long the task's first attempt sleeps (``seconds`` when absent)."""
    first_gate: str | None = None
    """A file the first attempt waits for before its sleep (a test creates it when ready)."""


@runner.task("sleep")
async def sleep(params: SleepParams, ctx: TaskContext) -> dict[str, Any]:
    """Sleep (cancellably); records a ``cancelled`` mark with ``ctx.cancelled`` when stopped."""
    mark("start", ctx)
    first = ctx.attempt == 1
    seconds = params.first_seconds if first and params.first_seconds is not None else params.seconds
    try:
        while first and params.first_gate and not await asyncio.to_thread(os.path.exists, params.first_gate):
            await asyncio.sleep(0.05)
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        mark("cancelled", ctx, ctx_cancelled=ctx.cancelled)
        raise
    mark("finish", ctx)
    return {"worker_id": ctx.worker_id, "run_id": ctx.run_id}


class FlakyParams(BaseModel):
    failures: int
    """How many calls (over all runs and workers) raise before one succeeds."""


@runner.task("flaky")
async def flaky(params: FlakyParams, ctx: TaskContext) -> dict[str, Any]:
    mark("start", ctx)
    calls = sum(m["event"] == "start" for m in marks_of(ctx.key))
    if calls <= params.failures:
        raise RuntimeError(f"flaky call {calls} of {params.failures} failing")
    mark("finish", ctx)
    return {"calls": calls}


@runner.task("always_fails")
async def always_fails(params: dict[str, Any], ctx: TaskContext) -> None:
    mark("start", ctx)
    raise RuntimeError(f"boom from {ctx.worker_id}")


@runner.task("fails_fast")
async def fails_fast(params: dict[str, Any], ctx: TaskContext) -> None:
    mark("start", ctx)
    raise Fail("gave up on purpose")


class TypedParams(BaseModel):
    count: int


@runner.task("typed")
async def typed(params: TypedParams, ctx: TaskContext) -> int:
    mark("start", ctx)
    return params.count


@runner.task("unstorable")
async def unstorable(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    mark("start", ctx)
    return {"value": object()}


@runner.task("interrupt")
async def interrupt(params: dict[str, Any], ctx: TaskContext) -> None:
    mark("start", ctx)
    raise KeyboardInterrupt


@runner.task("interrupt_sync")
def interrupt_sync(params: dict[str, Any], ctx: TaskContext) -> None:
    mark("start", ctx)
    raise KeyboardInterrupt


class SnoozeParams(BaseModel):
    times: int
    """How many calls snooze (``ctx.snooze(seconds)``) before one succeeds."""
    seconds: float


@runner.task("snoozes")
def snoozes(params: SnoozeParams, ctx: TaskContext) -> dict[str, Any]:
    """A sync handler: ``ctx.snooze`` raises from its thread as from a coroutine."""
    mark("start", ctx)
    calls = sum(m["event"] == "start" for m in marks_of(ctx.key))
    if calls <= params.times:
        ctx.snooze(params.seconds)
    return {"calls": calls}


@runner.task("retry_later")
async def retry_later(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Asks to be retried once, after ``params["delay"]`` seconds, by raising ``Retry``."""
    mark("start", ctx)
    if sum(m["event"] == "start" for m in marks_of(ctx.key)) == 1:
        raise Retry(delay=params["delay"])
    return {"attempt": ctx.attempt}


@runner.task("calls_api")
async def calls_api(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """The first call of the key ``params["limited_key"]`` is told "slow down" by the remote API."""
    mark("start", ctx)
    if ctx.key == params.get("limited_key") and len(marks_of(ctx.key)) == 1:
        raise RateLimited(retry_after=params["retry_after"])
    return {"attempt": ctx.attempt}


@runner.task("metered", rate_limit="4/s")
async def metered(params: dict[str, Any], ctx: TaskContext) -> None:
    """At most 4 starts per second across the fleet (fleet-wide rate limit)."""


class ExclusiveParams(BaseModel):
    seconds: float = 0.3


@runner.task("exclusive", max_running=2)
async def exclusive(params: ExclusiveParams, ctx: TaskContext) -> None:
    """At most 2 runs at once across the fleet."""
    await asyncio.sleep(params.seconds)


class TenantParams(BaseModel):
    tenant: str
    throttle: float = 0.0


@runner.task("per_tenant", rate_limit="2/s", limit_by="tenant")
async def per_tenant(params: TenantParams, ctx: TaskContext) -> None:
    """2 starts per second per tenant; a task with ``throttle`` set says "slow down" once."""
    mark("start", ctx)
    if params.throttle and len(marks_of(ctx.key)) == 1:
        raise RateLimited(retry_after=params.throttle)
