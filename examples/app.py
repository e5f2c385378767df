"""An example app: the handlers a `taskrunner worker --app examples.app:runner` runs."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from taskrunner import TaskContext, TaskRunner

runner = TaskRunner()  # mongo URI from $TASKRUNNER_MONGO_URI


class ResizeParams(BaseModel):
    image: str
    width: int
    height: int


@runner.task("resize", max_failures=3)
async def resize(params: ResizeParams, ctx: TaskContext) -> dict[str, object]:
    ctx.logger.info("resizing", image=params.image)
    await asyncio.sleep(0.5)  # stands in for real work
    return {"image": params.image, "size": [params.width, params.height]}


@runner.task("sleep")
async def sleep(params: dict[str, float], ctx: TaskContext) -> float:
    await asyncio.sleep(params.get("seconds", 1.0))
    return params.get("seconds", 1.0)
