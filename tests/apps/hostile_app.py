"""A worker app whose tasks carry markup: the dashboard must render all of it as text.

``echo`` returns its params as the result; ``explode`` fails with its params' ``text`` as the
error message (and so in the traceback too).
"""

from __future__ import annotations

from typing import Any

from taskrunner import TaskContext, TaskRunner

runner = TaskRunner()


@runner.task("echo")
async def echo(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    return params


@runner.task("explode")
async def explode(params: dict[str, Any], ctx: TaskContext) -> None:
    raise RuntimeError(str(params.get("text")))
