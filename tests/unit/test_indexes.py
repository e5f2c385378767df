"""Every hot-path query the store sends has an index in ``taskrunner.store.fields`` that serves it.

The embedded server cannot show query plans, so this checks the index definitions
against the filters and sorts the store builds, by MongoDB's planner rules;
``bench/explain.py`` confirms the plans on a real MongoDB.

The rules (MongoDB's ``IndexBoundsBuilder`` and the manual's equality-sort-range rule):

* bounds come from top-level predicates (and ``$and`` parts, and ``$elemMatch``
  sub-fields): equality, ``$eq`` and ``$in`` give points; ``$gt``/``$gte``/``$lt``/``$lte``
  and an anchored ``$regex`` a value range; ``$type`` the whole range of its types (none
  for ``"array"``), which selects only where it leaves out the type valid documents hold
  (a date field's ``$type: "date"`` is the whole index); ``$ne``, ``$nin`` and ``$not`` of
  an equality the complement of their points, which selects only where the excluded
  values are the ones valid documents hold;
* ``$not`` of anything else (``$type``, ``$regex``, ``$elemMatch``), ``$exists``,
  ``$size``, ``$expr`` and ``$where`` give no bounds, and a ``$or`` gives them only when
  every clause is served (one index scan per clause);
* an index serves a filter when its fields, up to the last one the filter names, are all
  bounded, points first, then the sort's fields in index order (an index walked backwards
  serves the reversed sort), then ranges; the first field's bounds must select (not the
  whole index). A query without such bounds can only walk an index in its sort order.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Literal

import pytest

from taskrunner.models import TaskState
from taskrunner.store import expressions as x
from taskrunner.store import fields as f
from taskrunner.store import rules
from taskrunner.store.base import Listing
from taskrunner.store.mongo import CLAIM_SORT, _listing_queries

Keys = list[tuple[str, int]]
Kind = Literal["point", "range", "complement", "type", "whole"]
Served = Literal["bounds", "walk"]
ID_INDEX: dict[str, Keys] = {"_id_": [(f.ID, 1)]}
TASK_INDEXES: dict[str, Keys] = {**ID_INDEX, **{name: keys for name, (keys, _) in f.INDEXES.items()}}
REGISTRY_INDEXES: dict[str, Keys] = {
    **ID_INDEX,
    **{name: keys for name, (keys, _) in f.REGISTRY_INDEXES.items()},
}
UNIQUE = {"_id_", *(name for name, (_, options) in f.INDEXES.items() if options.get("unique"))}
PARTIAL: dict[str, dict[str, Any]] = {
    name: options["partialFilterExpression"]
    for name, (_, options) in f.INDEXES.items()
    if "partialFilterExpression" in options
}
RANGES = {"$gt", "$gte", "$lt", "$lte"}
STRENGTH: list[Kind] = ["whole", "type", "complement", "range", "point"]
# The type every valid document holds in a field: a $type of it bounds the whole index.
USUAL = {f.KEY: "string", f.NAME: "string", f.STATE: "string"} | {
    field: "date"
    for field in (f.CREATED_AT, f.UPDATED_AT, f.RUN_AT, f.CLAIMABLE_AT, f.FINISHED_AT, f.EXPIRES_AT)
}
LIST_SORT: Keys = [(f.CREATED_AT, 1), (f.ID, 1)]


def _kind(field: str, predicate: Any) -> Kind | None:
    """The bounds one field's predicate gives an index on that field (None: no bounds)."""
    if not isinstance(predicate, dict) or not any(str(op).startswith("$") for op in predicate):
        return "point"  # plain equality (a sub-document compares whole)
    if "$eq" in predicate or (
        "$in" in predicate and all(not hasattr(v, "pattern") for v in predicate["$in"])
    ):
        return "point"
    if RANGES & set(predicate) or str(predicate.get("$regex", "")).startswith("^"):
        return "range"
    if {"$ne", "$nin"} & set(predicate):
        return "complement"
    negated = predicate.get("$not")
    if isinstance(negated, dict) and set(negated) <= {"$eq", "$in"}:
        return "complement"
    types = predicate.get("$type")
    listed = types if isinstance(types, list) else [types]
    if types is not None and "array" not in listed:
        return "whole" if USUAL.get(field) in listed else "type"
    return None  # $not of $type/$regex/$elemMatch, $exists, $size, $all, ...


