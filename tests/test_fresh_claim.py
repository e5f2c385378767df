"""The small claim for a task nobody ran yet writes exactly what the general claim writes.

``MongoStore.claim(fresh=True)`` uses ``fresh_claim_filter``/``fresh_claim_update`` (a
third of the work on a server that interprets expressions) for keys the worker saw with
no runs; for any document both match, the two must agree, and the small filter must
never match what the general one refuses.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from pymongo import ReturnDocument

from taskrunner import MongoStore, NewTask
from taskrunner.store import expressions as x

pytestmark = pytest.mark.mongo
Doc = dict[str, Any]
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "two slots": {"concurrency": 2},
    "pinned to w1": {"worker_ids": ["w1"]},
    "pinned elsewhere": {"worker_ids": ["w9"]},
    "budget spent": {"max_failures": 1, "failures": 1},
    "attempted before": {"attempts": 3},
    "zero slots (by hand)": {"options.concurrency": 0},
    "slots as text (by hand)": {"options.concurrency": "2"},
    "failures missing (by hand)": {"failures": None},
    "delayed": {"delay": 60},
}


@pytest.fixture(params=["embedded", "real"])
async def store(request: pytest.FixtureRequest, collection_name: str) -> AsyncIterator[MongoStore]:
    uri = os.environ.get("TASKRUNNER_TEST_MONGO_URI") if request.param == "real" else None
    if request.param == "real" and not uri:
        pytest.skip("real MongoDB: set TASKRUNNER_TEST_MONGO_URI to run this on it")
    mongo = MongoStore.connect(uri or request.getfixturevalue("embedded_uri"), collection=collection_name)
    await mongo.init()
    yield mongo
    await mongo.close()


async def publish_pair(store: MongoStore, variant: dict[str, Any]) -> None:
    options = {k: v for k, v in variant.items() if k in ("concurrency", "worker_ids", "max_failures")}
    delay = variant.get("delay")
    await store.publish([NewTask.build(key=k, name="job", options=options, delay=delay) for k in ("a", "b")])
    raw = {k: v for k, v in variant.items() if k in ("failures", "attempts") or "." in k}
    if raw:
        await store.collection.update_many({}, {"$set": raw})


def comparable(doc: Doc | None) -> Any:
    """The document without its identity, each time as its offset from the document's
    ``run_at`` in whole seconds (the two writes are milliseconds apart)."""
    if doc is None:
        return None
    anchor = doc["run_at"]

    def norm(value: Any) -> Any:
        if isinstance(value, datetime):
            return round((value - anchor).total_seconds())
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items() if k not in ("_id", "key", "publish_id")}
        if isinstance(value, list):
            return [norm(v) for v in value]
        return value

    return norm(doc)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
async def test_fresh_claim_agrees_with_the_general_claim(store: MongoStore, variant: str) -> None:
    """Same document, same worker and run_id: the small and the general claim write the same, or both refuse."""
    await publish_pair(store, VARIANTS[variant])
    after = ReturnDocument.AFTER
    fresh = await store.collection.find_one_and_update(
        {**x.fresh_claim_filter("w1"), "key": "a"}, x.fresh_claim_update("w1", "r"), return_document=after
    )
    general = await store.collection.find_one_and_update(
        {**x.claim_filter("w1"), "key": "b"}, x.claim_update("w1", "r"), return_document=after
    )
    assert comparable(fresh) == comparable(general)
    if variant in ("plain", "two slots", "pinned to w1", "attempted before"):
        assert fresh is not None  # the cases the small claim is for
    else:
        assert fresh is None


async def test_a_task_with_entries_is_left_to_the_general_claim(store: MongoStore) -> None:
    """A task someone already runs (concurrency 2) is claimed by the general path, with both entries kept."""
    await store.publish([NewTask.build(key="c", name="job", options={"concurrency": 2})])
    first = await store.claim("w1", key="c")
    assert first is not None
    fresh = await store.collection.find_one({**x.fresh_claim_filter("w2"), "key": "c"})
    assert fresh is None
    second = await store.claim("w2", key="c")
    assert second is not None and [w.worker_id for w in second.task.workers] == ["w1", "w2"]
    assert second.task.claimable_at is not None
    assert second.task.claimable_at >= second.task.run_at + timedelta(seconds=0)
