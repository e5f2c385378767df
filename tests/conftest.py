"""Shared fixtures: a MongoDB-compatible server for the test session."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from uuid import uuid4

import pytest

from taskrunner import TaskRunner
from taskrunner.dev.server import ServerThread

_NO_EMBEDDED = "embedded server needs Python >= 3.13 and the 'embedded' extra"


@pytest.fixture(scope="session")
def embedded_uri() -> Iterator[str]:
    """URI of the session's embedded server, whatever TASKRUNNER_TEST_MONGO_URI says."""
    try:
        server = ServerThread()
    except RuntimeError:
        pytest.skip(_NO_EMBEDDED)
    with server:
        yield server.uri


@pytest.fixture(scope="session")
def mongo_uri(request: pytest.FixtureRequest) -> str:
    """TASKRUNNER_TEST_MONGO_URI when set (a real MongoDB), else the embedded server."""
    external = os.environ.get("TASKRUNNER_TEST_MONGO_URI")
    if external:
        return external
    uri: str = request.getfixturevalue("embedded_uri")
    return uri


@pytest.fixture
def collection_name() -> str:
    """A fresh collection per test: mongoeco loses a change event when a collection is dropped."""
    return f"t_{uuid4().hex[:12]}"


@pytest.fixture
async def runner(mongo_uri: str, collection_name: str) -> AsyncIterator[TaskRunner]:
    """A publisher on the test's collection, indexes created, talking to the server directly."""
    async with TaskRunner(mongo_uri, collection=collection_name) as publisher:
        await publisher.init()
        yield publisher
