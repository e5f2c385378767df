"""Every hot-path query the store sends has an index in ``taskrunner.fields`` that serves it.

The embedded server cannot show query plans, so this checks the index definitions
against the filters and sorts the store builds; ``bench/explain.py`` confirms the
plans on a real MongoDB. A filter field counts when its predicate can bound an
index scan (equality, ``$in``, ranges, ``$type``, ``$elemMatch`` sub-fields);
``$expr`` and ``$or`` parts are ignored since they add no bounds here.
"""

from __future__ import annotations

from typing import Any

import pytest

from taskrunner import fields as f
from taskrunner import rules
from taskrunner.models import TaskState
from taskrunner.store import expressions as x
from taskrunner.store.mongo import CLAIM_SORT

Keys = list[tuple[str, int]]
ID_INDEX: dict[str, Keys] = {"_id_": [(f.ID, 1)]}
TASK_INDEXES: dict[str, Keys] = {**ID_INDEX, **{name: keys for name, (keys, _) in f.INDEXES.items()}}
REGISTRY_INDEXES: dict[str, Keys] = {
    **ID_INDEX,
    **{name: keys for name, (keys, _) in f.REGISTRY_INDEXES.items()},
}
BOUNDING = {"$eq", "$in", "$gt", "$gte", "$lt", "$lte", "$type"}
LIST_SORT: Keys = [(f.CREATED_AT, 1), (f.ID, 1)]


def bounded_fields(query: dict[str, Any]) -> set[str]:
    """Top-level (and ``$elemMatch``) fields whose predicates can bound an index scan."""
    found: set[str] = set()
    for field, predicate in query.items():
        if field.startswith("$"):
            continue  # $expr, $or: no index bounds from these
        if not isinstance(predicate, dict) or not any(op.startswith("$") for op in predicate):
            found.add(field)  # plain equality
        elif "$elemMatch" in predicate:
            found |= {f"{field}.{sub}" for sub in predicate["$elemMatch"] if not sub.startswith("$")}
        elif BOUNDING & set(predicate):
            found.add(field)
    return found


def serves(keys: Keys, query: dict[str, Any], sort: Keys) -> bool:
    """Whether an index on ``keys`` bounds the filter (or walks the sort order) and has the sort
    fields right after the filter fields it uses (``_id`` as a last tie-breaker is free)."""
    fields = [name for name, _ in keys]
    bounded = bounded_fields(query)
    prefix = 0
    while prefix < len(fields) and fields[prefix] in bounded:
        prefix += 1
    wanted = [name for name, _ in sort]
    if len(wanted) > 1 and wanted[-1] == f.ID:
        wanted = wanted[:-1]
    if prefix == 0:  # no bounds: only an index walked in the sort's order helps
        return bool(wanted) and fields[: len(wanted)] == wanted
    return set(wanted) <= set(fields[: prefix + len(wanted)])


def serving(indexes: dict[str, Keys], query: dict[str, Any], sort: Keys) -> list[str]:
    return [name for name, keys in indexes.items() if serves(keys, query, sort)]


def claim_query(key: str | None = None) -> dict[str, Any]:
    query = x.claim_filter("w1") | {f.NAME: {"$in": ["noop"]}}
    return query if key is None else query | {f.KEY: key}