def bounds(query: dict[str, Any]) -> dict[str, Kind]:
    """Per field, the strongest bounds the query's top-level predicates give."""
    found: dict[str, Kind] = {}

    def add(field: str, kind: Kind | None) -> None:
        if kind is not None and STRENGTH.index(kind) >= STRENGTH.index(found.get(field, "whole")):
            found[field] = kind

    for field, predicate in query.items():
        if field == "$and":
            for part in predicate:
                for name, kind in bounds(part).items():
                    add(name, kind)
        elif field.startswith("$"):
            continue  # $expr, $where, $or (see serves), $comment: no bounds here
        elif isinstance(predicate, dict) and "$elemMatch" in predicate:
            for sub, kind in bounds(predicate["$elemMatch"]).items():
                add(f"{field}.{sub}", kind)
        else:
            add(field, _kind(field, predicate))
    return found


def named(query: dict[str, Any]) -> set[str]:
    """Fields the query's top-level predicates name, bounded or not."""
    found: set[str] = set()
    for field, predicate in query.items():
        if field == "$and":
            found |= set().union(*(named(part) for part in predicate))
        elif field.startswith("$"):
            continue
        elif isinstance(predicate, dict) and isinstance(predicate.get("$elemMatch"), dict):
            found |= {f"{field}.{sub}" for sub in named(predicate["$elemMatch"])}
        else:
            found.add(field)
    return found


def _follows(keys: Keys, start: int, sort: Keys) -> bool:
    """Whether the index's fields from ``start`` are the sort's, all forwards or all backwards."""
    part = keys[start : start + len(sort)]
    if [name for name, _ in part] != [name for name, _ in sort]:
        return False
    signs = {direction * wanted for (_, direction), (_, wanted) in zip(part, sort, strict=True)}
    return len(signs) == 1


def implies(query: dict[str, Any], partial: dict[str, Any]) -> bool:
    """Whether the query states a partial index's filter (MongoDB uses the index only then):
    per filter field, the same equality or ``$type``, or points (``$eq``/``$in``) all inside
    the filter's range."""
    for field, condition in partial.items():
        predicate = query.get(field)
        if predicate is None:
            return False
        stated = predicate if isinstance(predicate, dict) else {"$eq": predicate}
        points = [stated["$eq"]] if "$eq" in stated else list(stated.get("$in", []))
        wanted = condition if isinstance(condition, dict) else {"$eq": condition}
        for op, value in wanted.items():
            if op == "$type":
                held = stated.get("$type") == value
            elif op == "$eq":
                held = points == [value]
            else:
                held = bool(points) and all(_within(point, op, value) for point in points)
            if not held:
                return False
    return True


def _within(point: Any, op: str, bound: Any) -> bool:
    if type(point) is not type(bound):
        return False
    held: bool = {"$gt": point > bound, "$gte": point >= bound, "$lt": point < bound, "$lte": point <= bound}[
        op
    ]
    return held


