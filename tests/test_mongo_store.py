"""MongoStore on its own (the embedded server, or TASKRUNNER_TEST_MONGO_URI): what only
MongoDB's side has, namely read preferences, undecodable BSON, lost replies and the
shapes of the queries it sends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from pymongo import ReadPreference, monitoring
from scratch import STORE_DATABASE

from taskrunner.models import NewTask
from taskrunner.store.mongo import MongoStore

pytestmark = pytest.mark.mongo


class Commands(monitoring.CommandListener):
    """Every command a client sends, by name."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.sent.append((event.command_name, dict(event.command)))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def with_option(uri: str, option: str) -> str:
    """``uri`` with one more URI option."""
    if "?" in uri:
        return f"{uri}&{option}"
    return f"{uri}{'' if uri.endswith('/') else '/'}?{option}"


@pytest.fixture
async def secondary_preferred(
    mongo_uri: str, collection_name: str
) -> AsyncIterator[tuple[MongoStore, Commands]]:
    """A store whose URI asks for ``readPreference=secondaryPreferred``, and its commands."""
    commands = Commands()
    uri = with_option(mongo_uri, "readPreference=secondaryPreferred")
    store = MongoStore.connect(
        uri, database=STORE_DATABASE, collection=collection_name, event_listeners=[commands]
    )
    await store.init()
    yield store, commands
    await store.close()


async def test_reads_go_to_the_primary_whatever_the_uri_prefers(
    secondary_preferred: tuple[MongoStore, Commands],
) -> None:
    """With ``readPreference=secondaryPreferred`` in the URI, every collection the store reads
    is pinned to the primary, and no read it sends names another mode."""
    store, commands = secondary_preferred
    assert store.client.read_preference == ReadPreference.SECONDARY_PREFERRED
    pinned = [store.collection, store.registry, store.schedule_docs, store.limit_docs, store.gate_docs]
    assert all(c.read_preference == ReadPreference.PRIMARY for c in pinned)
    await store.publish([NewTask.build(key=f"k{i}", name="job") for i in range(2)])
    await store.get("k0")
    await store.limits()
    reads = [body for name, body in commands.sent if name in ("find", "aggregate", "count")]
    assert reads, "the store read nothing"
    modes = {body.get("$readPreference", {}).get("mode", "primary") for body in reads}
    assert modes == {"primary"}
