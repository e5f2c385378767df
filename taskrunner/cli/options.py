"""What every command shares: the connection options (defined once), the error path and ``call``.

Every error ends in ``fail()``: one line on stderr naming the problem, exit code 1
(typer reports bad arguments with exit code 2; ``wait`` exits 3 when --within passes).

Command modules import at module level only what ``--help`` needs (typer and the option
types); the engine, pydantic, pymongo and rich are imported inside the commands that use
them, so every command starts at the cost of the libraries it needs (bench/cli_startup.py,
tests/processes/test_cli_startup.py).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from taskrunner.errors import NoLiveWorkerWarning, TaskRunnerError
from taskrunner.store import fields as f

if TYPE_CHECKING:
    from taskrunner.runner import TaskRunner

T = TypeVar("T")

AppRef = Annotated[
    str | None,
    typer.Option(
        "--app",
        envvar="TASKRUNNER_APP",
        metavar="MODULE:OBJECT",
        help="Your TaskRunner (the current directory first on sys.path): its handlers' models check "
        "params, and its connection settings apply where no option gives them.",
    ),
]


def fail(message: str) -> NoReturn:
    from taskrunner.cli.render import stderr
    from taskrunner.observability.redact import redact

    stderr().print(f"error: {redact(message)}", markup=False)
    raise typer.Exit(1)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion; a TaskRunnerError becomes ``fail``."""
    import asyncio

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
        from taskrunner.runner import TaskRunner

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
    from taskrunner.cli.render import stderr

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


CONNECTION = "Connection (or TASKRUNNER_* variables)"
MongoUri = Annotated[
    str | None,
    typer.Option(
        "--mongo-uri",
        envvar="TASKRUNNER_MONGO_URI",
        metavar="URI",
        rich_help_panel=CONNECTION,
        help=f"MongoDB URI (default {f.DEFAULT_URI}).",
    ),
]
Database = Annotated[
    str | None,
    typer.Option(
        envvar="TASKRUNNER_DATABASE",
        metavar="NAME",
        rich_help_panel=CONNECTION,
        help=f"Database (default {f.DEFAULT_DATABASE}).",
    ),
]
Collection = Annotated[
    str | None,
    typer.Option(
        envvar="TASKRUNNER_COLLECTION",
        metavar="NAME",
        rich_help_panel=CONNECTION,
        help=f"Task collection (default {f.DEFAULT_COLLECTION}).",
    ),
]


def _timeout_option(default: float) -> Any:
    return Annotated[
        float,
        typer.Option(
            envvar="TASKRUNNER_TIMEOUT",
            parser=seconds,
            metavar="DURATION",
            rich_help_panel=CONNECTION,
            help="How long to wait for the MongoDB server to answer; not a task's time limit.",
        ),
    ]


def _connection_parameters(timeout: float) -> list[inspect.Parameter]:
    """``--mongo-uri``, ``--database``, ``--collection``, ``--timeout`` as keyword parameters."""
    options = {
        "mongo_uri": (MongoUri, None),
        "database": (Database, None),
        "collection": (Collection, None),
        "timeout": (_timeout_option(timeout), timeout),
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


def seconds(text: str | float) -> float:
    """A duration option ('90', '1.5', '30s', '15m', '12h', '7d', '2w') in seconds.

    click passes a default through the option's parser too: a number is already seconds.
    """
    if isinstance(text, int | float):
        return float(text)
    from taskrunner.models import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
