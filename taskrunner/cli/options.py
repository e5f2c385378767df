"""What every command shares: the connection options (defined once), the error path and ``call``.

Every error ends in ``fail()``: one line on stderr naming the problem, exit code 1
(typer reports bad arguments with exit code 2; ``wait`` exits 3 when --within passes).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import warnings
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from taskrunner import fields as f
from taskrunner.cli.render import stderr
from taskrunner.errors import NoLiveWorkerWarning, TaskRunnerError
from taskrunner.models import parse_duration
from taskrunner.redact import redact
from taskrunner.runner import DEFAULT_URI, TaskRunner

T = TypeVar("T")

AppRef = Annotated[
    str | None, typer.Option("--app", envvar="TASKRUNNER_APP", help="MODULE:OBJECT of a TaskRunner.")
]


def fail(message: str) -> NoReturn:
    stderr().print(f"error: {redact(message)}", markup=False)
    raise typer.Exit(1)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion; a TaskRunnerError becomes ``fail``."""
    try:
        return asyncio.run(coro)
    except TaskRunnerError as exc:
        fail(str(exc))


@dataclass(frozen=True)
class Connection:
    """The connection options a command was given (None: the runner's default)."""

    mongo_uri: str | None = None
    database: str | None = None
    collection: str | None = None
    timeout: float = 5.0

    def runner(self, app_ref: str | None = None) -> TaskRunner:
        """The app's runner (its handlers and connection) or a bare one; options given win."""
        if app_ref is None:
            return TaskRunner(
                self.mongo_uri,
                database=self.database or f.DEFAULT_DATABASE,
                collection=self.collection or f.DEFAULT_COLLECTION,
                timeout=self.timeout,
            )
        from taskrunner.loader import load_app

        try:
            app_runner = load_app(app_ref)
        except TaskRunnerError as exc:
            fail(str(exc))
        return app_runner.copy(
            mongo_uri=self.mongo_uri, database=self.database, collection=self.collection, timeout=self.timeout
        )


def call(
    connection: Connection, action: Callable[[TaskRunner], Awaitable[T]], app_ref: str | None = None
) -> T:
    """Run one public TaskRunner coroutine on a runner for ``connection``, then close it.
    A ``NoLiveWorkerWarning`` it gives is printed as one ``warning:`` line on stderr."""
    runner = connection.runner(app_ref)

    async def once() -> T:
        try:
            return await action(runner)
        finally:
            await runner.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NoLiveWorkerWarning)
        try:
            return run(once())
        finally:
            _show(caught)


def _show(caught: list[warnings.WarningMessage]) -> None:
    for warning in caught:
        if issubclass(warning.category, NoLiveWorkerWarning):
            stderr().print(f"warning: {warning.message}", markup=False)
        else:  # any other warning as Python would have shown it
            warnings.showwarning(
                warning.message,
                warning.category,
                warning.filename,
                warning.lineno,
                warning.file,
                warning.line,
            )


MongoUri = Annotated[
    str | None,
    typer.Option("--mongo-uri", envvar="TASKRUNNER_MONGO_URI", help=f"MongoDB URI (default {DEFAULT_URI})."),
]
Database = Annotated[
    str | None, typer.Option(envvar="TASKRUNNER_DATABASE", help=f"Database (default {f.DEFAULT_DATABASE}).")
]
Collection = Annotated[
    str | None,
    typer.Option(envvar="TASKRUNNER_COLLECTION", help=f"Task collection (default {f.DEFAULT_COLLECTION})."),
]
Timeout = Annotated[float, typer.Option(envvar="TASKRUNNER_TIMEOUT", help="Seconds to wait for the server.")]


def _connection_parameters(timeout: float) -> list[inspect.Parameter]:
    """``--mongo-uri``, ``--database``, ``--collection``, ``--timeout`` as keyword parameters."""
    options = {
        "mongo_uri": (MongoUri, None),
        "database": (Database, None),
        "collection": (Collection, None),
        "timeout": (Timeout, timeout),
    }
    keyword = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter(name, keyword, default=default, annotation=kind)
        for name, (kind, default) in options.items()
    ]


def connected(timeout: float = 5.0) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Give a command the connection options; it receives them as its ``connection`` argument.

    The options (``--mongo-uri``, ``--database``, ``--collection``, ``--timeout`` and their
    TASKRUNNER_* variables) are defined here once and appended to the command's own.
    """

    def decorate(command: Callable[..., T]) -> Callable[..., T]:
        signature = inspect.signature(command, eval_str=True)
        own = [p for name, p in signature.parameters.items() if name != "connection"]

        @functools.wraps(command)
        def with_connection(*args: Any, **kwargs: Any) -> T:
            given = {name: kwargs.pop(name) for name in ("mongo_uri", "database", "collection", "timeout")}
            return command(*args, connection=Connection(**given), **kwargs)

        with_connection.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*own, *_connection_parameters(timeout)]
        )
        with_connection.__annotations__ = {}
        return with_connection

    return decorate


def seconds(text: str) -> float:
    """A duration option ('90', '30s', '15m', '12h', '7d', '2w') in seconds."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
