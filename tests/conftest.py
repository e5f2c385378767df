"""Shared fixtures: taskrunner's own pytest plugin (servers, collections) plus the one
``store`` fixture every store-level test uses."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from scratch import STORE_DATABASE, TEST_MONGO_URI, drop_collection, new_collection

from taskrunner import TaskRunner
from taskrunner.store.base import Store
from taskrunner.store.memory import MemoryStore
from taskrunner.store.mongo import MongoStore

if TYPE_CHECKING:
    from taskrunner.testing import ManualClock

# Imported by pytest itself (not above), so that pytest can rewrite its asserts; skiplist ends
# every run with the skipped tests, each with its reason.
pytest_plugins = ["taskrunner.testing", "skiplist"]
EMBEDDED_ONLY = (
    "embedded server only (it starts or tests the embedded server itself): needs Python >= 3.13"
    " and mongoeco, pip install 'taskrunner[embedded]'"
)

STORES = ["memory", "embedded", "real"]
"""The ``store`` fixture's variants; a module narrows them with
``pytest.mark.parametrize("store", [...], indirect=True)``."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``embedded`` skip, saying why, where mongoeco is not installed (Python < 3.13)."""
    if item.get_closest_marker("embedded") and importlib.util.find_spec("mongoeco") is None:
        pytest.skip(EMBEDDED_ONLY)


@pytest.fixture
def clock() -> ManualClock:
    """The memory store's server clock: it moves only when a test moves it."""
    from taskrunner.testing import ManualClock

    return ManualClock()


@pytest.fixture
def collection_name() -> Iterator[str]:
    """A fresh collection per test (overrides the plugin's), dropped afterwards from a real server."""
    name = new_collection()
    yield name
    drop_collection(name)


@pytest.fixture(params=STORES)
async def store(
    request: pytest.FixtureRequest, collection_name: str, clock: ManualClock
) -> AsyncIterator[Store]:
    """Each store: a MemoryStore on ``clock``, MongoStore on the embedded server, and
    MongoStore on a real MongoDB when TASKRUNNER_TEST_MONGO_URI is set (skipped otherwise)."""
    if request.param == "memory":
        yield MemoryStore(clock=clock)
        return
    if request.param == "real":
        uri = os.environ.get(TEST_MONGO_URI)
        if not uri:
            pytest.skip(f"real MongoDB: set {TEST_MONGO_URI} to run this on it")
    else:
        uri = request.getfixturevalue("embedded_uri")
    mongo = MongoStore.connect(uri, database=STORE_DATABASE, collection=collection_name)
    await mongo.init()
    yield mongo
    await mongo.close()


@pytest.fixture
def elapse(store: Store, clock: ManualClock) -> Callable[[float], Awaitable[None]]:
    """``await elapse(seconds)``: server time passes; the memory store's clock jumps, a server's runs."""

    async def wait(seconds: float) -> None:
        if isinstance(store, MemoryStore):
            clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)

    return wait


RUNNERS = ["mongo", "memory"]
"""The ``runner`` fixture's variants; a module picks them with
``pytest.mark.parametrize("runner", [...], indirect=True)`` (``"mongo"`` without it)."""


@pytest.fixture
def runner_collection(collection_name: str) -> str:
    """The collection the ``runner`` fixture publishes to: the test's own; a module whose worker
    processes serve one collection for all its tests overrides this with that collection."""
    return collection_name


@pytest.fixture
async def runner(request: pytest.FixtureRequest) -> AsyncIterator[TaskRunner]:
    """A publisher, initialized, closed after the test: on the server (``mongo_uri``,
    ``runner_collection``), or, parametrized ``"memory"``, on a fresh MemoryStore."""
    variant = getattr(request, "param", "mongo")
    assert variant in RUNNERS, f"the runner fixture has no variant {variant!r}"
    if variant == "memory":
        publisher = TaskRunner(store=MemoryStore())
    else:
        uri = request.getfixturevalue("mongo_uri")
        publisher = TaskRunner(uri, collection=request.getfixturevalue("runner_collection"))
    async with publisher:
        await publisher.init()
        yield publisher


@pytest.fixture
def raw_insert(store: Store) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """Insert a document as-is, the way an operator could from the mongo shell."""

    async def insert(doc: dict[str, Any]) -> None:
        if isinstance(store, MemoryStore):
            store.insert_document(doc)
        else:
            assert isinstance(store, MongoStore)
            await store.collection.insert_one(doc)

    return insert
