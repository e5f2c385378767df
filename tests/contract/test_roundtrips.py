"""The opt-in round-trip counter: counts commands by name, and the worker CLI's env switch."""

from __future__ import annotations

from typing import Any

import pytest

from taskrunner import TaskRunner
from taskrunner.cli.worker import count_roundtrips
from taskrunner.observability import roundtrips
from taskrunner.observability.roundtrips import RoundTripCounter
from taskrunner.store.mongo import MongoStore


@pytest.mark.mongo
async def test_counter_counts_commands_by_name(mongo_uri: str, collection_name: str) -> None:
    """A store connected with the counter counts each command it sends, by name and collection."""
    counter = RoundTripCounter()
    store = MongoStore.connect(mongo_uri, collection=collection_name, event_listeners=[counter])
    try:
        await store.count()
        await store.find()
        assert counter.snapshot().get("find", 0) >= 1
        assert ("find", collection_name) in counter.by_target()
        before = counter.reset()
        assert sum(before.values()) == 2
        assert counter.snapshot() == {}
        assert counter.total() == 0
    finally:
        await store.close()


async def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TASKRUNNER_COUNT_ROUNDTRIPS=1`` gives the worker a counting store; unset leaves it alone."""
    runner = TaskRunner("mongodb://127.0.0.1:1")
    monkeypatch.delenv(roundtrips.ENV_VAR, raising=False)
    same, counter = count_roundtrips(runner)
    assert same is runner
    assert counter is None
    monkeypatch.setenv(roundtrips.ENV_VAR, "1")
    counted, counter = count_roundtrips(runner)
    assert counter is not None
    assert isinstance(counted.store, MongoStore)
    try:
        listeners: Any = counted.store.client.options.event_listeners  # typed as a wrapper; a list
        assert counter in listeners
    finally:
        await counted.close()
