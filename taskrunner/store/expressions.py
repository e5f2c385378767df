"""MongoDB filters and update pipelines that implement ``taskrunner.rules`` on the server.

Every lease time is ``$$NOW``: the server's clock, never a worker's. Each write
recomputes the summary fields in the same atomic update (``summary_stages``).
Expressions guard types with ``$type`` so MongoDB and look-alike servers agree
on missing, null and wrong-typed fields; mongoeco lacks ``$not`` as an
expression, hence ``{$eq: [expr, false]}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from taskrunner import fields as f
from taskrunner import rules
from taskrunner.models import EntryState, TaskState
from taskrunner.rules import ACTIVE, FINISHED, LEASE_EXPIRED, RETRYABLE, STAMPED, STATES, marked_error

Expr = Any
NOW = "$$NOW"
W = "$$w"  # the loop variable of $filter / $map over workers


def _w(field: str) -> str:
    return f"{W}.{field}"


def _not(expr: Expr) -> Expr:
    return {"$eq": [expr, False]}


# Guarded so a hand-broken ``workers`` never makes the server's evaluation fail.
WORKERS: Expr = {"$cond": [{"$isArray": f.ref(f.WORKERS)}, f.ref(f.WORKERS), []]}


def entries(cond: Expr) -> Expr:
    return {"$filter": {"input": WORKERS, "as": "w", "cond": cond}}


def count(cond: Expr) -> Expr:
    return {"$size": entries(cond)}


def after_now(seconds_path: str) -> Expr:
    """``$$NOW`` plus a duration stored in seconds at ``seconds_path``."""
    return {"$add": [NOW, {"$multiply": [f.ref(seconds_path), 1000]}]}


IS_RUNNING: Expr = {"$eq": [_w(f.STATE), EntryState.RUNNING.value]}
IS_SUCCESS: Expr = {"$eq": [_w(f.STATE), EntryState.SUCCESS.value]}
IS_LIVE: Expr = {
    "$and": [
        IS_RUNNING,
        {"$eq": [{"$type": _w(f.EXPIRES_AT)}, "date"]},
        {"$gt": [_w(f.EXPIRES_AT), NOW]},
    ]
}
# RUNNING and not IS_LIVE, spelled out so the running check is not evaluated twice.
IS_EXPIRED: Expr = {
    "$and": [
        IS_RUNNING,
        {"$or": [{"$ne": [{"$type": _w(f.EXPIRES_AT)}, "date"]}, {"$lte": [_w(f.EXPIRES_AT), NOW]}]},
    ]
}
CONCURRENCY = f.ref(f.opt(f.CONCURRENCY))
MAX_FAILURES = f.ref(f.opt(f.MAX_FAILURES))


def _is_number(path: str) -> Expr:
    return {"$isNumber": f.ref(path)}


def earliest(dates: str) -> Expr:
    """Smallest date of an array (``$min`` of an array operand is not portable)."""
    smaller = {"$or": [{"$eq": ["$$value", None]}, {"$lt": ["$$this", "$$value"]}]}
    return {
        "$reduce": {"input": dates, "initialValue": None, "in": {"$cond": [smaller, "$$this", "$$value"]}}
    }


def finished_at() -> Expr:
    """When the task reached a final state: kept once set, removed when it runs again."""
    finished = {"$in": [f.ref(f.STATE), list(FINISHED)]}
    return {"$cond": [finished, {"$ifNull": [f.ref(f.FINISHED_AT), NOW]}, "$$REMOVE"]}


def summary_stages() -> list[Expr]:
    """Recompute ``state``, ``claimable_at`` and ``updated_at`` (``rules.summarize``)."""
    succ, live = "$_tr_succ", "$_tr_live"
    state = {
        "$switch": {
            "branches": [
                {
                    "case": {"$eq": [f.ref(f.STATE), TaskState.CANCELED.value]},
                    "then": TaskState.CANCELED.value,
                },
                {"case": {"$eq": [f.ref(f.FATAL), True]}, "then": TaskState.FAIL.value},
                {
                    "case": {"$or": [_not(_is_number(f.opt(f.CONCURRENCY))), {"$gte": [succ, CONCURRENCY]}]},
                    "then": TaskState.SUCCESS.value,
                },
                {"case": {"$gt": [count(IS_RUNNING), 0]}, "then": TaskState.RUNNING.value},
                {
                    "case": {
                        "$or": [
                            _not(_is_number(f.opt(f.MAX_FAILURES))),
                            {"$gte": [f.ref(f.FAILURES), MAX_FAILURES]},
                        ]
                    },
                    "then": TaskState.FAIL.value,
                },
            ],
            "default": TaskState.PENDING.value,
        }
    }
    claimable_at = {
        "$switch": {
            "branches": [
                {"case": {"$in": [f.ref(f.STATE), list(FINISHED)]}, "then": "$$REMOVE"},
                {"case": {"$lt": [{"$add": [succ, {"$size": live}]}, CONCURRENCY]}, "then": f.ref(f.RUN_AT)},
            ],
            # Slots are full: a slot frees when the earliest live lease expires.
            "default": {"$max": [f.ref(f.RUN_AT), earliest(f"{live}.{f.EXPIRES_AT}")]},
        }
    }
    return [
        {"$set": {"_tr_succ": count(IS_SUCCESS), "_tr_live": entries(IS_LIVE)}},
        {"$set": {f.STATE: state, f.UPDATED_AT: NOW}},
        {"$set": {f.CLAIMABLE_AT: claimable_at, f.FINISHED_AT: finished_at()}},
        {"$unset": ["_tr_succ", "_tr_live"]},
    ]


def claim_filter(worker_id: str) -> dict[str, Any]:
    """Everything ``rules.claimable_by`` checks, evaluated by the server at ``$$NOW``.

    Each count over the entries is computed once (``$let``): a look-alike server that
    interprets expressions pays per node, and MongoDB does less work too."""
    me = {"$literal": worker_id}
    mine_active = {"$and": [{"$eq": [_w(f.WORKER_ID), me]}, {"$or": [IS_SUCCESS, IS_LIVE]}]}
    live, expired, succ = "$$live", "$$expired", "$$succ"
    claimable = {
        "$and": [
            {"$eq": ["$$mine", 0]},
            {"$lt": [{"$add": [f.ref(f.FAILURES), expired]}, MAX_FAILURES]},
            {"$lt": [{"$add": [succ, live]}, CONCURRENCY]},
        ]
    }
    counts = {
        "live": count(IS_LIVE),
        "expired": count(IS_EXPIRED),
        "succ": count(IS_SUCCESS),
        "mine": count(mine_active),
    }
    check = {"$let": {"vars": counts, "in": {"$or": [claimable, reapable(live, expired)]}}}
    return _due_for(worker_id, {"$in": list(ACTIVE)}, {"$type": "array"}, check)


def _allowed(worker_id: str) -> list[dict[str, Any]]:
    """``options.worker_ids`` is empty or names the worker (an ``$or``)."""
    return [{f.opt(f.WORKER_IDS): {"$size": 0}}, {f.opt(f.WORKER_IDS): worker_id}]


def _due_for(worker_id: str, state: Any, workers: Any, *checks: Expr) -> dict[str, Any]:
    """What every claim filter shares: ``state`` and ``workers`` predicates, claimable at
    ``$$NOW``, allowed for the worker, numeric counters; then the filter's own ``checks``.
    State and claimable_at come first, as in the claim index."""
    guards = [_is_number(f.FAILURES), _is_number(f.opt(f.CONCURRENCY)), _is_number(f.opt(f.MAX_FAILURES))]
    return {
        f.STATE: state,
        f.CLAIMABLE_AT: {"$type": "date"},
        f.WORKERS: workers,
        "$or": _allowed(worker_id),
        "$expr": {"$and": [{"$lte": [f.ref(f.CLAIMABLE_AT), NOW]}, *guards, *checks]},
    }


def reapable(live: Expr, expired: Expr) -> Expr:
    """``rules.reapable`` from the numbers of live and expired leases: only dead leases
    remain and counting them spends the budget."""
    return {
        "$and": [
            {"$eq": [live, 0]},
            {"$gt": [expired, 0]},
            {"$gte": [{"$add": [f.ref(f.FAILURES), expired]}, MAX_FAILURES]},
        ]
    }


def new_entry(worker_id: str, run_id: str | Expr, attempt: Expr, took_over: Expr) -> dict[str, Expr]:
    """The RUNNING entry a claim appends (``rules.new_entry``), stamped in server time."""
    run = {"$literal": run_id} if isinstance(run_id, str) else run_id
    expires_at = after_now(f.opt(f.PING_TIMEOUT))
    return rules.new_entry({"$literal": worker_id}, run, NOW, expires_at, attempt, took_over)


def fresh_claim_filter(worker_id: str) -> dict[str, Any]:
    """``claim_filter`` for the common case, a PENDING task with no entries yet: every
    count is zero, so what is left is small (a look-alike server that interprets
    expressions claims such a task in a third of the time). Whatever it matches,
    ``claim_filter`` matches too, and ``fresh_claim_update`` writes what ``claim_update`` would."""
    checks = ({"$lt": [f.ref(f.FAILURES), MAX_FAILURES]}, {"$lt": [0, CONCURRENCY]})
    return _due_for(worker_id, TaskState.PENDING.value, {"$size": 0}, *checks)


def fresh_claim_update(worker_id: str, run_id: str | Expr) -> list[Expr]:
    """``claim_update`` plus ``summary_stages`` worked out for a task with no entries."""
    attempts = {"$add": [{"$ifNull": [f.ref(f.ATTEMPTS), 0]}, 1]}
    entry = new_entry(worker_id, run_id, attempts, [])
    one_slot_left = {"$lt": [1, CONCURRENCY]}
    claimable_at = {
        "$cond": [one_slot_left, f.ref(f.RUN_AT), {"$max": [f.ref(f.RUN_AT), entry[f.EXPIRES_AT]]}]
    }
    changes = {
        f.ATTEMPTS: attempts,
        f.WORKERS: [entry],
        f.STATE: TaskState.RUNNING.value,
        f.UPDATED_AT: NOW,
        f.CLAIMABLE_AT: claimable_at,
        f.FINISHED_AT: "$$REMOVE",
    }
    return [{"$set": changes}]


def claim_update(worker_id: str, run_id: str | Expr) -> list[Expr]:
    """Drop expired leases (each spends a failure) and append this worker's entry, or
    none when the task is ``reapable`` (it then ends FAIL, its dead runs kept as FAIL
    entries with the ``LeaseExpired`` error). ``run_id`` is a token or
    an expression choosing one per document (``run_id_by_key``)."""
    expired = "$_tr_exp"
    entry = new_entry(
        worker_id, run_id, f.ref(f.ATTEMPTS), {"$map": {"input": expired, "as": "w", "in": _w(f.WORKER_ID)}}
    )
    attempts = {"$add": [{"$ifNull": [f.ref(f.ATTEMPTS), 0]}, 1]}
    reap = "$_tr_reap"
    # A reaped task keeps its dead runs as FAIL entries, so the document says why it failed.
    dead = {f.STATE: EntryState.FAIL.value, f.ERROR: {"$literal": LEASE_EXPIRED}, f.FINISHED_AT: NOW}
    ended = {"$map": {"input": expired, "as": "w", "in": {"$mergeObjects": [W, dead]}}}
    return [
        {"$set": {"_tr_exp": entries(IS_EXPIRED), "_tr_nlive": count(IS_LIVE)}},
        {"$set": {"_tr_reap": reapable("$_tr_nlive", {"$size": expired})}},
        {
            "$set": {
                f.FAILURES: {"$add": [f.ref(f.FAILURES), {"$size": expired}]},
                f.ATTEMPTS: {"$cond": [reap, f.ref(f.ATTEMPTS), attempts]},
            }
        },
        {
            "$set": {
                f.WORKERS: {"$concatArrays": [entries(_not(IS_EXPIRED)), {"$cond": [reap, ended, [entry]]}]}
            }
        },
        {"$unset": ["_tr_exp", "_tr_nlive", "_tr_reap"]},
        *summary_stages(),
    ]


def claims_filter(worker_id: str, run_ids: Sequence[str], keys: Sequence[str] | None) -> dict[str, Any]:
    """Tasks where a claim of ``worker_id`` under one of ``run_ids`` holds its RUNNING entry
    (``rules.running_entry``): through the key index when the claim named ``keys``, else
    through the worker index (``workers.worker_id``)."""
    running = {f.WORKER_ID: worker_id, f.RUN_ID: {"$in": list(run_ids)}, f.STATE: EntryState.RUNNING.value}
    found: dict[str, Any] = {f.WORKERS: {"$elemMatch": running}}
    if keys is not None:
        found[f.KEY] = {"$in": list(keys)}
    return found


def run_id_by_key(keys: list[str], run_ids: list[str]) -> Expr:
    """The run_id paired with the document's key: one update claims many tasks, each
    under its own fencing token."""
    position = {"$indexOfArray": [{"$literal": keys}, f.ref(f.KEY)]}
    return {"$arrayElemAt": [{"$literal": run_ids}, position]}


def due_filter(worker_id: str, names: list[str], horizon: Any, state: str) -> dict[str, Any]:
    """``rules.sweepable`` for tasks in ``state`` (PENDING or RUNNING: the sweep reads each
    as its own range of the claim index, state then claimable_at). ``horizon`` is a date
    (the worker's estimate of server time plus how far ahead it looks): it bounds the
    scan and judges the worker's own leases (one expiring by then does not hide the
    task); every claim re-checks at ``$$NOW``."""
    succeeded = {f.WORKER_ID: worker_id, f.STATE: EntryState.SUCCESS.value}
    held = {
        f.WORKER_ID: worker_id,
        f.STATE: EntryState.RUNNING.value,
        f.EXPIRES_AT: {"$type": "date", "$gt": horizon},
    }
    return {
        f.STATE: state,
        f.CLAIMABLE_AT: {"$lte": horizon},
        f.NAME: {"$in": names},
        "$or": _allowed(worker_id),
        "$nor": [{f.WORKERS: {"$elemMatch": succeeded}}, {f.WORKERS: {"$elemMatch": held}}],
    }


def due_pipeline(
    collection: str,
    worker_id: str,
    names: list[str],
    horizon: Any,
    limit: int,
    apart: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """The sweep as one aggregate: RUNNING tasks (expired leases: takeovers) first, then
    PENDING ones, each the earliest ``limit`` by ``claimable_at``: the names in ``apart``
    (those with fleet-wide limits) each on its own through the ``name_claim`` index, the
    others together through the claim index. RUNNING apart from PENDING, because a
    takeover's claimable_at (its lease expiry) is later than a whole backlog's: it would
    wait until the backlog drained. A limited name apart, because its tasks wait for its
    gate, not for a free worker: a backlog of it would fill every sweep and hide the other
    names' tasks, and another name's backlog would hide its tasks while its gates idle.
    Last, at most ``limit`` unsettled documents of any name (``unsettled_filter``), which
    the worker normalizes."""

    def branch(state: str, of: list[str]) -> list[dict[str, Any]]:
        match = due_filter(worker_id, of, horizon, state)
        return [{"$match": match}, {"$sort": {f.CLAIMABLE_AT: 1}}, {"$limit": limit}]

    def union(pipeline: list[dict[str, Any]]) -> dict[str, Any]:
        return {"$unionWith": {"coll": collection, "pipeline": pipeline}}

    together = [name for name in names if name not in apart]
    groups = ([together] if together else []) + [[name] for name in names if name in apart]
    pending = [union(branch(TaskState.PENDING.value, group)) for group in groups]
    unsettled: list[dict[str, Any]] = [{"$match": unsettled_filter()}, {"$limit": limit}]
    return [*branch(TaskState.RUNNING.value, names), *pending, union(unsettled)]


def work_match(names: list[str], owned: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """The ``$match`` of a worker's change stream: only changes that can give it work.

    New tasks of its names (inserts, and replacements, which carry the whole document)
    in the buckets it owns (``owned``, per name; a name not there: every bucket), and
    updates that ``rules.wakes`` (judged from ``updateDescription.updatedFields``, so the
    server filters before any lookup). Claims, lease renewals and outcomes of other
    workers never reach it, nor do other workers' new tasks. ``rules.hears_insert`` is
    the same judgement in Python.
    """
    changed = f"{f.UPDATE_DESCRIPTION}.{f.UPDATED_FIELDS}"
    new = {f.OPERATION_TYPE: {"$in": ["insert", "replace"]}}
    name, bucket = f"{f.FULL_DOCUMENT}.{f.NAME}", f"{f.FULL_DOCUMENT}.{f.BUCKET}"
    # A name that is not a string belongs to no worker, a bucket out of range to none:
    # every worker hears of those (and names the problem, or claims what it may).
    inserts: list[dict[str, Any]] = [{**new, name: {"$not": {"$type": "string"}}}]
    whole = [n for n in names if owned is None or n not in owned]
    if whole:
        inserts.append({**new, name: {"$in": whole}})
    unrouted = {bucket: {"$not": {"$gte": 0, "$lt": f.BUCKETS}}}
    for buckets, group in _by_buckets(names, owned or {}):
        inserts.append({**new, name: {"$in": group}, "$or": [{bucket: {"$in": buckets}}, unrouted]})
    return {
        "$or": [
            *inserts,
            {f.OPERATION_TYPE: "update", f"{changed}.{f.STATE}": TaskState.PENDING.value},
            {
                f.OPERATION_TYPE: "update",
                f"{changed}.{f.RUN_AT}": {"$exists": True},
                f"{changed}.{f.STATE}": {"$nin": list(FINISHED)},
            },
        ]
    }


def _by_buckets(names: list[str], owned: Mapping[str, Sequence[int]]) -> list[tuple[list[int], list[str]]]:
    """Names that own the same buckets, grouped, so the filter lists each bucket set once."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in names:
        if name in owned:
            groups.setdefault(tuple(sorted(owned[name])), []).append(name)
    return [(list(buckets), group) for buckets, group in groups.items()]


