"""Fixtures shared by the fault suite."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from taskrunner import TaskRunner


@pytest.fixture
async def runner(mongo_uri: str, collection_name: str) -> AsyncIterator[TaskRunner]:
    """A publisher on the test's collection, talking to the server directly."""
    async with TaskRunner(mongo_uri, collection=collection_name) as publisher:
        await publisher.init()
        yield publisher