def serves(name: str, keys: Keys, query: dict[str, Any], sort: Keys) -> Served | None:
    """How the index serves the query's AND part (``$or`` aside: see ``bounded``): with
    bounds, by a walk in sort order, or not at all. A partial index serves only a query
    that states its filter."""
    if name in PARTIAL and not implies(query, PARTIAL[name]):
        return None
    fields = [field for field, _ in keys]
    found = bounds(query)
    points = {field for field, kind in found.items() if kind == "point" and not _is_in(query, field)}
    wanted = [(field, d) for field, d in sort if field not in points]
    if len(wanted) > 1 and wanted[-1][0] == f.ID:
        wanted = wanted[:-1]  # the last tie-breaker: any order of equal keys will do
    if name in UNIQUE and all(found.get(field) == "point" for field in fields):
        return "bounds"  # one index key per value: at most a few documents, any sort is free
    used = 0
    while used < len(fields) and found.get(fields[used]) == "point":
        used += 1
    if wanted:
        if not _follows(keys, used, wanted):
            return None  # a blocking sort
        used += len(wanted)
    while used < len(fields) and fields[used] in found:
        used += 1
    if any(field in fields[used:] for field in named(query)):
        return None  # a named index field after an unbounded one: a gap in the bounds
    if used and fields[0] in found and found[fields[0]] != "whole":
        return "bounds"
    walked = found.get(fields[0]) in (None, "whole")  # the whole index: a walk
    return "walk" if wanted and walked and _follows(keys, 0, wanted) else None


def _is_in(query: dict[str, Any], field: str) -> bool:
    """An ``$in`` of several values is several points: it does not fix the sort order."""
    predicate = query.get(field)
    return isinstance(predicate, dict) and len(predicate.get("$in", [])) > 1


def serving(indexes: dict[str, Keys], query: dict[str, Any], sort: Keys) -> dict[str, Served]:
    """The indexes that serve the query, and how."""
    found = {name: serves(name, keys, query, sort) for name, keys in indexes.items()}
    return {name: how for name, how in found.items() if how is not None}


def bounded(indexes: dict[str, Keys], query: dict[str, Any], sort: Keys) -> bool:
    """Whether an index bounds the query, or, for a ``$or``, each clause's scan."""
    clauses: list[dict[str, Any]] = query.get("$or") or []
    rest = {field: predicate for field, predicate in query.items() if field != "$or"}
    if "bounds" in serving(indexes, rest, sort).values():
        return True
    return bool(clauses) and all(bounded(indexes, {**rest, **clause}, []) for clause in clauses)


def claim_query(key: str | None = None) -> dict[str, Any]:
    query = x.claimable("w1") | {f.NAME: {"$in": ["noop"]}}
    return query if key is None else query | {f.KEY: key}