def renewal_filter(key: str, run_id: str, worker_id: str) -> dict[str, Any]:
    """``rules.renewal_status`` is DONE: owned, not CANCELED, still allowed."""
    return {
        **entry_filter(key, run_id),
        f.STATE: {"$ne": TaskState.CANCELED.value},
        "$or": _allowed(worker_id),
    }


def entry_filter(key: str, run_id: str) -> dict[str, Any]:
    """The fencing filter: the run's entry must still be RUNNING under this run_id."""
    return {f.KEY: key, f.WORKERS: {"$elemMatch": {f.RUN_ID: run_id, f.STATE: EntryState.RUNNING.value}}}


def update_entry(run_id: str, changes: dict[str, Expr]) -> Expr:
    """Stage that merges ``changes`` into the entry of ``run_id``."""
    merged = {"$mergeObjects": [W, changes]}
    mapped = {"$cond": [{"$eq": [_w(f.RUN_ID), {"$literal": run_id}]}, merged, W]}
    return {"$set": {f.WORKERS: {"$map": {"input": WORKERS, "as": "w", "in": mapped}}}}


def ping_update(run_id: str, progress: Any = None) -> list[Expr]:
    changes: dict[str, Expr] = {f.PING_AT: NOW, f.EXPIRES_AT: after_now(f.opt(f.PING_TIMEOUT))}
    if progress is not None:
        changes[f.PROGRESS] = {"$literal": progress}
    return [update_entry(run_id, changes), *summary_stages()]


