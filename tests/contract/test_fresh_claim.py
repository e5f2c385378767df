"""The small claim for a task nobody ran yet writes exactly what the general claim writes.

``MongoStore.claim(fresh=True)`` uses ``fresh_claimable``/``fresh_claim`` (a
third of the work on a server that interprets expressions) for keys the worker saw with
no runs; for any document both match, the two must agree, and the small filter must
never match what the general one refuses.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from pymongo import ReturnDocument

from taskrunner import NewTask
from taskrunner.store import expressions as x
from taskrunner.store.base import RunStatus, RunWrite
from taskrunner.store.mongo import MongoStore

pytestmark = [pytest.mark.mongo, pytest.mark.parametrize("store", ["embedded", "real"], indirect=True)]
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


async def publish_pair(store: MongoStore, variant: dict[str, Any]) -> None:
    options = {k: v for k, v in variant.items() if k in ("concurrency", "worker_ids", "max_failures")}
    delay = variant.get("delay")
    await store.publish([NewTask.build(key=k, name="job", options=options, delay=delay) for k in ("a", "b")])
    raw = {k: v for k, v in variant.items() if k in ("failures", "attempts") or "." in k}
    if raw:
        await store.collection.update_many({}, {"$set": raw})


def comparable(doc: Doc | None) -> tuple[Any, list[float]]:
    """The document without its identity (and its bucket, which follows from the key), its
    times replaced by ``"<time>"``; and those times as offsets from its ``run_at`` (s)."""
    if doc is None:
        return None, []
    anchor, offsets = doc["run_at"], []

    def norm(value: Any) -> Any:
        if isinstance(value, datetime):
            offsets.append((value - anchor).total_seconds())
            return "<time>"
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items() if k not in ("_id", "key", "bucket", "publish_id")}
        if isinstance(value, list):
            return [norm(v) for v in value]
        return value

    return norm(doc), offsets


def assert_same_writes(doc: Doc | None, other: Doc | None) -> None:
    """The two documents hold the same fields and values, each time at the same offset from
    its ``run_at`` give or take 10 s (two writes a busy machine may space far apart)."""
    (shape, times), (other_shape, other_times) = comparable(doc), comparable(other)
    assert shape == other_shape
    assert len(times) == len(other_times)
    assert all(abs(a - b) <= 10 for a, b in zip(times, other_times, strict=True)), (times, other_times)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
async def test_fresh_claim_agrees_with_the_general_claim(store: MongoStore, variant: str) -> None:
    """Same document, same worker and run_id: the small and the general claim write the same, or both refuse."""
    await publish_pair(store, VARIANTS[variant])
    after = ReturnDocument.AFTER
    fresh = await store.collection.find_one_and_update(
        {**x.fresh_claimable("w1"), "key": "a"}, x.fresh_claim("w1", "r"), return_document=after
    )
    general = await store.collection.find_one_and_update(
        {**x.claimable("w1"), "key": "b"}, x.claim("w1", "r"), return_document=after
    )
    assert_same_writes(fresh, general)
    if variant in ("plain", "two slots", "pinned to w1", "attempted before"):
        assert fresh is not None  # the cases the small claim is for
    else:
        assert fresh is None


async def test_a_task_with_entries_is_left_to_the_general_claim(store: MongoStore) -> None:
    """A task someone already runs (concurrency 2) is claimed by the general path, with both entries kept."""
    await store.publish([NewTask.build(key="c", name="job", options={"concurrency": 2})])
    first = await store.claim("w1", key="c")
    assert first is not None
    fresh = await store.collection.find_one({**x.fresh_claimable("w2"), "key": "c"})
    assert fresh is None
    second = await store.claim("w2", key="c")
    assert second is not None and [w.worker_id for w in second.task.workers] == ["w1", "w2"]
    assert second.task.claimable_at is not None
    assert second.task.claimable_at >= second.task.run_at + timedelta(seconds=0)


SUCCESS_VARIANTS: dict[str, dict[str, Any]] = {
    "one slot": {},
    "two slots": {"concurrency": 2},
    "canceled while running": {"cancel": True},
    "retried before": {"attempts": 2},
}


@pytest.mark.parametrize("variant", list(SUCCESS_VARIANTS), ids=list(SUCCESS_VARIANTS))
async def test_quick_success_agrees_with_the_pipeline(store: MongoStore, variant: str) -> None:
    """The plain-operator success writes what the pipeline writes, or matches nothing (the pipeline's cases)."""
    spec = SUCCESS_VARIANTS[variant]
    await publish_pair(store, {k: v for k, v in spec.items() if k != "cancel"})
    runs = {k: await store.claim("w1", key=k) for k in ("a", "b")}
    if spec.get("cancel"):
        for k in runs:
            await store.cancel(k)
    a, b = runs["a"], runs["b"]
    assert a is not None and b is not None
    result = {"rows": [1, {"n": None}], "ok": True}
    query, update, array_filters = x.quick_succeed("a", a.run_id, result)
    quick = await store.collection.update_one(query, update, array_filters=array_filters)
    await store.collection.update_one(x.running_entry("b", b.run_id), x.succeed(b.run_id, result))
    if variant in ("one slot", "retried before"):
        assert quick.modified_count == 1
        docs = [await store.collection.find_one({"key": k}) for k in ("a", "b")]
        assert_same_writes(_same_run(docs[0], docs[1]), docs[1])
    else:
        assert quick.matched_count == 0


def _same_run(doc: Doc | None, like: Doc | None) -> Doc | None:
    """``doc`` with the run_id of ``like`` (each claim drew its own)."""
    assert doc is not None and like is not None
    doc["workers"][0]["run_id"] = like["workers"][0]["run_id"]
    return doc


@pytest.mark.parametrize("result", [{"ok": 1}, {"$weird": {"a.b": 1}}], ids=["plain", "dollar and dot keys"])
async def test_write_runs_lands_every_outcome_the_quick_path_refuses(store: MongoStore, result: Any) -> None:
    """One-slot, two-slot (one more run due) and canceled tasks all record their success through write_runs."""
    await store.publish(
        [
            NewTask.build(key="one", name="job"),
            NewTask.build(key="two", name="job", options={"concurrency": 2}),
            NewTask.build(key="gone", name="job"),
        ]
    )
    claims = {k: await store.claim("w1", key=k) for k in ("one", "two", "gone")}
    await store.cancel("gone")
    writes = [RunWrite("success", k, c.run_id, "w1", result) for k, c in claims.items() if c is not None]
    assert await store.write_runs(writes) == [RunStatus.DONE] * 3
    states = {k: (await store.get(k)) for k in claims}
    assert {k: t.state.value for k, t in states.items()} == {
        "one": "SUCCESS",
        "two": "PENDING",
        "gone": "CANCELED",
    }
    assert all(
        t.workers[0].state.value == "SUCCESS" and t.workers[0].result == result for t in states.values()
    )