LIVE = {"$expr": {"$gt": [f.ref(f.EXPIRES_AT), x.NOW]}, f.EXPIRES_AT: {"$type": "date"}}
HOT: dict[str, tuple[dict[str, Keys], dict[str, Any], Keys]] = {
    "claim by key": (TASK_INDEXES, claim_query("k"), CLAIM_SORT),
    "batched claim": (TASK_INDEXES, claim_query() | {f.KEY: {"$in": ["a", "b"]}}, []),
    "claim read-back and recovery": (TASK_INDEXES, x.claims_filter("w1", ["r"], ["a"]), []),
    "keyless claim recovery": (TASK_INDEXES, x.claims_filter("w1", ["r"], None), []),
    "ping/finish fence": (TASK_INDEXES, x.running_entry("k", "run"), []),
    "shared renewal": (TASK_INDEXES, x.renewable("k", "run", "w1"), []),
    "renewal read-back": (TASK_INDEXES, {f.KEY: {"$in": ["a", "b"]}}, []),
    "get": (TASK_INDEXES, {f.KEY: "k"}, []),
    "sweep, expired leases": (
        TASK_INDEXES,
        x.sweepable("w1", ["noop"], 0, TaskState.RUNNING.value),
        [(f.CLAIMABLE_AT, 1)],
    ),
    "sweep, new tasks": (
        TASK_INDEXES,
        x.sweepable("w1", ["noop"], 0, TaskState.PENDING.value),
        [(f.CLAIMABLE_AT, 1)],
    ),
    "sweep, unsettled": (TASK_INDEXES, x.unsettled(), []),
    **{
        f"sweep, unsettled branch {i}": (TASK_INDEXES, branch, [])
        for i, branch in enumerate(x.unsettled_branches())
    },
    "registry beat": (REGISTRY_INDEXES, {f.ID: "w1"}, []),
}
# The registry holds one document per live worker: its liveness query walks _id in order.
WALKS: dict[str, tuple[dict[str, Keys], dict[str, Any], Keys]] = {
    "registry liveness": (REGISTRY_INDEXES, LIVE, [(f.ID, 1)]),
}
# Not hot: the keyless claim runs once per unreadable document without a string key, the
# candidate scan is not used by the engine, purge is an operator's command.
RARE: dict[str, tuple[dict[str, Any], Keys]] = {
    "keyless claim": (claim_query(), CLAIM_SORT),
    "candidates, first page": ({f.STATE: {"$in": list(rules.ACTIVE)}}, [(f.KEY, 1)]),
    "purge": (x.purgeable([TaskState.SUCCESS.value], 1000.0), []),
}
# Listing (`taskrunner list`): the filter is bounded by an index, or the `created` index is
# walked (backwards) in the created_at order; no index has created_at after state, name or worker_id.
LISTING: dict[str, dict[str, Any]] = {
    "list by state": {f.STATE: TaskState.PENDING.value},
    "list by name and state": {f.NAME: "noop", f.STATE: TaskState.PENDING.value},
    "list by worker": {f"{f.WORKERS}.{f.WORKER_ID}": "w1"},
}
# The dashboard's task list as the store sends it: newest first, paged by (time, key), dates
# walked on their sort's index; the undated part (sort value not a date) by its types, by key.
AT = datetime(2026, 1, 1, tzinfo=UTC)
DASHBOARD: dict[str, tuple[dict[str, Any], Keys]] = {
    f"{sort}, {page}": (query, [(sort, -1), (f.KEY, -1)])
    for sort in (f.CREATED_AT, f.UPDATED_AT)
    for page, after in (("first page", None), ("next page", (AT, "k")))
    if (query := _listing_queries(Listing(sort=sort, after=after))[0]) is not None
}
UNDATED: dict[str, dict[str, Any]] = {
    f"{sort}, {page}": _listing_queries(Listing(sort=sort, after=after))[1]
    for sort in (f.CREATED_AT, f.UPDATED_AT)
    for page, after in (("first page", None), ("next page", (None, "k")))
}


def test_bounds_follow_the_planners_rules() -> None:
    """Points, ranges, complements and types bound; ``$expr``, ``$or`` and a negated ``$type`` do not."""
    assert bounds(claim_query()) == {f.STATE: "point", f.CLAIMABLE_AT: "whole", f.NAME: "point"}
    assert bounds(x.running_entry("k", "r")) == {
        f.KEY: "point",
        f"{f.WORKERS}.{f.RUN_ID}": "point",
        f"{f.WORKERS}.{f.STATE}": "point",
    }
    negated = {"a": {"$not": {"$type": "date"}}, "b": {"$nin": [1]}, "c": {"$exists": False}}
    assert bounds(negated | {"$where": "1", "$expr": {"$eq": ["$d", 1]}}) == {"b": "complement"}
    assert bounds({"a": {"$type": "array"}, "b": {"$type": ["int", "null"]}}) == {"b": "type"}


def test_a_negated_type_leaves_a_gap_in_the_claim_index() -> None:
    """A filter naming claimable_at only by ``$not: {$type}`` is bounded on state alone: not served."""
    gap = {f.STATE: {"$in": list(rules.ACTIVE)}, f.CLAIMABLE_AT: {"$not": {"$type": "date"}}}
    assert serving(TASK_INDEXES, gap, []) == {}
    assert serving(TASK_INDEXES, {f.KEY: {"$type": "string"}}, []) == {}  # the whole index