def success_update(run_id: str, result: Any) -> list[Expr]:
    changes = {f.STATE: EntryState.SUCCESS.value, f.RESULT: {"$literal": result}, f.FINISHED_AT: NOW}
    return [update_entry(run_id, changes), *summary_stages()]


def storable_as_is(value: Any) -> bool:
    """A value a plain ``$set`` stores unchanged: no key starts with ``$`` or holds a dot."""
    if isinstance(value, dict):
        return all(
            isinstance(k, str) and not k.startswith("$") and "." not in k and storable_as_is(v)
            for k, v in value.items()
        )
    if isinstance(value, list):
        return all(storable_as_is(v) for v in value)
    return True


def quick_success(key: str, run_id: str, result: Any) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """``success_update`` for the common case, as plain update operators (filter, update,
    array filters): a RUNNING task with one slot. While the run's entry is RUNNING, one
    slot means it is the only live or successful entry, so the summary is known: SUCCESS,
    finished now, no ``claimable_at``. Any other case (canceled, several slots, a slot
    count edited by hand) matches nothing and takes the pipeline. Same fencing; half the
    server's work on a look-alike that interprets pipelines."""
    run = "run"
    query = {**entry_filter(key, run_id), f.STATE: TaskState.RUNNING.value, f.opt(f.CONCURRENCY): 1}
    update = {
        "$set": {
            f"{f.WORKERS}.$[{run}].{f.STATE}": EntryState.SUCCESS.value,
            f"{f.WORKERS}.$[{run}].{f.RESULT}": result,
            f.STATE: TaskState.SUCCESS.value,
        },
        "$currentDate": {
            f"{f.WORKERS}.$[{run}].{f.FINISHED_AT}": True,
            f.FINISHED_AT: True,
            f.UPDATED_AT: True,
        },
        "$unset": {f.CLAIMABLE_AT: ""},
    }
    return query, update, [{f"{run}.{f.RUN_ID}": run_id}]


