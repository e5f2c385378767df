"""Pytest fixtures and helpers for testing code that uses taskrunner.

Enable the fixtures in your ``conftest.py``::

    pytest_plugins = ["taskrunner.testing"]

They are opt-in (no ``pytest11`` entry point), so installing taskrunner never adds fixture
names to a project that did not ask for them. Async fixtures need pytest-asyncio
(``pip install 'taskrunner[testing]'``); the embedded server needs the ``embedded`` extra.

Fixtures:

* ``memory_runner``: a factory, ``memory_runner(app_runner)``, giving a copy of your runner
  (same handlers and schedules) on a fresh :class:`~taskrunner.MemoryStore`.
* ``mongo_runner``: the same on a fresh collection of ``mongo_uri``, indexes created.
* ``embedded_uri`` (session): the URI of an embedded MongoDB-compatible server started for
  the session; the tests that use it are skipped when mongoeco is not installed.
* ``mongo_uri`` (session): ``$TASKRUNNER_TEST_MONGO_URI`` when set (a real MongoDB), else
  ``embedded_uri``.
* ``collection_name``: a fresh collection name per test.

Helpers: :func:`wait_for` polls a condition; :func:`make_context` builds the ``TaskContext``
to call a handler directly; :class:`ManualClock` is a server clock for
``MemoryStore(clock=...)`` (or ``memory_runner(app, clock=...)``) that moves only when a
test moves it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, Protocol, TypeVar, overload
from uuid import uuid4

import pytest
import pytest_asyncio

from taskrunner.context import TaskContext
from taskrunner.models import Task, to_utc
from taskrunner.runner import TaskRunner
from taskrunner.store.memory import MemoryStore

__all__ = [
    "ManualClock",
    "MemoryRunnerFactory",
    "MongoRunnerFactory",
    "collection_name",
    "embedded_uri",
    "make_context",
    "memory_runner",
    "mongo_runner",
    "mongo_uri",
    "wait_for",
]

T = TypeVar("T")
TEST_MONGO_URI = "TASKRUNNER_TEST_MONGO_URI"
NO_EMBEDDED = (
    "the embedded server needs Python >= 3.13 and mongoeco: pip install 'taskrunner[embedded]'"
    f" (or set {TEST_MONGO_URI} to a MongoDB replica set)"
)


# -- helpers ----------------------------------------------------------------------------------
@overload
async def wait_for(
    predicate: Callable[[], Awaitable[T | None]],
    within: float = 20.0,
    what: str = "the condition",
    *,
    interval: float = 0.05,
) -> T: ...


@overload
async def wait_for(
    predicate: Callable[[], T | None],
    within: float = 20.0,
    what: str = "the condition",
    *,
    interval: float = 0.05,
) -> T: ...


async def wait_for(
    predicate: Callable[[], Any],
    within: float = 20.0,
    what: str = "the condition",
    *,
    interval: float = 0.05,
) -> Any:
    """Call ``predicate`` (sync or async) every ``interval`` seconds until it returns something
    truthy, and return that; raise ``AssertionError`` naming ``what`` after ``within`` seconds.

    Give ``within`` room: it is how long a slow, busy machine may take, not how long it should.
    """
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)


class ManualClock:
    """A server clock that stands still until ``advance`` moves it: ``MemoryStore(clock=clock)``.

    Leases, backoffs, delays and worker registrations then expire when the test says so,
    not after real sleeps that a busy machine stretches.
    """

    def __init__(self, start: datetime | None = None) -> None:
        now = to_utc(start or datetime.now(UTC))
        assert isinstance(now, datetime)
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float | timedelta) -> datetime:
        """Move the clock forward (MongoDB dates keep milliseconds) and return the new time."""
        step = seconds if isinstance(seconds, timedelta) else timedelta(seconds=seconds)
        moved = to_utc(self.now + step)
        assert isinstance(moved, datetime)
        self.now = moved
        return moved


def make_context(
    params: Any = None,
    *,
    key: str = "test",
    attempt: int = 1,
    worker_id: str = "test-worker",
    runner: TaskRunner | None = None,
    upstream: Mapping[str, Task] | None = None,
) -> TaskContext:
    """A ``TaskContext`` for calling a handler directly, as a worker would on that attempt.

    ``ctx.runner`` is ``runner`` (e.g. a ``memory_runner(app)``), else a runner of its own
    on a fresh ``MemoryStore``: what the handler publishes through it stays in memory,
    readable as ``await ctx.runner.get(key)``. ``upstream`` is ``ctx.upstream`` (the tasks
    a workflow step runs after, by key; e.g. read with ``await runner.get(key)``)."""
    return TaskContext(
        key=key,
        run_id=uuid4().hex,
        attempt=attempt,
        worker_id=worker_id,
        params=params,
        runner=runner if runner is not None else TaskRunner(store=MemoryStore()),
        upstream=MappingProxyType(dict(upstream or {})),
    )


class MemoryRunnerFactory(Protocol):
    """``memory_runner(runner=None, *, clock=None)``: the fixture's factory."""

    def __call__(
        self, runner: TaskRunner | None = None, *, clock: Callable[[], datetime] | None = None
    ) -> TaskRunner:
        """A copy of ``runner``'s handlers (none when omitted) on a fresh memory store."""
        ...


class MongoRunnerFactory(Protocol):
    """``await mongo_runner(runner=None)``: the fixture's factory."""

    def __call__(self, runner: TaskRunner | None = None) -> Awaitable[TaskRunner]:
        """A copy of ``runner``'s handlers on a fresh collection, indexes created."""
        ...


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture
def memory_runner() -> MemoryRunnerFactory:
    """Copies of your runner (same handlers and schedules) on fresh in-memory stores."""

    def make(runner: TaskRunner | None = None, *, clock: Callable[[], datetime] | None = None) -> TaskRunner:
        store = MemoryStore(clock=clock) if clock is not None else MemoryStore()
        return (runner or TaskRunner()).copy(store=store)

    return make


@pytest.fixture(scope="session")
def embedded_uri() -> Iterator[str]:
    """URI of an embedded MongoDB-compatible server shared by the session (skips without mongoeco)."""
    from taskrunner.dev.server import ServerThread

    try:
        server = ServerThread()
    except RuntimeError:
        pytest.skip(NO_EMBEDDED)
    with server:
        yield server.uri


@pytest.fixture(scope="session")
def mongo_uri(request: pytest.FixtureRequest) -> str:
    """``$TASKRUNNER_TEST_MONGO_URI`` when set (a real MongoDB), else the embedded server's URI."""
    external = os.environ.get(TEST_MONGO_URI)
    if external:
        return external
    uri: str = request.getfixturevalue("embedded_uri")
    return uri


@pytest.fixture
def collection_name() -> str:
    """A fresh collection per test, so tests never see each other's tasks."""
    return f"t_{uuid4().hex[:12]}"


@pytest_asyncio.fixture
async def mongo_runner(mongo_uri: str, collection_name: str) -> AsyncIterator[MongoRunnerFactory]:
    """Copies of your runner on this test's collection of ``mongo_uri``; closed after the test."""
    made: list[TaskRunner] = []

    async def make(runner: TaskRunner | None = None) -> TaskRunner:
        twin = (runner or TaskRunner()).copy(mongo_uri=mongo_uri, collection=collection_name)
        made.append(twin)
        await twin.init()
        return twin

    yield make
    for twin in made:
        await twin.close()
