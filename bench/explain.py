"""Explain every hot-path query on a real MongoDB: winning plan (IXSCAN?) and keys examined.

Needs ``TASKRUNNER_BENCH_MONGO_URI`` (a real MongoDB; the embedded server cannot
show plans). Creates a scratch collection with taskrunner's indexes, inserts
100k finished tasks plus a few pending ones, runs ``explain`` at
``executionStats`` verbosity for the claims (by key, batched by keys, and the keyless
sweep: ``find_one_and_update``'s filter and sort, as a find), the ping/finish fence,
the shared renewal, the two ranges of the worker sweep (`Store.due`), the candidate scan,
the listing queries,
the purge filter and the registry's liveness query, then drops the collection.
Prints one JSON line and appends it to bench/results.jsonl. Without the variable
it says so and exits 0.

    TASKRUNNER_BENCH_MONGO_URI=mongodb://localhost:27017 uv run python bench/explain.py [--finished 100000]

``--require-ixscan`` (CI and ``docker compose run --rm check``) turns a plan without an
index scan, or a missing server, into a failure.
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

from taskrunner import fields as f
from taskrunner import rules
from taskrunner.models import EntryState, TaskState
from taskrunner.store import expressions as x
from taskrunner.store.mongo import CLAIM_SORT

RESULTS = Path(__file__).with_name("results.jsonl")
ENV = "TASKRUNNER_BENCH_MONGO_URI"
WORKER = "bench-worker"


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


def explain(db: Any, collection: str, query: dict[str, Any]) -> dict[str, Any]:
    reply = db.command("explain", {"find": collection, **query}, verbosity="executionStats")
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
    }


def queries(pending_key: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each hot-path query as the store sends it, as (collection suffix, find command body)."""
    claim = x.claim_filter(WORKER) | {f.NAME: {"$in": ["noop"]}}
    sort = {field: direction for field, direction in CLAIM_SORT}
    return {
        "claim_sweep": ("", {"filter": claim, "sort": sort, "limit": 1}),
        "claim_by_key": ("", {"filter": claim | {f.KEY: pending_key}, "sort": sort, "limit": 1}),
        "claim_batch": ("", {"filter": claim | {f.KEY: {"$in": [pending_key, "todo:1", "todo:2"]}}}),
        "sweep_running": (
            "",
            {
                "filter": x.due_filter(WORKER, ["noop"], datetime.now(UTC), TaskState.RUNNING.value),
                "sort": {f.CLAIMABLE_AT: 1},
                "limit": 100,
            },
        ),
        "sweep_pending": (
            "",
            {
                "filter": x.due_filter(WORKER, ["noop"], datetime.now(UTC), TaskState.PENDING.value),
                "sort": {f.CLAIMABLE_AT: 1},
                "limit": 100,
            },
        ),
        "ping_finish": ("", {"filter": x.entry_filter(pending_key, "no-such-run")}),
        "renewal": ("", {"filter": x.renewal_filter(pending_key, "no-such-run", WORKER)}),
        "get": ("", {"filter": {f.KEY: pending_key}, "limit": 1}),
        "candidates": (
            "",
            {"filter": {f.STATE: {"$in": list(rules.ACTIVE)}}, "sort": {f.KEY: 1}, "limit": 500},
        ),
        "candidates_after": (
            "",
            {
                "filter": {f.STATE: {"$in": list(rules.ACTIVE)}, f.KEY: {"$gt": "todo:"}},
                "sort": {f.KEY: 1},
                "limit": 500,
            },
        ),
        "list_pending": (
            "",
            {"filter": {f.STATE: TaskState.PENDING.value}, "sort": {f.CREATED_AT: 1, f.ID: 1}},
        ),
        "list_name_state": (
            "",
            {
                "filter": {f.NAME: "noop", f.STATE: TaskState.PENDING.value},
                "sort": {f.CREATED_AT: 1, f.ID: 1},
            },
        ),
        "list_worker": (
            "",
            {"filter": {f"{f.WORKERS}.{f.WORKER_ID}": "w3"}, "sort": {f.CREATED_AT: 1, f.ID: 1}, "limit": 50},
        ),
        "purge": ("", {"filter": x.purge_filter([TaskState.SUCCESS.value], 7 * 86_400_000)}),
        "registry_live": (
            f".{f.REGISTRY_SUFFIX}",
            {
                "filter": {"$expr": {"$gt": [f.ref(f.EXPIRES_AT), x.NOW]}, f.EXPIRES_AT: {"$type": "date"}},
                "sort": {f.ID: 1},
            },
        ),
    }


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
        tasks.insert_many([task_doc(i, TaskState.PENDING.value, now) for i in range(pending)])
        registry.insert_many([{f.ID: f"w{i}", f.EXPIRES_AT: now + timedelta(seconds=10)} for i in range(3)])
        server = client.admin.command("buildInfo").get("version")
        plans = {
            label: explain(db, name + suffix, body)
            for label, (suffix, body) in queries(task_doc(0, TaskState.PENDING.value, now)[f.KEY]).items()
        }
    finally:
        tasks.drop()
        registry.drop()
        client.close()
    return {
        "bench": "explain",
        "server": server,
        "finished": finished,
        "pending": pending,
        "plans": plans,
        "all_ixscan": all(p["ixscan"] for p in plans.values()),
        "machine": f"{platform.machine()} {platform.python_version()}",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=100_000)
    parser.add_argument("--pending", type=int, default=20)
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON lines file to append to")
    parser.add_argument(
        "--require-ixscan",
        action="store_true",
        help="exit 1 unless every query uses an index, 2 without a server (the CI and compose checks)",
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
    if args.require_ixscan and not report["all_ixscan"]:
        missing = sorted(label for label, plan in report["plans"].items() if not plan["ixscan"])
        sys.exit(f"bench/explain.py: no index scan for {', '.join(missing)}")


if __name__ == "__main__":
    main()