def failure_update(
    run_id: str, error: dict[str, Any], retry_in: float | None = None, final: bool = False
) -> list[Expr]:
    """``rules.apply_failure``: a final failure sets ``fatal``; any other spends one
    failure and moves ``run_at`` to server now plus ``retry_in`` (None: ``retry_backoff``)."""
    changes = {f.STATE: EntryState.FAIL.value, f.ERROR: {"$literal": error}, f.FINISHED_AT: NOW}
    if final:
        return [update_entry(run_id, changes), {"$set": {f.FATAL: True}}, *summary_stages()]
    later = after_now(f.opt(f.RETRY_BACKOFF)) if retry_in is None else {"$add": [NOW, retry_in * 1000]}
    counters = {f.FAILURES: {"$add": [f.ref(f.FAILURES), 1]}, f.RUN_AT: {"$max": [f.ref(f.RUN_AT), later]}}
    return [update_entry(run_id, changes), {"$set": counters}, *summary_stages()]


def snooze_update(run_id: str, seconds: float) -> list[Expr]:
    """``rules.apply_snooze``: drop the run's entry, run again ``seconds`` from server now."""
    keep = {"$ne": [_w(f.RUN_ID), {"$literal": run_id}]}
    snoozes = {"$add": [{"$cond": [_is_number(f.SNOOZES), f.ref(f.SNOOZES), 0]}, 1]}
    later = {"$add": [NOW, seconds * 1000]}
    return [{"$set": {f.WORKERS: entries(keep), f.RUN_AT: later, f.SNOOZES: snoozes}}, *summary_stages()]