def test_a_blocking_sort_is_not_served() -> None:
    """The keyless claim sorts by priority after a range on claimable_at: no index gives that order."""
    assert serving(TASK_INDEXES, claim_query(), CLAIM_SORT) == {}


@pytest.mark.parametrize("label", list(HOT))
def test_hot_query_has_an_index(label: str) -> None:
    """Each hot-path filter and sort is bounded by an index (each clause of a ``$or`` too)."""
    indexes, query, sort = HOT[label]
    assert bounded(indexes, query, sort), f"no index bounds {label}: {query} sorted by {sort}"


@pytest.mark.parametrize("label", list(WALKS))
def test_small_collections_walk_an_index_in_order(label: str) -> None:
    """The registry's liveness query walks _id in its order (one document per live worker)."""
    indexes, query, sort = WALKS[label]
    assert "walk" in serving(indexes, query, sort).values()


def test_rare_queries_are_what_they_are() -> None:
    """The rare queries' plans, stated: the keyless claim sorts, candidates walk keys, purge is bounded."""
    plans = {label: serving(TASK_INDEXES, query, sort) for label, (query, sort) in RARE.items()}
    assert plans == {
        "keyless claim": {},
        "candidates, first page": {"key_unique": "walk"},
        "purge": {"claim": "bounds"},
    }


def test_sweeps_use_the_claim_index() -> None:
    """The sweep's ranges are bounded by ``claim`` (state, then claimable_at as range and sort)."""
    for label in ("sweep, expired leases", "sweep, new tasks"):
        _, query, sort = HOT[label]
        assert serving(TASK_INDEXES, query, sort).get("claim") == "bounds"
    for branch in x.unsettled_branches():
        assert serving(TASK_INDEXES, branch, []).get("claim") == "bounds", branch


@pytest.mark.parametrize("label", list(LISTING))
def test_listing_filters_are_bounded_or_walk_the_created_index(label: str) -> None:
    """Listing filters use an index; their created_at sort only by walking ``created`` (not a hot path)."""
    query = LISTING[label]
    assert "bounds" in serving(TASK_INDEXES, query, []).values()
    assert serving(TASK_INDEXES, query, LIST_SORT) == {"created": "walk"}


@pytest.mark.parametrize("label", list(DASHBOARD))
def test_dashboard_list_walks_its_sort_index(label: str) -> None:
    """The dashboard's task pages (created or updated, first or next) walk an index in their order."""
    query, sort = DASHBOARD[label]
    assert list(serving(TASK_INDEXES, query, sort)) == [sort[0][0].split("_")[0]]


@pytest.mark.parametrize("label", list(UNDATED))
def test_the_undated_part_of_a_listing_is_bounded_by_its_types(label: str) -> None:
    """The listing's part whose sort value is not a date: each clause of its ``$or`` is
    bounded by the sort's index (null, empty, or a type other than date), never a walk."""
    query = UNDATED[label]
    rest = {field: predicate for field, predicate in query.items() if field != "$or"}
    index = label.split("_")[0]
    assert all(serving(TASK_INDEXES, rest | clause, []).get(index) == "bounds" for clause in query["$or"])


def test_stats_read_each_part_through_an_index() -> None:
    """``stats`` has no ``$facet`` (its sub-pipelines read no index): the counts walk
    ``name_claim`` in order, the oldest PENDING and the last hour's runs are bounded."""
    pipeline = x.stats_pipeline("tasks", AT)
    assert not any("$facet" in stage for stage in pipeline)
    assert serving(TASK_INDEXES, {}, list(pipeline[0]["$sort"].items())) == {"name_claim": "walk"}
    parts = [stage["$unionWith"]["pipeline"] for stage in pipeline if "$unionWith" in stage]
    assert [serving(TASK_INDEXES, part[0]["$match"], []) for part in parts] == [
        {"claim": "bounds"},
        {"updated": "bounds"},
    ]


