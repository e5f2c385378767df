"""MongoStore on its own (the embedded server, or TASKRUNNER_TEST_MONGO_URI): what only
MongoDB's side has, namely read preferences, undecodable BSON, lost replies and the
shapes of the queries it sends."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from faults.proxy import FaultProxy
from pymongo import ReadPreference, monitoring
from scratch import STORE_DATABASE

from taskrunner import MalformedTask, TaskRunner, TaskState
from taskrunner.dashboard import pages
from taskrunner.models import NewTask
from taskrunner.store.base import Listing
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


# -- documents that do not decode ------------------------------------------------------------
LAST_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, the last date Python can hold
FAR_MS = 2**55  # about year 1,141,000: a date other languages write and Python cannot decode


@pytest.fixture
def proxy(mongo_uri: str) -> Iterator[FaultProxy]:
    with FaultProxy(mongo_uri) as running:
        yield running


@pytest.fixture
async def direct(mongo_uri: str, collection_name: str) -> AsyncIterator[MongoStore]:
    """The test's own store, straight to the server."""
    store = MongoStore.connect(mongo_uri, database=STORE_DATABASE, collection=collection_name)
    await store.init()
    yield store
    await store.close()


@pytest.fixture
async def through(proxy: FaultProxy, collection_name: str) -> AsyncIterator[MongoStore]:
    """A store behind the proxy: it sees what the proxy's swap makes of the server's bytes."""
    store = MongoStore.connect(proxy.uri, database=STORE_DATABASE, collection=collection_name)
    yield store
    await store.close()


async def every_reader_survives(direct: MongoStore, store: MongoStore, bad: str, problem: str) -> None:
    """List, show, the dashboard, a sweep, a claim and normalization each read past the
    document ``bad`` (naming it and ``problem``) and serve the readable ones."""
    listed = {t.key: t for t in await store.find()}
    assert set(listed) == {"a", bad, "b"} and listed["a"].problem is None
    assert problem in str(listed[bad].problem)
    assert {t.key for t in (await store.browse(Listing(sort="updated_at"))).tasks} == {"a", bad, "b"}
    assert problem in str((await store.get(bad)).problem)
    runner = TaskRunner(store=store)
    assert (await pages.overview(runner))["by_state"]["PENDING"] == 3
    assert len((await pages.task_list(runner, pages.TaskFilter()))["tasks"]) == 3
    now = await store.server_time()
    page = await store.due("w1", ["job"], horizon=now + timedelta(seconds=5))
    assert sorted(t.key for t in page.tasks) == ["a", "b"]
    assert [u.key for u in page.unreadable] == [bad] and problem in page.unreadable[0].problem
    with pytest.raises(MalformedTask) as raised:
        await store.claim("w1", key=bad)
    assert raised.value.key == bad and problem in raised.value.problem
    claimed = await store.claim("w1", key="a")
    assert claimed is not None and claimed.task.key == "a"
    failed = await direct.get(bad)  # the claim recorded its failure: it cannot loop
    assert failed.state is TaskState.FAIL and failed.workers[0].error is not None
    assert failed.workers[0].error.type == "MalformedTask"


async def test_a_date_out_of_pythons_range_never_stops_a_reader(
    direct: MongoStore, through: MongoStore, proxy: FaultProxy
) -> None:
    """A date Python cannot hold (as another language may write) reads as a malformed task
    naming its field and key, everywhere tasks are read; normalization marks it FAIL."""
    await direct.publish([NewTask.build(key=k, name="job") for k in ("a", "far", "b")])
    await direct.collection.update_one(
        {"key": "far"}, {"$set": {"created_at": datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)}}
    )
    proxy.swap(struct.pack("<q", LAST_MS), struct.pack("<q", FAR_MS))
    await every_reader_survives(direct, through, "far", "created_at")
    await direct.retry("far")
    marked = await through.normalize("far")
    assert (
        marked.state is TaskState.FAIL and marked.error is not None and "created_at" in marked.error.message
    )


async def test_a_string_that_is_not_utf8_never_stops_a_reader(
    direct: MongoStore, through: MongoStore, proxy: FaultProxy
) -> None:
    """A document holding a string that is not UTF-8 reads leniently, its key readable and
    its problem named; claims record it as a failed run and normalization marks it FAIL."""
    await direct.publish(
        [NewTask.build(key=k, name="job", params={"note": f"OKUTF8{k}"}) for k in ("a", "b")]
    )
    await direct.publish([NewTask.build(key="odd", name="job", params={"note": "NOTUTF8!"})])
    proxy.swap(b"NOTUTF8!", b"\xff\xfeTUTF8!")
    await every_reader_survives(direct, through, "odd", "does not decode as BSON")
    await direct.retry("odd")
    marked = await through.normalize("odd")
    assert marked.state is TaskState.FAIL and marked.error is not None
    assert "does not decode as BSON" in marked.error.message