def release_update(run_id: str) -> list[Expr]:
    keep = {"$ne": [_w(f.RUN_ID), {"$literal": run_id}]}
    return [{"$set": {f.WORKERS: entries(keep)}}, *summary_stages()]


def cancel_update() -> list[Expr]:
    done = {"$in": [f.ref(f.STATE), [TaskState.SUCCESS.value, TaskState.FAIL.value]]}
    state = {"$cond": [done, f.ref(f.STATE), TaskState.CANCELED.value]}
    return [{"$set": {f.STATE: state}}, *summary_stages()]


def start_time(run_at: Any, delay: float | None) -> Expr:
    """``rules.start_time``: the given ``run_at``, or server now plus ``delay`` seconds."""
    if run_at is not None:
        return run_at
    return {"$add": [NOW, delay * 1000]} if delay else NOW


def _missing(path: str) -> Expr:
    return {"$eq": [{"$type": f.ref(path)}, "missing"]}


def publish_update(
    new: dict[str, Any], run_at: Any, *, update_pending: bool, republish_finished: bool
) -> list[Expr]:
    """Upsert pipeline: insert ``new`` if the key is new, else apply the chosen option.

    An existing task that no option applies to is returned unchanged: no write.
    ``run_at`` is a datetime or ``$$NOW`` (server time).
    """
    fresh = {
        "$mergeObjects": [
            {"$literal": new},
            {f.CREATED_AT: NOW, f.UPDATED_AT: NOW, f.RUN_AT: run_at, f.CLAIMABLE_AT: run_at},
        ]
    }
    # An upsert starts from {key}: no name and no created_at yet.
    branches = [{"case": {"$and": [_missing(f.NAME), _missing(f.CREATED_AT)]}, "then": fresh}]
    if republish_finished:
        finished = {"$in": [f.ref(f.STATE), list(FINISHED)]}
        branches.append({"case": finished, "then": {"$mergeObjects": [fresh, {f.ID: f.ref(f.ID)}]}})
    if update_pending:
        branches.append({"case": _updatable(), "then": _pending_update(new, run_at)})
    finished = {"$in": [f.ref(f.STATE), list(FINISHED)]}
    drop_claimable = {"$cond": [finished, "$$REMOVE", f.ref(f.CLAIMABLE_AT)]}
    return [
        {"$replaceWith": {"$switch": {"branches": branches, "default": "$$ROOT"}}},
        {"$set": {f.CLAIMABLE_AT: drop_claimable, f.FINISHED_AT: finished_at()}},
    ]