ACTIVE = {f.STATE: {"$in": list(rules.ACTIVE)}}
LIVE = {"$expr": {"$gt": [f.ref(f.EXPIRES_AT), x.NOW]}, f.EXPIRES_AT: {"$type": "date"}}
HOT: dict[str, tuple[dict[str, Keys], dict[str, Any], Keys]] = {
    "claim": (TASK_INDEXES, claim_query(), CLAIM_SORT),
    "claim by key": (TASK_INDEXES, claim_query("k"), CLAIM_SORT),
    "batched claim": (TASK_INDEXES, claim_query() | {f.KEY: {"$in": ["a", "b"]}}, []),
    "batched claim read-back": (
        TASK_INDEXES,
        {f.KEY: {"$in": ["a"]}, f"{f.WORKERS}.{f.RUN_ID}": {"$in": ["r"]}},
        [],
    ),
    "ping/finish fence": (TASK_INDEXES, x.entry_filter("k", "run"), []),
    "shared renewal": (TASK_INDEXES, x.renewal_filter("k", "run", "w1"), []),
    "renewal read-back": (TASK_INDEXES, {f.KEY: {"$in": ["a", "b"]}}, []),
    "get": (TASK_INDEXES, {f.KEY: "k"}, []),
    "candidates, first page": (TASK_INDEXES, ACTIVE, [(f.KEY, 1)]),
    "candidates, next page": (TASK_INDEXES, ACTIVE | {f.KEY: {"$gt": "k"}}, [(f.KEY, 1)]),
    "purge": (TASK_INDEXES, x.purge_filter([TaskState.SUCCESS.value], 1000.0), []),
    "sweep, expired leases": (
        TASK_INDEXES,
        x.due_filter("w1", ["noop"], 0, TaskState.RUNNING.value),
        [(f.CLAIMABLE_AT, 1)],
    ),
    "sweep, new tasks": (
        TASK_INDEXES,
        x.due_filter("w1", ["noop"], 0, TaskState.PENDING.value),
        [(f.CLAIMABLE_AT, 1)],
    ),
    "sweep, unsettled: no valid state": (TASK_INDEXES, x.unsettled_branches()[0], []),
    "sweep, unsettled: no claimable_at date": (TASK_INDEXES, x.unsettled_branches()[1], []),
    "registry beat": (REGISTRY_INDEXES, {f.ID: "w1"}, []),
    "registry liveness": (REGISTRY_INDEXES, LIVE, [(f.ID, 1)]),
}
# Listing (`taskrunner list`): the filter is bounded by an index, or the `created` index is
# walked (backwards) in the created_at order; no index has created_at after state, name or worker_id.
LISTING: dict[str, dict[str, Any]] = {
    "list by state": {f.STATE: TaskState.PENDING.value},
    "list by name and state": {f.NAME: "noop", f.STATE: TaskState.PENDING.value},
    "list by worker": {f"{f.WORKERS}.{f.WORKER_ID}": "w1"},
}
# The dashboard's task list: newest first, paged by (time, key), walked on its own index.
DASHBOARD: dict[str, tuple[dict[str, Any], Keys]] = {
    f"{sort}, {page}": (
        {}
        if page == "first page"
        else {sort: {"$lte": "t"}, "$or": [{sort: {"$lt": "t"}}, {f.KEY: {"$lt": "k"}}]},
        [(sort, -1), (f.KEY, -1)],
    )
    for sort in (f.CREATED_AT, f.UPDATED_AT)
    for page in ("first page", "next page")
}


def test_bounded_fields_ignore_expr_and_or() -> None:
    """The helper keeps only fields that can bound a scan from the claim filter."""
    assert bounded_fields(claim_query()) == {f.STATE, f.CLAIMABLE_AT, f.WORKERS, f.NAME}
    assert bounded_fields(x.entry_filter("k", "r")) == {
        f.KEY,
        f"{f.WORKERS}.{f.RUN_ID}",
        f"{f.WORKERS}.{f.STATE}",
    }


@pytest.mark.parametrize("label", list(HOT))
def test_hot_query_has_an_index(label: str) -> None:
    """Each hot-path filter and sort has an index whose key prefix covers it."""
    indexes, query, sort = HOT[label]
    assert serving(indexes, query, sort), f"no index serves {label}: {query} sorted by {sort}"


def test_claim_is_served_by_the_claim_index() -> None:
    """The claim filter and sort use the ``claim`` index (state, claimable_at, then the sort)."""
    assert "claim" in serving(TASK_INDEXES, claim_query(), CLAIM_SORT)


def test_candidate_scan_uses_state_bounds_or_key_order() -> None:
    """Candidates are bounded by ``claim`` (state) and ordered by ``key_unique``; no single index does both."""
    first, nxt = HOT["candidates, first page"][1], HOT["candidates, next page"][1]
    assert serving(TASK_INDEXES, first, []) == ["claim"]
    assert serving(TASK_INDEXES, first, [(f.KEY, 1)]) == ["key_unique"]
    assert serving(TASK_INDEXES, nxt, [(f.KEY, 1)]) == ["key_unique"]


@pytest.mark.parametrize("label", list(LISTING))
def test_listing_filters_are_bounded_or_walk_the_created_index(label: str) -> None:
    """Listing filters use an index; their created_at sort only by walking ``created`` (not a hot path)."""
    query = LISTING[label]
    assert serving(TASK_INDEXES, query, [])
    assert serving(TASK_INDEXES, query, LIST_SORT) == ["created"]


@pytest.mark.parametrize("label", list(DASHBOARD))
def test_dashboard_list_walks_its_sort_index(label: str) -> None:
    """The dashboard's task pages (created or updated, first or next) walk an index in their order."""
    query, sort = DASHBOARD[label]
    assert serving(TASK_INDEXES, query, sort) == [sort[0][0].split("_")[0]]
