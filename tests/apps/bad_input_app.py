"""The bad-input catalogue's app: the acceptance handlers plus handlers that misbehave on request.

Marks go where tests/apps/acceptance_app.py puts them (``$ACCEPTANCE_MARKS``).
"""

from __future__ import annotations

from typing import Any

from apps.acceptance_app import mark, runner
from taskrunner import TaskContext

__all__ = ["runner"]


class CustomBaseError(BaseException):
    """A BaseException subclass that is neither KeyboardInterrupt nor SystemExit."""


class Opaque:
    """A custom object BSON cannot encode."""


RESULTS: dict[str, Any] = {
    "set": {1, 2, 3},
    "object": Opaque(),
    "huge": "x" * (17 * 1024 * 1024),  # more than a 16 MiB document holds
}
RAISES: dict[str, BaseException] = {
    "KeyboardInterrupt": KeyboardInterrupt(),
    "SystemExit": SystemExit(3),
    "CustomBaseError": CustomBaseError("custom base exception"),
    "GeneratorExit": GeneratorExit(),
}


@runner.task("echo")
async def echo(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Return the params as stored (round trips of odd keys and values)."""
    mark("start", ctx)
    return params


@runner.task("returns")
async def returns(params: dict[str, Any], ctx: TaskContext) -> Any:
    """Return the unstorable value named by ``params["kind"]``."""
    mark("start", ctx)
    return RESULTS[params["kind"]]


@runner.task("raises")
async def raises(params: dict[str, Any], ctx: TaskContext) -> None:
    """Raise the BaseException named by ``params["kind"]`` on the event loop."""
    mark("start", ctx)
    raise RAISES[params["kind"]]


@runner.task("raises_sync")
def raises_sync(params: dict[str, Any], ctx: TaskContext) -> None:
    """Raise the BaseException named by ``params["kind"]`` in the worker's thread pool."""
    mark("start", ctx)
    raise RAISES[params["kind"]]