def _updatable() -> Expr:
    """``rules.updatable``: PENDING, and no worker running it or done with it."""
    started = count({"$or": [IS_RUNNING, IS_SUCCESS]})
    return {"$and": [{"$eq": [f.ref(f.STATE), TaskState.PENDING.value]}, {"$eq": [started, 0]}]}


def _pending_update(new: dict[str, Any], run_at: Any) -> Expr:
    spent = {"$gte": [f.ref(f.FAILURES), new[f.OPTIONS][f.MAX_FAILURES]]}
    changes = {
        f.PARAMS: {"$literal": new[f.PARAMS]},
        f.PRIORITY: new[f.PRIORITY],
        f.OPTIONS: {"$literal": new[f.OPTIONS]},
        f.RUN_AT: run_at,
        f.UPDATED_AT: NOW,
        f.STATE: {"$cond": [spent, TaskState.FAIL.value, TaskState.PENDING.value]},
        f.CLAIMABLE_AT: run_at,
    }
    return {"$mergeObjects": ["$$ROOT", changes]}


def retry_filter(key: str) -> dict[str, Any]:
    """``rules.apply_retry`` applies: FAIL or CANCELED, and no run still holds a live lease."""
    return {f.KEY: key, f.STATE: {"$in": list(RETRYABLE)}, "$expr": {"$eq": [count(IS_LIVE), 0]}}


def retry_update() -> list[Expr]:
    """``rules.apply_retry``; the filter limits it to FAIL and CANCELED tasks."""
    unreadable = [_not(_is_number(f.opt(f.CONCURRENCY))), _not(_is_number(f.opt(f.MAX_FAILURES)))]
    recheck = {"$or": [{"$eq": [{"$type": f.ref(f.ERROR)}, "object"]}, *unreadable]}
    fresh = {f.STATE: TaskState.PENDING.value, f.FAILURES: 0, f.RUN_AT: NOW, "_tr_recheck": recheck}
    # A document to check again keeps PENDING and loses claimable_at: the next sweep normalizes it.
    again = {
        f.STATE: {"$cond": ["$_tr_recheck", TaskState.PENDING.value, f.ref(f.STATE)]},
        f.CLAIMABLE_AT: {"$cond": ["$_tr_recheck", "$$REMOVE", f.ref(f.CLAIMABLE_AT)]},
        f.FINISHED_AT: {"$cond": ["$_tr_recheck", "$$REMOVE", f.ref(f.FINISHED_AT)]},
    }
    return [
        {"$set": fresh},
        {"$unset": [f.FATAL, f.ERROR]},
        *summary_stages(),
        {"$set": again},
        {"$unset": ["_tr_recheck"]},
    ]