def test_a_partial_index_serves_only_queries_that_state_its_filter() -> None:
    """``pinned`` holds unfinished pinned tasks only: a query naming worker ids but not a
    state among PENDING and RUNNING cannot use it (its answer would miss documents)."""
    ids = f"{f.OPTIONS}.{f.WORKER_IDS}"
    pinned = {ids: {"$type": "string", "$nin": ["w1"]}}
    assert "pinned" not in serving(TASK_INDEXES, pinned, [])
    assert "pinned" not in serving(TASK_INDEXES, pinned | {f.STATE: {"$in": ["PENDING", "SUCCESS"]}}, [])
    assert "pinned" not in serving(TASK_INDEXES, {ids: "w1", f.STATE: "PENDING"}, [])
    assert serving(TASK_INDEXES, pinned | {f.STATE: "RUNNING"}, []).get("pinned") == "bounds"


FAILED_LIST = Listing(state=TaskState.FAIL, sort=f.FINISHED_AT, limit=20)


@pytest.mark.parametrize("after", [None, (AT, "k")], ids=["first page", "next page"])
def test_the_failed_list_walks_the_failed_index(after: tuple[datetime, str] | None) -> None:
    """``taskrunner failed`` (FAIL tasks, newest failed first) walks the partial ``failed``
    index in its order, and its part without a finish date is bounded by it clause by clause;
    a listing of another state cannot use that index."""
    dated, undated = _listing_queries(replace(FAILED_LIST, after=after))
    assert dated is not None
    sort = [(f.FINISHED_AT, -1), (f.KEY, -1)]
    assert list(serving(TASK_INDEXES, dated, sort)) == ["failed"]
    rest = {field: predicate for field, predicate in undated.items() if field != "$or"}
    assert all(
        serving(TASK_INDEXES, rest | clause, []).get("failed") == "bounds" for clause in undated["$or"]
    )
    canceled, _ = _listing_queries(replace(FAILED_LIST, state=TaskState.CANCELED))
    assert canceled is not None and "failed" not in serving(TASK_INDEXES, canceled, sort)


def test_stats_tasks_pinned_to_no_live_worker_read_the_pinned_index() -> None:
    """``stats``' tasks pinned to no live worker can read the ``pinned`` partial index
    (unfinished pinned tasks only) rather than every unfinished task through ``claim``."""
    [match, *_] = x.pinned_away(["w1", "w2"], 5)
    assert serving(TASK_INDEXES, match["$match"], []) == {"pinned": "bounds", "claim": "bounds"}


def test_a_limited_names_sweep_is_bounded_by_its_name() -> None:
    """The sweep's PENDING branch for each name swept apart (fleet-wide limits) is bounded
    by that name, then state and claimable_at (``name_claim``): another name's backlog is
    never scanned to find it; the other names share one branch on the claim index."""
    pipeline = x.due_pipeline(
        "tasks", "w1", ["job", "metered", "exclusive"], 0, 100, apart=["metered", "exclusive"]
    )
    branches = [stage["$unionWith"]["pipeline"] for stage in pipeline if "$unionWith" in stage]
    matches = [branch[0]["$match"] for branch in branches if branch[0]["$match"].get(f.STATE) == "PENDING"]
    assert [m[f.NAME] for m in matches] == [{"$in": ["job"]}, {"$in": ["metered"]}, {"$in": ["exclusive"]}]
    assert all(branch[1] == {"$sort": {f.CLAIMABLE_AT: 1}} for branch in branches[:3])
    for match in matches[1:]:
        served = serving(TASK_INDEXES, match, [(f.CLAIMABLE_AT, 1)])
        assert {name for name in served if TASK_INDEXES[name][0][0] == f.NAME} == {"name_claim"}
        assert served["name_claim"] == "bounds"
    assert serving(TASK_INDEXES, matches[0], [(f.CLAIMABLE_AT, 1)]).get("claim") == "bounds"
