"""Explain every query the store sends on a real MongoDB: winning plan and keys examined.

Needs ``TASKRUNNER_BENCH_MONGO_URI`` (a real MongoDB; the embedded server cannot
show plans). Creates a scratch collection with taskrunner's indexes, inserts
100,000 finished tasks, 10,000 pending ones and a few written by hand (no claimable_at
date, no created_at date), runs ``explain`` at ``executionStats`` verbosity for every
query of the store as it sends it (``queries``: claims by key, batched and fresh, their
read-back after a lost reply, the fences of renewals and outcomes, the sweep's ranges
and its unsettled clauses, the dashboard's pages, the parts of ``stats`` as finds, the
registry), then drops the collection. Prints one JSON line and appends it to
bench/results.jsonl. Without the variable it says so and exits 0.

    TASKRUNNER_BENCH_MONGO_URI=mongodb://localhost:27017 uv run python bench/explain.py [--finished 100000]

A *hot* query (what workers and the dashboard send all the time) must examine at most
``HOT_RATIO`` index keys per document it returns, plus one per index interval its scans
seek to (``within_ratio``): it is bounded by an index, not filtered after a walk. Rare
ones (the keyless claim, the candidate scan, purge, ``taskrunner list`` sorted by
creation) are reported but not held to it. ``--require-ixscan`` (CI and ``docker compose
run --rm check``) turns a plan without an index scan, a hot query past the ratio, or a
missing server into a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pymongo import MongoClient

from taskrunner.models import EntryState, TaskState
from taskrunner.store import expressions as x
from taskrunner.store import fields as f
from taskrunner.store import rules
from taskrunner.store.base import Listing
from taskrunner.store.mongo import CLAIM_SORT, _listing_queries

RESULTS = Path(__file__).with_name("results.jsonl")
ENV = "TASKRUNNER_BENCH_MONGO_URI"
WORKER = "bench-worker"
HOT_RATIO = 2
"""Index keys a hot query may examine per document it returns (beyond one per interval)."""
HAND_WRITTEN = 20


def task_doc(i: int, state: str, now: datetime) -> dict[str, Any]:
    """A realistic task document: finished ones carry one finished entry, pending ones none."""
    finished = state != TaskState.PENDING.value
    entry = {
        f.WORKER_ID: f"w{i % 7}",
        f.RUN_ID: uuid.uuid4().hex,
        f.STATE: EntryState.SUCCESS.value,
        f.CLAIMED_AT: now,
        f.PING_AT: now,
        f.EXPIRES_AT: now,
        f.ATTEMPT: 0,
        f.PROGRESS: None,
        f.RESULT: None,
        f.ERROR: None,
        f.FINISHED_AT: now,
        f.TOOK_OVER: [],
    }
    doc: dict[str, Any] = {
        f.KEY: f"{'done' if finished else 'todo'}:{i:07}",
        f.NAME: "noop",
        f.PARAMS: {},
        f.PRIORITY: 0,
        f.CREATED_AT: now - timedelta(seconds=i),
        f.UPDATED_AT: now,
        f.RUN_AT: now,
        f.OPTIONS: {
            f.CONCURRENCY: 1,
            f.MAX_FAILURES: 3,
            f.LOCAL_RETRIES: 0,
            f.RETRY_BACKOFF: 10,
            f.PING_INTERVAL: 5,
            f.PING_TIMEOUT: 30,
            f.WORKER_IDS: [],
            f.TIMEOUT: None,
        },
        f.WORKERS: [entry] if finished else [],
        f.STATE: state,
        f.FAILURES: 0,
        f.ATTEMPTS: int(finished),
        f.PUBLISH_ID: "bench",
    }
    if finished:
        doc[f.FINISHED_AT] = now
    else:
        doc[f.CLAIMABLE_AT] = now - timedelta(seconds=1)
    return doc


def stages(plan: dict[str, Any]) -> list[str]:
    """Stage names of a plan tree, root first (``SORT``, ``FETCH``, ``IXSCAN``, ...)."""
    found = [str(plan.get("stage"))]
    for child in [plan.get("inputStage"), *plan.get("inputStages", [])]:
        if isinstance(child, dict):
            found += stages(child)
    return found


def index_names(plan: dict[str, Any]) -> list[str]:
    names = [plan["indexName"]] if "indexName" in plan else []
    for child in [plan.get("inputStage"), *plan.get("inputStages", [])]:
        if isinstance(child, dict):
            names += index_names(child)
    return names


def intervals(plan: dict[str, Any]) -> int:
    """Index intervals the plan's scans seek to: per IXSCAN the product of its fields'
    interval counts (a compound index is scanned per combination), summed over scans."""
    found = 0
    if plan.get("stage") == "IXSCAN":
        combos = 1
        for field_bounds in (plan.get("indexBounds") or {}).values():
            combos *= max(1, len(field_bounds))
        found += combos
    for child in [plan.get("inputStage"), *plan.get("inputStages", [])]:
        if isinstance(child, dict):
            found += intervals(child)
    return found


def read_explain(reply: dict[str, Any]) -> dict[str, Any]:
    """What one ``explain`` reply says: stages, index scan or not, keys, documents, intervals."""
    if "queryPlanner" not in reply or "executionStats" not in reply:
        return {"ixscan": False, "unsupported": sorted(reply)}  # not a real MongoDB
    winning = reply["queryPlanner"]["winningPlan"]
    winning = winning.get("queryPlan", winning)  # slot-based engine wraps the plan
    chain = stages(winning)
    stats = reply["executionStats"]
    return {
        "stages": chain,
        "ixscan": "IXSCAN" in chain and "COLLSCAN" not in chain,
        "indexes": index_names(winning),
        "keys_examined": stats["totalKeysExamined"],
        "docs_examined": stats["totalDocsExamined"],
        "returned": stats["nReturned"],
        "intervals": intervals(winning),
    }


def within_ratio(plan: dict[str, Any]) -> bool:
    """An index scan examining at most ``HOT_RATIO`` keys per document returned (one at
    least), plus one key per interval (a scan may read one key past each before it seeks on)."""
    if not plan.get("ixscan"):
        return False
    allowed = HOT_RATIO * max(1, plan["returned"]) + plan["intervals"]
    return bool(plan["keys_examined"] <= allowed)


def failures(plans: dict[str, dict[str, Any]], hot: set[str]) -> list[str]:
    """Why the report fails (empty: it passes): plans without an index scan, hot ones past the ratio."""
    problems = [
        f"{label}: no index scan ({plan.get('stages')})"
        for label, plan in plans.items()
        if not plan["ixscan"]
    ]
    for label in sorted(hot & plans.keys()):
        plan = plans[label]
        if plan["ixscan"] and not within_ratio(plan):
            problems.append(
                f"{label}: {plan['keys_examined']} keys examined for {plan['returned']} documents "
                f"({plan['intervals']} intervals) through {plan['indexes']}"
            )
    return problems


def explain(db: Any, collection: str, query: dict[str, Any]) -> dict[str, Any]:
    return read_explain(db.command("explain", {"find": collection, **query}, verbosity="executionStats"))


def hand_written(i: int, now: datetime) -> dict[str, Any]:
    """A document written by hand: no claimable_at date (found by the sweep's unsettled
    clauses) and, every other one, no created_at date (the listing's undated part)."""
    doc = task_doc(i, TaskState.PENDING.value, now) | {f.KEY: f"hand:{i:04}"}
    doc[f.CLAIMABLE_AT] = [None, "soon", 5][i % 3]
    if i % 2:
        doc[f.CREATED_AT] = None
    return doc


Query = tuple[str, dict[str, Any]]


def queries(pending_key: str, now: datetime) -> tuple[dict[str, Query], set[str]]:
    """Each query as the store sends it, as (collection suffix, find command body), and
    the labels of the hot ones. The parts of ``stats`` (one aggregate of ``$unionWith``
    parts) are explained as the finds their first stages are."""
    claim = x.claimable(WORKER) | {f.NAME: {"$in": ["noop"]}}
    fresh = x.fresh_claimable(WORKER) | {f.NAME: {"$in": ["noop"]}}
    sort = dict(CLAIM_SORT)
    batch = [pending_key, "todo:0000001", "todo:0000002"]
    stats = x.stats_pipeline("tasks", now - timedelta(hours=1))
    oldest, recent = (stage["$unionWith"]["pipeline"] for stage in stats if "$unionWith" in stage)
    due: dict[str, Query] = {
        f"sweep_{state.lower()}": (
            "",
            {"filter": x.sweepable(WORKER, ["noop"], now, state), "sort": {f.CLAIMABLE_AT: 1}, "limit": 100},
        )
        for state in (TaskState.RUNNING.value, TaskState.PENDING.value)
    }
    unsettled: dict[str, Query] = {
        f"sweep_unsettled_{i}": ("", {"filter": branch, "limit": 100})
        for i, branch in enumerate(x.unsettled_branches())
    }
    listing: dict[str, Query] = {}
    for field in (f.CREATED_AT, f.UPDATED_AT):
        first, undated = _listing_queries(Listing(sort=field))
        after = (now - timedelta(seconds=500), "done:0000500")
        nxt, _ = _listing_queries(Listing(sort=field, after=after))
        order = {field: -1, f.KEY: -1}
        name = field.split("_")[0]
        listing[f"dashboard_{name}"] = ("", {"filter": first, "sort": order, "limit": 50})
        listing[f"dashboard_{name}_next"] = ("", {"filter": nxt, "sort": order, "limit": 50})
        listing[f"dashboard_{name}_undated"] = ("", {"filter": undated, "sort": {f.KEY: -1}, "limit": 50})
    hot: dict[str, Query] = {
        "claim_by_key": ("", {"filter": claim | {f.KEY: pending_key}, "sort": sort, "limit": 1}),
        "claim_fresh": ("", {"filter": fresh | {f.KEY: pending_key}, "sort": sort, "limit": 1}),
        "claim_batch": ("", {"filter": claim | {f.KEY: {"$in": batch}}}),
        "claim_read_back": ("", {"filter": x.claims_filter(WORKER, ["no-such-run"], batch)}),
        "claim_recovery_keyless": ("", {"filter": x.claims_filter(WORKER, ["no-such-run"], None)}),
        **due,
        **unsettled,
        "ping_finish": ("", {"filter": x.running_entry(pending_key, "no-such-run")}),
        "renewal": ("", {"filter": x.renewable(pending_key, "no-such-run", WORKER)}),
        "get": ("", {"filter": {f.KEY: pending_key}, "limit": 1}),
        **listing,
        "stats_counts": (
            "",
            {"filter": {}, "sort": stats[0]["$sort"], "projection": {f.NAME: 1, f.STATE: 1, f.ID: 0}},
        ),
        "stats_oldest": (
            "",
            {"filter": oldest[0]["$match"], "projection": {f.STATE: 1, f.CREATED_AT: 1, f.ID: 0}},
        ),
        "stats_recent": ("", {"filter": recent[0]["$match"]}),
        "registry_live": (
            f".{f.REGISTRY_SUFFIX}",
            {
                "filter": {"$expr": {"$gt": [f.ref(f.EXPIRES_AT), x.NOW]}, f.EXPIRES_AT: {"$type": "date"}},
                "sort": {f.ID: 1},
            },
        ),
    }
    by_creation = {f.CREATED_AT: 1, f.ID: 1}
    rare: dict[str, Query] = {
        "claim_keyless": ("", {"filter": claim, "sort": sort, "limit": 1}),
        "candidates": (
            "",
            {"filter": {f.STATE: {"$in": list(rules.ACTIVE)}}, "sort": {f.KEY: 1}, "limit": 500},
        ),
        "list_pending": ("", {"filter": {f.STATE: TaskState.PENDING.value}, "sort": by_creation}),
        "list_name_state": (
            "",
            {"filter": {f.NAME: "noop", f.STATE: TaskState.PENDING.value}, "sort": by_creation},
        ),
        "list_worker": (
            "",
            {"filter": {f"{f.WORKERS}.{f.WORKER_ID}": "w3"}, "sort": by_creation, "limit": 50},
        ),
        "purge": ("", {"filter": x.purgeable([TaskState.SUCCESS.value], 7 * 86_400_000)}),
    }
    return hot | rare, set(hot)


def run(uri: str, finished: int, pending: int) -> dict[str, Any]:
    client: MongoClient[dict[str, Any]] = MongoClient(uri, tz_aware=True)
    db = client["taskrunner_bench"]
    name = f"explain_{uuid.uuid4().hex[:8]}"
    tasks, registry = db[name], db[f"{name}.{f.REGISTRY_SUFFIX}"]
    try:
        for index, (keys, options) in f.INDEXES.items():
            tasks.create_index(keys, name=index, **options)
        for index, (keys, options) in f.REGISTRY_INDEXES.items():
            registry.create_index(keys, name=index, **options)
        now = datetime.now(UTC)
        states = [
            TaskState.SUCCESS.value,
            TaskState.SUCCESS.value,
            TaskState.SUCCESS.value,
            TaskState.FAIL.value,
        ]
        for start in range(0, finished, 10_000):
            tasks.insert_many(
                [task_doc(i, states[i % 4], now) for i in range(start, min(start + 10_000, finished))]
            )
        for start in range(0, pending, 10_000):
            tasks.insert_many(
                [
                    task_doc(i, TaskState.PENDING.value, now)
                    for i in range(start, min(start + 10_000, pending))
                ]
            )
        tasks.insert_many([hand_written(i, now) for i in range(HAND_WRITTEN)])
        registry.insert_many([{f.ID: f"w{i}", f.EXPIRES_AT: now + timedelta(seconds=10)} for i in range(3)])
        server = client.admin.command("buildInfo").get("version")
        chosen, hot = queries(task_doc(0, TaskState.PENDING.value, now)[f.KEY], now)
        plans = {label: explain(db, name + suffix, body) for label, (suffix, body) in chosen.items()}
    finally:
        tasks.drop()
        registry.drop()
        client.close()
    return {
        "bench": "explain",
        "server": server,
        "finished": finished,
        "pending": pending,
        "hand_written": HAND_WRITTEN,
        "plans": plans,
        "hot": sorted(hot),
        "all_ixscan": all(p["ixscan"] for p in plans.values()),
        "hot_within_ratio": all(within_ratio(plans[label]) for label in hot),
        "problems": failures(plans, hot),
        "machine": f"{platform.machine()} {platform.python_version()}",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=100_000)
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON lines file to append to")
    parser.add_argument(
        "--require-ixscan",
        action="store_true",
        help="exit 1 unless every query uses an index and every hot one keeps to the keys per "
        "document ratio, 2 without a server (the CI and compose checks)",
    )
    args = parser.parse_args()
    uri = os.environ.get(ENV)
    if not uri:
        print(f"bench/explain.py needs a real MongoDB: set {ENV} (the embedded server cannot show plans)")
        sys.exit(2 if args.require_ixscan else 0)
    report = run(uri, args.finished, args.pending)
    line = json.dumps(report)
    print(line)
    with args.results.open("a") as out:
        out.write(line + "\n")
    if args.require_ixscan and report["problems"]:
        sys.exit("bench/explain.py: " + "; ".join(report["problems"]))


if __name__ == "__main__":
    main()