NOT_DATES = [t for t in rules.BSON_TYPES if t not in ("date", "array")]
"""Every BSON type but a date, as ``$type`` aliases; an array matches by its elements'
types (``$type: "array"`` would give no index bounds), an empty one by ``[]``."""


def unsettled_branches() -> list[dict[str, Any]]:
    """``rules.unsettled`` as three ranges of the claim index, each a clause of a ``$or``:
    states outside the five (the complement of five points), and unfinished with a
    missing, null or empty ``claimable_at``, or one of any type but a date. Written as
    positive types because MongoDB's planner builds no index bounds from a negated
    ``$type``: ``{$not: {$type: "date"}}`` read every active index key. The key's type is
    checked on what the bounds find."""
    keyed = {f.KEY: {"$type": "string"}}
    active = {f.STATE: {"$in": list(ACTIVE)}}
    return [
        {f.STATE: {"$nin": list(STATES)}, **keyed},
        {**active, f.CLAIMABLE_AT: {"$in": [None, []]}, **keyed},
        {**active, f.CLAIMABLE_AT: {"$type": NOT_DATES}, **keyed},
    ]


def unsettled_filter() -> dict[str, Any]:
    """Documents a sweep hands to ``Store.normalize`` (``rules.unsettled``)."""
    return {"$or": unsettled_branches()}


def _if_missing(field: str, value: Expr) -> Expr:
    """``value`` where ``field`` is missing, else the field as it is."""
    return {"$cond": [_missing(field), value, f.ref(field)]}


def normalize_update(fill: dict[str, Any]) -> list[Expr]:
    """``rules.apply_normalization`` without the mark: set each field of ``fill`` only if it
    is still missing when the write lands (a racing worker's write wins, unchanged), times
    in server time; options merged under those given; claimable_at from the run_at set."""
    stage: dict[str, Expr] = {
        field: _if_missing(field, NOW if field in STAMPED else {"$literal": value})
        for field, value in fill.items()
        if field not in (f.OPTIONS, f.CLAIMABLE_AT)
    }
    if f.OPTIONS in fill:
        given = {"$eq": [{"$type": f.ref(f.OPTIONS)}, "object"]}
        merged = {"$mergeObjects": [{"$literal": fill[f.OPTIONS]}, f.ref(f.OPTIONS)]}
        stage[f.OPTIONS] = {"$cond": [given, merged, _if_missing(f.OPTIONS, {"$literal": fill[f.OPTIONS]})]}
    stages: list[Expr] = [{"$set": {**stage, f.UPDATED_AT: NOW}}]
    if f.CLAIMABLE_AT in fill:
        unfinished = {"$and": [_missing(f.CLAIMABLE_AT), {"$in": [f.ref(f.STATE), list(ACTIVE)]}]}
        keep = {"$cond": [_missing(f.CLAIMABLE_AT), "$$REMOVE", f.ref(f.CLAIMABLE_AT)]}
        stages.append({"$set": {f.CLAIMABLE_AT: {"$cond": [unfinished, f.ref(f.RUN_AT), keep]}}})
    return stages


def mark_update(problem: str) -> list[Expr]:
    """The mark of ``rules.apply_normalization``: FAIL, ``fatal``, the document's own error."""
    mark = {f.STATE: TaskState.FAIL.value, f.FATAL: True, f.ERROR: {"$literal": marked_error(problem)}}
    return [{"$set": {**mark, f.FINISHED_AT: NOW, f.UPDATED_AT: NOW}}, {"$unset": [f.CLAIMABLE_AT]}]


def unchanged(doc: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """Matches only while each top-level field of ``fields`` holds what ``doc`` held (or is
    still missing): a mark lands only on the document it judged."""
    present = [{"$eq": [f.ref(name), {"$literal": doc[name]}]} for name in fields if name in doc]
    missing: dict[str, Any] = {name: {"$exists": False} for name in fields if name not in doc}
    return {**missing, "$expr": {"$and": present}} if present else missing


def purge_filter(states: list[str], older_than_ms: float) -> dict[str, Any]:
    """Finished tasks in ``states`` whose ``finished_at`` is older than the cutoff (server time)."""
    cutoff = {"$subtract": [NOW, older_than_ms]}
    return {
        f.STATE: {"$in": states},
        f.FINISHED_AT: {"$type": "date"},
        "$expr": {"$lt": [f.ref(f.FINISHED_AT), cutoff]},
    }


STATS_BY = "by"
STATS_OLDEST = "oldest"
STATS_RECENT = "recent"


def stats_pipeline(collection: str, hour_ago: datetime) -> list[Expr]:
    """Counts by name and state, the oldest PENDING task's creation, and the last hour's run
    outcomes, as one aggregate whose parts each read an index (a ``$facet`` would scan the
    collection: its sub-pipelines cannot use indexes). Each row has ``_id.part``:

    * counts: the ``name_claim`` index walked in order, covered (no document is read);
    * oldest pending: PENDING keys of the ``claim`` index, covered (it holds created_at);
    * recent: tasks written since ``hour_ago`` (server time) through the ``updated`` index,
      since every write that ends a run stamps ``updated_at`` with the run's ``finished_at``.
    """
    entry_state = f.ref(f"{f.WORKERS}.{f.STATE}")  # after $unwind: one entry per document
    outcomes = [EntryState.SUCCESS.value, EntryState.FAIL.value]
    is_date = {"$eq": [{"$type": f.ref(f.CREATED_AT)}, "date"]}
    counts = [
        {"$sort": {f.NAME: 1, f.STATE: 1}},
        {
            "$group": {
                "_id": {"part": STATS_BY, f.NAME: f.ref(f.NAME), f.STATE: f.ref(f.STATE)},
                "n": {"$sum": 1},
            }
        },
    ]
    oldest = [
        {"$match": {f.STATE: TaskState.PENDING.value}},
        # $min skips nulls: a created_at that is not a date (written by hand) is left out.
        {
            "$group": {
                "_id": {"part": STATS_OLDEST},
                "n": {"$min": {"$cond": [is_date, f.ref(f.CREATED_AT), None]}},
            }
        },
    ]
    recent = [
        {"$match": {f.UPDATED_AT: {"$gte": hour_ago}}},
        {"$unwind": f.ref(f.WORKERS)},  # a non-array workers: kept as is, then filtered out
        {
            "$match": {
                f"{f.WORKERS}.{f.STATE}": {"$in": outcomes},
                f"{f.WORKERS}.{f.FINISHED_AT}": {"$gte": hour_ago},
            }
        },
        {"$group": {"_id": {"part": STATS_RECENT, f.STATE: entry_state}, "n": {"$sum": 1}}},
    ]
    return [
        *counts,
        {"$unionWith": {"coll": collection, "pipeline": oldest}},
        {"$unionWith": {"coll": collection, "pipeline": recent}},
    ]


def throttle_update(seconds: float) -> list[Expr]:
    """``throttled_until`` at least server now plus ``seconds`` (``RateLimited``)."""
    until = {"$add": [NOW, seconds * 1000]}
    is_date = {"$eq": [{"$type": f.ref(f.THROTTLED_UNTIL)}, "date"]}
    current = {"$cond": [is_date, f.ref(f.THROTTLED_UNTIL), until]}
    return [{"$set": {f.THROTTLED_UNTIL: {"$max": [current, until]}, f.UPDATED_AT: NOW}}]


def throttle_gate_update(gate: str, seconds: float) -> list[Expr]:
    """``throttled_gates`` keeps the other gates' live throttles and holds ``gate`` until
    at least server now plus ``seconds``."""
    listed = {"$cond": [{"$isArray": f.ref(f.THROTTLED_GATES)}, f.ref(f.THROTTLED_GATES), []]}
    until = {"$add": [NOW, seconds * 1000]}
    this, other = ({op: [f"$$t.{f.GATE}", {"$literal": gate}]} for op in ("$eq", "$ne"))
    live = {"$gt": [f"$$t.{f.UNTIL}", NOW]}
    others = {"$filter": {"input": listed, "as": "t", "cond": {"$and": [other, live]}}}
    same = {"$filter": {"input": listed, "as": "t", "cond": this}}
    longest = {
        "$reduce": {"input": same, "initialValue": until, "in": {"$max": ["$$value", f"$$this.{f.UNTIL}"]}}
    }
    entry = {f.GATE: {"$literal": gate}, f.UNTIL: longest}
    return [{"$set": {f.THROTTLED_GATES: {"$concatArrays": [others, [entry]]}, f.UPDATED_AT: NOW}}]


def window_filter(start: datetime, end: datetime) -> dict[str, Any]:
    """Matches only while the server's clock is in ``[start, end]`` (a gate's permit)."""
    return {"$expr": {"$and": [{"$gte": [NOW, start]}, {"$lte": [NOW, end]}]}}
