"""MongoDB filters and update pipelines that implement ``taskrunner.store.rules`` on the server.

Every lease time is ``$$NOW``: the server's clock, never a worker's. Each builder that
reads the clock takes it as ``now`` (default ``$$NOW``, what the store sends; a test
passes a date, the same one it gives the Python twin). Each write recomputes the summary
fields in the same atomic update (``summarize``).

The twin of ``taskrunner.store.rules``: each rule has one name in both modules (the naming
scheme is in that module's docstring), and ``tests/contract/test_twins.py`` runs each pair on
generated documents and compares (docs/design.md, "One set of rules, twice").
``normalize`` is written here in two parts, ``normalize`` and its ``mark``.

Expressions guard types with ``$type`` so MongoDB and look-alike servers agree
on missing, null and wrong-typed fields; mongoeco lacks ``$not`` as an
expression, hence ``{$eq: [expr, false]}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from taskrunner.models import EntryState, TaskState
from taskrunner.store import fields as f
from taskrunner.store import rules
from taskrunner.store.rules import (
    ACTIVE,
    CANCEL_REASONS,
    FAILED,
    FINISHED,
    LEASE_EXPIRED,
    RETRYABLE,
    RUN_ANYWAY,
    STAMPED,
    STATES,
    UNHEARD,
    WAITING,
    Heard,
    marked_error,
)

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


def after_now(seconds_path: str, now: Expr = NOW, otherwise: Expr = None) -> Expr:
    """``now`` plus a duration stored in seconds at ``seconds_path``; ``otherwise`` when that
    is not a number (``rules.after``)."""
    later = {"$add": [now, {"$multiply": [f.ref(seconds_path), 1000]}]}
    return {"$cond": [_is_number(seconds_path), later, otherwise]}


IS_RUNNING: Expr = {"$eq": [_w(f.STATE), EntryState.RUNNING.value]}
IS_SUCCESS: Expr = {"$eq": [_w(f.STATE), EntryState.SUCCESS.value]}
IS_FAIL: Expr = {"$eq": [_w(f.STATE), EntryState.FAIL.value]}


def is_live(now: Expr = NOW) -> Expr:
    return {
        "$and": [
            IS_RUNNING,
            {"$eq": [{"$type": _w(f.EXPIRES_AT)}, "date"]},
            {"$gt": [_w(f.EXPIRES_AT), now]},
        ]
    }


def is_expired(now: Expr = NOW) -> Expr:
    """RUNNING and not ``is_live``, spelled out so the running check is not evaluated twice."""
    return {
        "$and": [
            IS_RUNNING,
            {"$or": [{"$ne": [{"$type": _w(f.EXPIRES_AT)}, "date"]}, {"$lte": [_w(f.EXPIRES_AT), now]}]},
        ]
    }


CONCURRENCY = f.ref(f.opt(f.CONCURRENCY))
MAX_FAILURES = f.ref(f.opt(f.MAX_FAILURES))


def _missing(path: str) -> Expr:
    return {"$eq": [{"$type": f.ref(path)}, "missing"]}


RUN_AT: Expr = {"$ifNull": [f.ref(f.RUN_AT), None]}
"""``run_at`` as a value to copy: null when missing (``doc.get`` in the rules)."""


def _is_number(path: str) -> Expr:
    return {"$isNumber": f.ref(path)}


def earliest(dates: str) -> Expr:
    """Smallest date of an array (``$min`` of an array operand is not portable)."""
    smaller = {"$or": [{"$eq": ["$$value", None]}, {"$lt": ["$$this", "$$value"]}]}
    return {
        "$reduce": {"input": dates, "initialValue": None, "in": {"$cond": [smaller, "$$this", "$$value"]}}
    }


def tally(path: str) -> Expr:
    """``rules.tally``: the counter at ``path``, or 0 when it is not a number."""
    return {"$cond": [_is_number(path), f.ref(path), 0]}


def is_date(path: str) -> Expr:
    return {"$eq": [{"$type": f.ref(path)}, "date"]}


def finished_at(now: Expr = NOW) -> Expr:
    """When the task reached a final state: kept once set (a date), removed when it runs again."""
    finished = {"$in": [f.ref(f.STATE), list(FINISHED)]}
    return {"$cond": [finished, {"$cond": [is_date(f.FINISHED_AT), f.ref(f.FINISHED_AT), now]}, "$$REMOVE"]}


def summarize(now: Expr = NOW) -> list[Expr]:
    """Recompute ``state``, ``claimable_at`` and ``updated_at`` (``rules.summarize``)."""
    succ, live = "$_tr_succ", "$_tr_live"
    state = {
        "$switch": {
            "branches": [
                {
                    "case": {"$in": [f.ref(f.STATE), [TaskState.CANCELED.value, WAITING]]},
                    "then": f.ref(f.STATE),
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
                            {"$gte": [tally(f.FAILURES), MAX_FAILURES]},
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
                {"case": {"$in": [f.ref(f.STATE), [*FINISHED, WAITING]]}, "then": "$$REMOVE"},
                {"case": {"$lt": [{"$add": [succ, {"$size": live}]}, CONCURRENCY]}, "then": RUN_AT},
            ],
            # Slots are full: a slot frees when the earliest live lease expires.
            "default": {"$max": [f.ref(f.RUN_AT), earliest(f"{live}.{f.EXPIRES_AT}")]},
        }
    }
    return [
        {"$set": {"_tr_succ": count(IS_SUCCESS), "_tr_live": entries(is_live(now))}},
        {"$set": {f.STATE: state, f.UPDATED_AT: now}},
        {"$set": {f.CLAIMABLE_AT: claimable_at, f.FINISHED_AT: finished_at(now)}},
        {"$unset": ["_tr_succ", "_tr_live"]},
    ]


def bumped(path: str) -> Expr:
    """A counter at ``path`` plus one (``rules.tally`` + 1)."""
    return {"$add": [tally(path), 1]}


def announce() -> Expr:
    """``rules.announce``: a task others wait on that ended counts one more ``notify``."""
    owed = {"$and": [{"$eq": [f.ref(f.DEPENDENTS), True]}, {"$in": [f.ref(f.STATE), list(FINISHED)]}]}
    return {"$set": {f.NOTIFY: {"$cond": [owed, bumped(f.NOTIFY), f.ref(f.NOTIFY)]}}}


def claimable(worker_id: str, now: Expr = NOW) -> dict[str, Any]:
    """Everything ``rules.claimable`` checks, evaluated by the server at ``now``.

    Each count over the entries is computed once (``$let``): a look-alike server that
    interprets expressions pays per node, and MongoDB does less work too."""
    me = {"$literal": worker_id}
    mine_active = {"$and": [{"$eq": [_w(f.WORKER_ID), me]}, {"$or": [IS_SUCCESS, is_live(now)]}]}
    live, expired, succ = "$$live", "$$expired", "$$succ"
    claimable = {
        "$and": [
            {"$eq": ["$$mine", 0]},
            {"$lt": [{"$add": [f.ref(f.FAILURES), expired]}, MAX_FAILURES]},
            {"$lt": [{"$add": [succ, live]}, CONCURRENCY]},
        ]
    }
    counts = {
        "live": count(is_live(now)),
        "expired": count(is_expired(now)),
        "succ": count(IS_SUCCESS),
        "mine": count(mine_active),
    }
    check = {"$let": {"vars": counts, "in": {"$or": [claimable, reapable(live, expired)]}}}
    return _due_for(worker_id, now, {"$in": list(ACTIVE)}, {"$type": "array"}, check)


def numeric() -> list[Expr]:
    """The counters a claim computes with are numbers (``rules.numbers`` is not None)."""
    return [_is_number(f.FAILURES), _is_number(f.opt(f.CONCURRENCY)), _is_number(f.opt(f.MAX_FAILURES))]


def _allowed(worker_id: str) -> list[dict[str, Any]]:
    """``options.worker_ids`` is empty or names the worker (an ``$or``)."""
    return [{f.opt(f.WORKER_IDS): {"$size": 0}}, {f.opt(f.WORKER_IDS): worker_id}]


def _due_for(worker_id: str, now: Expr, state: Any, workers: Any, *checks: Expr) -> dict[str, Any]:
    """What every claim filter shares: ``state`` and ``workers`` predicates, claimable at
    ``now``, allowed for the worker, numeric counters; then the filter's own ``checks``.
    State and claimable_at come first, as in the claim index."""
    return {
        f.STATE: state,
        f.CLAIMABLE_AT: {"$type": "date"},
        f.WORKERS: workers,
        "$or": _allowed(worker_id),
        # The query's $type matches an array holding a date; this comparison would take any
        # array as earlier than every date, so the type is checked here too.
        "$expr": {
            "$and": [is_date(f.CLAIMABLE_AT), {"$lte": [f.ref(f.CLAIMABLE_AT), now]}, *numeric(), *checks]
        },
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


def new_entry(
    worker_id: str, run_id: str | Expr, attempt: Expr, took_over: Expr, now: Expr = NOW
) -> dict[str, Expr]:
    """The RUNNING entry a claim appends (``rules.new_entry``), stamped at ``now``."""
    run = {"$literal": run_id} if isinstance(run_id, str) else run_id
    expires_at = after_now(f.opt(f.PING_TIMEOUT), now)
    return rules.new_entry({"$literal": worker_id}, run, now, expires_at, attempt, took_over)


def fresh_claimable(worker_id: str, now: Expr = NOW) -> dict[str, Any]:
    """``claimable`` for the common case, a PENDING task with no entries yet: every
    count is zero, so what is left is small (a look-alike server that interprets
    expressions claims such a task in a third of the time). Whatever it matches,
    ``claimable`` matches too, and ``fresh_claim`` writes what ``claim`` would."""
    # Not ``fatal`` (written by hand on a PENDING task): the general claim's summary ends such
    # a task FAIL, which the small update does not work out.
    checks = (
        {"$lt": [f.ref(f.FAILURES), MAX_FAILURES]},
        {"$lt": [0, CONCURRENCY]},
        {"$ne": [f.ref(f.FATAL), True]},
    )
    return _due_for(worker_id, now, TaskState.PENDING.value, {"$size": 0}, *checks)


def fresh_claim(worker_id: str, run_id: str | Expr, now: Expr = NOW) -> list[Expr]:
    """``claim`` plus ``summarize`` worked out for a task with no entries."""
    attempts = {"$add": [tally(f.ATTEMPTS), 1]}
    entry = new_entry(worker_id, run_id, attempts, [], now)
    one_slot_left = {"$lt": [1, CONCURRENCY]}
    claimable_at = {"$cond": [one_slot_left, RUN_AT, {"$max": [f.ref(f.RUN_AT), entry[f.EXPIRES_AT]]}]}
    changes = {
        f.ATTEMPTS: attempts,
        f.WORKERS: [entry],
        f.STATE: TaskState.RUNNING.value,
        f.UPDATED_AT: now,
        f.CLAIMABLE_AT: claimable_at,
        f.FINISHED_AT: "$$REMOVE",
    }
    return [{"$set": changes}]


def claim(worker_id: str, run_id: str | Expr, now: Expr = NOW) -> list[Expr]:
    """Drop expired leases (each spends a failure) and append this worker's entry, or
    none when the task is ``reapable`` (it then ends FAIL, its dead runs kept as FAIL
    entries with the ``LeaseExpired`` error). ``run_id`` is a token or
    an expression choosing one per document (``run_id_by_key``)."""
    expired = "$_tr_exp"
    took_over = {"$map": {"input": expired, "as": "w", "in": _w(f.WORKER_ID)}}
    entry = new_entry(worker_id, run_id, f.ref(f.ATTEMPTS), took_over, now)
    attempts = {"$add": [tally(f.ATTEMPTS), 1]}
    reap = "$_tr_reap"
    # A reaped task keeps its dead runs as FAIL entries, so the document says why it failed.
    dead = {f.STATE: EntryState.FAIL.value, f.ERROR: {"$literal": LEASE_EXPIRED}, f.FINISHED_AT: now}
    # In place, so the entries keep the order of their claims.
    ended = {"$cond": [is_expired(now), {"$mergeObjects": [W, dead]}, W]}
    reaped = {"$map": {"input": WORKERS, "as": "w", "in": ended}}
    claimed = {"$concatArrays": [entries(_not(is_expired(now))), [entry]]}
    return [
        {"$set": {"_tr_exp": entries(is_expired(now)), "_tr_nlive": count(is_live(now))}},
        {"$set": {"_tr_reap": reapable("$_tr_nlive", {"$size": expired})}},
        {
            "$set": {
                f.FAILURES: {"$add": [f.ref(f.FAILURES), {"$size": expired}]},
                f.ATTEMPTS: {"$cond": [reap, f.ref(f.ATTEMPTS), attempts]},
            }
        },
        {"$set": {f.WORKERS: {"$cond": [reap, reaped, claimed]}}},
        {"$unset": ["_tr_exp", "_tr_nlive", "_tr_reap"]},
        *summarize(now),
        announce(),
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


def sweepable(worker_id: str, names: list[str], horizon: Any, state: str) -> dict[str, Any]:
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
    Last, at most ``limit`` unsettled documents of any name (``unsettled``), which
    the worker normalizes."""

    def branch(state: str, of: list[str]) -> list[dict[str, Any]]:
        match = sweepable(worker_id, of, horizon, state)
        return [{"$match": match}, {"$sort": {f.CLAIMABLE_AT: 1}}, {"$limit": limit}]

    def union(pipeline: list[dict[str, Any]]) -> dict[str, Any]:
        return {"$unionWith": {"coll": collection, "pipeline": pipeline}}

    pending = [union(branch(TaskState.PENDING.value, group)) for group in rules.sweep_groups(names, apart)]
    leftovers: list[dict[str, Any]] = [{"$match": unsettled()}, {"$limit": limit}]
    return [*branch(TaskState.RUNNING.value, names), *pending, union(leftovers)]


def hears(names: list[str], owned: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
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
    unrouted = {bucket: {"$not": in_bucket_range()}}
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


def in_bucket_range() -> dict[str, Any]:
    """``rules.in_bucket_range``: a bucket number in ``[0, BUCKETS)``."""
    return {"$gte": 0, "$lt": f.BUCKETS}


def _by_buckets(names: list[str], owned: Mapping[str, Sequence[int]]) -> list[tuple[list[int], list[str]]]:
    """Names that own the same buckets, grouped, so the filter lists each bucket set once."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in names:
        if name in owned:
            groups.setdefault(tuple(sorted(owned[name])), []).append(name)
    return [(list(buckets), group) for buckets, group in groups.items()]


def renewable(key: str, run_id: str, worker_id: str) -> dict[str, Any]:
    """``rules.renewal_status`` is DONE: owned, not CANCELED, still allowed."""
    return {
        **running_entry(key, run_id),
        f.STATE: {"$ne": TaskState.CANCELED.value},
        "$or": _allowed(worker_id),
    }


def running_entry(key: str, run_id: str) -> dict[str, Any]:
    """The fencing filter: the run's entry must still be RUNNING under this run_id."""
    return {f.KEY: key, f.WORKERS: {"$elemMatch": {f.RUN_ID: run_id, f.STATE: EntryState.RUNNING.value}}}


def update_entry(run_id: str, changes: dict[str, Expr]) -> Expr:
    """Stage that merges ``changes`` into the entry of ``run_id``."""
    merged = {"$mergeObjects": [W, changes]}
    mapped = {"$cond": [{"$eq": [_w(f.RUN_ID), {"$literal": run_id}]}, merged, W]}
    return {"$set": {f.WORKERS: {"$map": {"input": WORKERS, "as": "w", "in": mapped}}}}


def ping(run_id: str, progress: Any = None, now: Expr = NOW) -> list[Expr]:
    changes: dict[str, Expr] = {f.PING_AT: now, f.EXPIRES_AT: after_now(f.opt(f.PING_TIMEOUT), now)}
    if progress is not None:
        changes[f.PROGRESS] = {"$literal": progress}
    return [update_entry(run_id, changes), *summarize(now)]


def succeed(run_id: str, result: Any, now: Expr = NOW, progress: Any = None) -> list[Expr]:
    """``rules.succeed``: the result, and the run's last ``progress`` unless None."""
    changes = {f.STATE: EntryState.SUCCESS.value, f.RESULT: {"$literal": result}, f.FINISHED_AT: now}
    return [update_entry(run_id, _with_progress(changes, progress)), *summarize(now), announce()]


def _with_progress(changes: dict[str, Expr], progress: Any) -> dict[str, Expr]:
    return changes if progress is None else {**changes, f.PROGRESS: {"$literal": progress}}


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


def quick_succeed(
    key: str, run_id: str, result: Any, now: datetime | None = None, progress: Any = None
) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """``succeed`` for the common case, as plain update operators (filter, update,
    array filters): a RUNNING task with one slot. While the run's entry is RUNNING, one
    slot means it is the only live or successful entry, so the summary is known: SUCCESS,
    finished now, no ``claimable_at``. Any other case (canceled, several slots, a slot
    count edited by hand) matches nothing and takes the pipeline. Same fencing; half the
    server's work on a look-alike that interprets pipelines. Times are the server's
    (``$currentDate``), or ``now`` when given."""
    run = "run"
    # Not fatal and no finished_at (both written by hand on a RUNNING task): the summary
    # would end it FAIL, or keep that finished_at. Nothing waits on it: its end is announced.
    one_slot = {
        f.STATE: TaskState.RUNNING.value,
        f.opt(f.CONCURRENCY): 1,
        f.FATAL: {"$ne": True},
        f.FINISHED_AT: {"$exists": False},
        f.DEPENDENTS: {"$ne": True},
    }
    query = {**running_entry(key, run_id), **one_slot}
    times = (f"{f.WORKERS}.$[{run}].{f.FINISHED_AT}", f.FINISHED_AT, f.UPDATED_AT)
    values = {
        f"{f.WORKERS}.$[{run}].{f.STATE}": EntryState.SUCCESS.value,
        f"{f.WORKERS}.$[{run}].{f.RESULT}": result,
        f.STATE: TaskState.SUCCESS.value,
    }
    if progress is not None:
        values[f"{f.WORKERS}.$[{run}].{f.PROGRESS}"] = progress
    stamp = {"$currentDate": dict.fromkeys(times, True)} if now is None else {}
    update = {
        "$set": values if now is None else values | dict.fromkeys(times, now),
        **stamp,
        "$unset": {f.CLAIMABLE_AT: ""},
    }
    return query, update, [{f"{run}.{f.RUN_ID}": run_id}]


def fail(
    run_id: str,
    error: dict[str, Any],
    retry_in: float | None = None,
    final: bool = False,
    now: Expr = NOW,
    progress: Any = None,
) -> list[Expr]:
    """``rules.fail``: a final failure sets ``fatal``; any other spends one
    failure and moves ``run_at`` to server now plus ``retry_in`` (None: ``retry_backoff``).
    The run's last ``progress`` is written unless None."""
    failed = {f.STATE: EntryState.FAIL.value, f.ERROR: {"$literal": error}, f.FINISHED_AT: now}
    changes = _with_progress(failed, progress)
    if final:
        return [update_entry(run_id, changes), {"$set": {f.FATAL: True}}, *summarize(now), announce()]
    later = (
        after_now(f.opt(f.RETRY_BACKOFF), now, now) if retry_in is None else {"$add": [now, retry_in * 1000]}
    )
    counters = {f.FAILURES: {"$add": [tally(f.FAILURES), 1]}, f.RUN_AT: {"$max": [f.ref(f.RUN_AT), later]}}
    return [update_entry(run_id, changes), {"$set": counters}, *summarize(now), announce()]


def snooze(run_id: str, seconds: float, now: Expr = NOW) -> list[Expr]:
    """``rules.snooze``: drop the run's entry, run again ``seconds`` from server now."""
    keep = {"$ne": [_w(f.RUN_ID), {"$literal": run_id}]}
    snoozes = {"$add": [tally(f.SNOOZES), 1]}
    later = {"$add": [now, seconds * 1000]}
    return [{"$set": {f.WORKERS: entries(keep), f.RUN_AT: later, f.SNOOZES: snoozes}}, *summarize(now)]


def release(run_id: str, now: Expr = NOW) -> list[Expr]:
    keep = {"$ne": [_w(f.RUN_ID), {"$literal": run_id}]}
    return [{"$set": {f.WORKERS: entries(keep)}}, *summarize(now)]


def cancelable(key: str) -> dict[str, Any]:
    """``rules.cancelable``: the task of ``key`` unless it ended SUCCESS or FAIL, which a
    cancel leaves as it is (``updated_at`` included)."""
    done = {"$in": [f.ref(f.STATE), [TaskState.SUCCESS.value, TaskState.FAIL.value]]}
    return {f.KEY: key, "$expr": _not(done)}


def cancel(now: Expr = NOW) -> list[Expr]:
    """``rules.cancel`` under ``cancelable``."""
    return [
        {"$set": {f.STATE: TaskState.CANCELED.value}},
        {"$unset": [f.CANCELED_BY]},
        *summarize(now),
        announce(),
    ]


def start_time(run_at: Any, delay: float | None, now: Expr = NOW) -> Expr:
    """``rules.start_time``: the given ``run_at``, or ``now`` plus ``delay`` seconds."""
    if run_at is not None:
        return run_at
    return {"$add": [now, delay * 1000]} if delay else now


def publish(
    new: dict[str, Any],
    run_at: Any,
    *,
    update: rules.PendingChanges | None,
    republish_finished: bool,
    now: Expr = NOW,
) -> list[Expr]:
    """Upsert pipeline: insert ``new`` if the key is new, else apply the chosen option:
    ``update`` (``update_pending``) rewrites those changes where ``updatable``.

    An existing task that no option applies to is returned unchanged: no write.
    ``run_at`` is a datetime or ``$$NOW`` (server time).
    """
    times = {f.CREATED_AT: now, f.UPDATED_AT: now, f.RUN_AT: run_at, f.CLAIMABLE_AT: run_at}
    if new[f.STATE] == WAITING:
        del times[f.CLAIMABLE_AT]
    # A document replaced keeps its _id (an upsert's seed has none yet: it gets new's), and
    # what ``rules.carried`` says.
    carried = {
        "$cond": [
            {"$eq": [f.ref(f.DEPENDENTS), True]},
            {f.DEPENDENTS: True, f.NOTIFY: bumped(f.NOTIFY)},
            {},
        ]
    }
    fresh = {"$mergeObjects": [NEW, times, {f.ID: {"$ifNull": [f.ref(f.ID), new[f.ID]]}}, carried]}
    seed = {"$lte": [{"$size": {"$objectToArray": "$$ROOT"}}, 2]}  # rules.is_seed
    branches = [{"case": seed, "then": fresh}]
    if republish_finished:
        branches.append({"case": {"$in": [f.ref(f.STATE), list(FINISHED)]}, "then": fresh})
    stages: list[Expr] = []
    if update is not None:
        branches.append({"case": updatable(), "then": pending_update(update, run_at, now)})
        stages = pending_update_summary(now)
    # ``new`` is sent once, bound to $$new: params of up to 16 MiB written twice would make
    # the command larger than MongoDB takes (16 MiB plus 16 KiB).
    chosen = {"$switch": {"branches": branches, "default": "$$ROOT"}}
    return [{"$replaceWith": {"$let": {"vars": {"new": {"$literal": new}}, "in": chosen}}}, *stages]


NEW = "$$new"
"""The new document inside ``publish`` (the ``$let`` variable)."""


def updatable() -> Expr:
    """``rules.updatable``: PENDING, and no worker running it or done with it."""
    started = count({"$or": [IS_RUNNING, IS_SUCCESS]})
    return {"$and": [{"$in": [f.ref(f.STATE), [TaskState.PENDING.value, WAITING]]}, {"$eq": [started, 0]}]}


def pending_update(update: rules.PendingChanges, run_at: Any, now: Expr) -> Expr:
    """``rules.pending_update``: set only what the publish call named."""
    # Params come from $$new (``publish``'s $let): the command carries them only once.
    changes: dict[str, Expr] = {
        name: f"{NEW}.{name}" if name == f.PARAMS else {"$literal": value}
        for name, value in update.fields.items()
    }
    if update.options:
        is_object = {"$eq": [{"$type": f.ref(f.OPTIONS)}, "object"]}
        merged = {"$mergeObjects": [f.ref(f.OPTIONS), {"$literal": update.options}]}
        changes[f.OPTIONS] = {"$cond": [is_object, merged, {"$literal": update.whole_options}]}
    claimable: Expr = {}
    if update.run_time:
        changes[f.RUN_AT] = run_at
        # A WAITING task gets its claimable_at when released.
        claimable = {"$cond": [{"$eq": [f.ref(f.STATE), WAITING]}, {}, {f.CLAIMABLE_AT: run_at}]}
    changes[f.UPDATED_AT] = now
    budget = update.options.get(f.MAX_FAILURES)
    if budget is not None:
        spent = {"$gte": [tally(f.FAILURES), budget]}
        changes[f.STATE] = {"$cond": [spent, TaskState.FAIL.value, f.ref(f.STATE)]}
    changes["_tr_updated"] = True
    return {"$mergeObjects": ["$$ROOT", changes, claimable]}


def pending_update_summary(now: Expr) -> list[Expr]:
    """After ``update_pending`` (and only then): a task whose spent budget ended it FAIL
    loses ``claimable_at`` and gets its ``finished_at``; one left PENDING has none."""
    updated = {"$eq": ["$_tr_updated", True]}
    ended = {"$and": [updated, {"$eq": [f.ref(f.STATE), TaskState.FAIL.value]}]}
    changes = {
        f.CLAIMABLE_AT: {"$cond": [ended, "$$REMOVE", f.ref(f.CLAIMABLE_AT)]},
        f.FINISHED_AT: {"$cond": [updated, finished_at(now), f.ref(f.FINISHED_AT)]},
        f.NOTIFY: {"$cond": [ended, _announced(), f.ref(f.NOTIFY)]},
    }
    return [{"$set": changes}, {"$unset": ["_tr_updated"]}]


def _announced() -> Expr:
    """``notify`` as ``announce`` leaves it on a task that just ended."""
    return {"$cond": [{"$eq": [f.ref(f.DEPENDENTS), True]}, bumped(f.NOTIFY), f.ref(f.NOTIFY)]}


def retryable(key: str, now: Expr = NOW) -> dict[str, Any]:
    """``rules.retry`` applies: FAIL or CANCELED, and no run still holds a live lease."""
    return {f.KEY: key, f.STATE: {"$in": list(RETRYABLE)}, "$expr": {"$eq": [count(is_live(now)), 0]}}


def trim_failed_runs() -> Expr:
    """``rules.trim_failed_runs``: keep the last ``max_failures + concurrency - 1`` FAIL entries."""
    numbers = [_is_number(f.opt(f.CONCURRENCY)), _is_number(f.opt(f.MAX_FAILURES))]
    at_least_one = [{"$gte": [CONCURRENCY, 1]}, {"$gte": [MAX_FAILURES, 1]}]
    readable = {"$and": [{"$isArray": f.ref(f.WORKERS)}, *numbers, *at_least_one]}
    keep = {"$subtract": [{"$add": [MAX_FAILURES, CONCURRENCY]}, 1]}
    failed = {"$eq": ["$$this.state", EntryState.FAIL.value]}
    dropped = {"$lt": [{"$add": ["$$value.seen", "$$keep"]}, "$$failed"]}
    step = {
        "$cond": [
            failed,
            {
                "out": {"$cond": [dropped, "$$value.out", {"$concatArrays": ["$$value.out", ["$$this"]]}]},
                "seen": {"$add": ["$$value.seen", 1]},
            },
            {"out": {"$concatArrays": ["$$value.out", ["$$this"]]}, "seen": "$$value.seen"},
        ]
    }
    walk = {"$reduce": {"input": WORKERS, "initialValue": {"out": [], "seen": 0}, "in": step}}
    trimmed = {"$let": {"vars": {"r": walk}, "in": "$$r.out"}}
    counted = {"$let": {"vars": {"keep": keep, "failed": count(IS_FAIL)}, "in": trimmed}}
    return {"$set": {f.WORKERS: {"$cond": [readable, counted, f.ref(f.WORKERS)]}}}


def retry(now: Expr = NOW, trace: Mapping[str, str] | None = None) -> list[Expr]:
    """``rules.retry``; the filter limits it to FAIL and CANCELED tasks."""
    unreadable = [_not(_is_number(f.opt(f.CONCURRENCY))), _not(_is_number(f.opt(f.MAX_FAILURES)))]
    reason = {"$ifNull": [f.ref(f"{f.ERROR}.{f.ERROR_TYPE}"), None]}
    own_error = {
        "$and": [
            {"$eq": [{"$type": f.ref(f.ERROR)}, "object"]},
            _not({"$in": [reason, list(CANCEL_REASONS)]}),
        ]
    }
    recheck = {"$or": [own_error, *unreadable]}
    waiting = {"$and": [{"$isArray": f.ref(f.WAITING_ON)}, {"$gt": [{"$size": f.ref(f.WAITING_ON)}, 0]}]}
    fresh = {
        f.STATE: {"$cond": [waiting, WAITING, TaskState.PENDING.value]},
        f.FAILURES: 0,
        f.RUN_AT: now,
        f.LINK: {"$cond": [waiting, bumped(f.LINK), f.ref(f.LINK)]},
        f.NOTIFY: {"$cond": [{"$eq": [f.ref(f.DEPENDENTS), True]}, bumped(f.NOTIFY), f.ref(f.NOTIFY)]},
        "_tr_recheck": recheck,
    }
    # A document to check again keeps PENDING and loses claimable_at: the next sweep normalizes it.
    again = {
        f.STATE: {"$cond": ["$_tr_recheck", fresh[f.STATE], f.ref(f.STATE)]},
        f.CLAIMABLE_AT: {"$cond": ["$_tr_recheck", "$$REMOVE", f.ref(f.CLAIMABLE_AT)]},
        f.FINISHED_AT: {"$cond": ["$_tr_recheck", "$$REMOVE", f.ref(f.FINISHED_AT)]},
    }
    return [
        trim_failed_runs(),
        {"$set": fresh},
        {"$unset": [f.FATAL, f.ERROR, f.CANCELED_BY]},
        *summarize(now),
        {"$set": again},
        {"$unset": ["_tr_recheck"]},
        *([{"$set": {f.TRACE: {"$literal": dict(trace)}}}] if trace else []),
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


def unsettled() -> dict[str, Any]:
    """Documents a sweep hands to ``Store.normalize`` (``rules.unsettled``)."""
    return {"$or": unsettled_branches()}


def _if_missing(field: str, value: Expr) -> Expr:
    """``value`` where ``field`` is missing, else the field as it is."""
    return {"$cond": [_missing(field), value, f.ref(field)]}


def normalize(fill: dict[str, Any], now: Expr = NOW) -> list[Expr]:
    """``rules.normalize`` without the mark: set each field of ``fill`` only if it
    is still missing when the write lands (a racing worker's write wins, unchanged), times
    in server time; options merged under those given; claimable_at from the run_at set."""
    stage: dict[str, Expr] = {
        field: _if_missing(field, now if field in STAMPED else {"$literal": value})
        for field, value in fill.items()
        if field not in (f.OPTIONS, f.CLAIMABLE_AT)
    }
    if f.OPTIONS in fill:
        given = {"$eq": [{"$type": f.ref(f.OPTIONS)}, "object"]}
        merged = {"$mergeObjects": [{"$literal": fill[f.OPTIONS]}, f.ref(f.OPTIONS)]}
        stage[f.OPTIONS] = {"$cond": [given, merged, _if_missing(f.OPTIONS, {"$literal": fill[f.OPTIONS]})]}
    stages: list[Expr] = [{"$set": {**stage, f.UPDATED_AT: now}}]
    if f.CLAIMABLE_AT in fill:
        unfinished = {"$and": [_missing(f.CLAIMABLE_AT), {"$in": [f.ref(f.STATE), list(ACTIVE)]}]}
        keep = {"$cond": [_missing(f.CLAIMABLE_AT), "$$REMOVE", f.ref(f.CLAIMABLE_AT)]}
        stages.append({"$set": {f.CLAIMABLE_AT: {"$cond": [unfinished, f.ref(f.RUN_AT), keep]}}})
    return stages


def mark(problem: str, now: Expr = NOW) -> list[Expr]:
    """The mark of ``rules.normalize``: FAIL, ``fatal``, the document's own error."""
    mark = {f.STATE: TaskState.FAIL.value, f.FATAL: True, f.ERROR: {"$literal": marked_error(problem)}}
    return [
        {"$set": {**mark, f.FINISHED_AT: now, f.UPDATED_AT: now}},
        {"$unset": [f.CLAIMABLE_AT]},
        announce(),
    ]


def unchanged(doc: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """Matches only while each top-level field of ``fields`` holds what ``doc`` held (or is
    still missing): a mark lands only on the document it judged."""
    present = [{"$eq": [f.ref(name), {"$literal": doc[name]}]} for name in fields if name in doc]
    missing: dict[str, Any] = {name: {"$exists": False} for name in fields if name not in doc}
    return {**missing, "$expr": {"$and": present}} if present else missing


def purgeable(states: list[str], older_than_ms: float, now: Expr = NOW) -> dict[str, Any]:
    """Finished tasks in ``states`` whose ``finished_at`` is older than the cutoff (server time)."""
    cutoff = {"$subtract": [now, older_than_ms]}
    return {
        f.STATE: {"$in": states},
        f.FINISHED_AT: {"$type": "date"},
        "$expr": {"$and": [is_date(f.FINISHED_AT), {"$lt": [f.ref(f.FINISHED_AT), cutoff]}]},
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


def pinned_away(live: Sequence[str], examples: int) -> list[Expr]:
    """``Store.pinned_away`` as one aggregate; its ``$match`` implies the ``pinned`` index's
    partial filter (a worker_ids string, a state between PENDING and RUNNING), so only
    unfinished pinned tasks are read."""
    worker_ids = f"{f.OPTIONS}.{f.WORKER_IDS}"
    return [
        {
            "$match": {
                f.STATE: {"$in": list(ACTIVE)},
                worker_ids: {"$type": "string", "$nin": list(live)},
                f.KEY: {"$type": "string"},
            }
        },
        {"$sort": {f.KEY: 1}},
        {"$group": {"_id": f.ref(worker_ids), "tasks": {"$sum": 1}, "keys": {"$push": f.ref(f.KEY)}}},
        {"$project": {"tasks": 1, "keys": {"$slice": ["$keys", examples]}}},
        {"$sort": {"tasks": -1, "_id": 1}},
    ]


def throttle_update(seconds: float, now: Expr = NOW) -> list[Expr]:
    """``throttled_until`` at least server now plus ``seconds`` (``RateLimited``)."""
    until = {"$add": [now, seconds * 1000]}
    is_date = {"$eq": [{"$type": f.ref(f.THROTTLED_UNTIL)}, "date"]}
    current = {"$cond": [is_date, f.ref(f.THROTTLED_UNTIL), until]}
    return [{"$set": {f.THROTTLED_UNTIL: {"$max": [current, until]}, f.UPDATED_AT: now}}]


def throttle_gate_update(gate: str, seconds: float, now: Expr = NOW) -> list[Expr]:
    """``throttled_gates`` keeps the other gates' live throttles and holds ``gate`` until
    at least server now plus ``seconds``."""
    listed = {"$cond": [{"$isArray": f.ref(f.THROTTLED_GATES)}, f.ref(f.THROTTLED_GATES), []]}
    until = {"$add": [now, seconds * 1000]}
    this, other = ({op: [f"$$t.{f.GATE}", {"$literal": gate}]} for op in ("$eq", "$ne"))
    live = {"$gt": [f"$$t.{f.UNTIL}", now]}
    others = {"$filter": {"input": listed, "as": "t", "cond": {"$and": [other, live]}}}
    same = {"$filter": {"input": listed, "as": "t", "cond": this}}
    longest = {
        "$reduce": {"input": same, "initialValue": until, "in": {"$max": ["$$value", f"$$this.{f.UNTIL}"]}}
    }
    entry = {f.GATE: {"$literal": gate}, f.UNTIL: longest}
    return [{"$set": {f.THROTTLED_GATES: {"$concatArrays": [others, [entry]]}, f.UPDATED_AT: now}}]


def window_filter(start: datetime, end: datetime, now: Expr = NOW) -> dict[str, Any]:
    """Matches only while the clock (``now``) is in ``[start, end]`` (a gate's permit)."""
    return {"$expr": {"$and": [{"$gte": [now, start]}, {"$lte": [now, end]}]}}


# -- workflows (``rules.settle``) ------------------------------------------------------------------
def settleable(keys: Sequence[str]) -> dict[str, Any]:
    """``rules.settleable``: runs after one of ``keys`` (the ``after`` index), and is WAITING
    or was canceled by an upstream."""
    canceled = {f.STATE: TaskState.CANCELED.value, f.CANCELED_BY: {"$exists": True}}
    return {f.AFTER: {"$in": list(keys)}, "$or": [{f.STATE: WAITING}, canceled]}


def _array(path: str) -> Expr:
    return {"$cond": [{"$isArray": f.ref(path)}, f.ref(path), []]}


def settle(heard: Heard, now: Expr = NOW) -> list[Expr]:
    """``rules.settle`` for upstream states just read. Set differences keep the first
    array's order (MongoDB's ``$setDifference`` does), so a fan-in's long ``waiting_on``
    costs one pass, not one per upstream heard of."""
    run_anyway = {"$eq": [f.ref(f.ON_UPSTREAM_FAILURE), RUN_ANYWAY]}
    succeeded = {"$literal": heard.where((TaskState.SUCCESS.value,))}
    met = {"$cond": [run_anyway, {"$literal": heard.where(FINISHED)}, succeeded]}
    failed = {"$literal": heard.where(FAILED)}
    newly = {"$filter": {"input": f.ref(f.WAITING_ON), "as": "k", "cond": {"$in": ["$$k", failed]}}}
    added = {"$cond": [run_anyway, [], {"$setDifference": [newly, "$_tr_kept"]}]}
    any_in = {"$gt": [{"$size": "$_tr_by"}, 0]}
    state = {
        "$switch": {
            "branches": [
                {"case": any_in, "then": TaskState.CANCELED.value},
                {"case": {"$gt": [{"$size": f.ref(f.WAITING_ON)}, 0]}, "then": WAITING},
            ],
            "default": TaskState.PENDING.value,
        }
    }
    return [
        {
            "$set": {
                "_tr_was": f.ref(f.STATE),
                f.WAITING_ON: {"$setDifference": [_array(f.WAITING_ON), met]},
                "_tr_kept": {
                    "$setDifference": [_array(f.CANCELED_BY), {"$literal": heard.where(FAILED, inside=False)}]
                },
            }
        },
        {"$set": {"_tr_by": {"$concatArrays": ["$_tr_kept", added]}}},
        {
            "$set": {
                f.STATE: state,
                f.UPDATED_AT: now,
                f.CANCELED_BY: {"$cond": [any_in, "$_tr_by", "$$REMOVE"]},
            }
        },
        _settled_times(heard, now),
        {"$unset": ["_tr_was", "_tr_kept", "_tr_by"]},
    ]


def _settled_times(heard: Heard, now: Expr) -> Expr:
    """``rules._settled_times`` where ``settle`` changed the state (``$_tr_was``), and the
    ``notify`` owed for a change into or out of CANCELED."""
    moved = {"$ne": [f.ref(f.STATE), "$_tr_was"]}
    is_pending = {"$eq": [f.ref(f.STATE), TaskState.PENDING.value]}
    is_canceled = {"$eq": [f.ref(f.STATE), TaskState.CANCELED.value]}
    canceled_either = {"$or": [is_canceled, {"$eq": ["$_tr_was", TaskState.CANCELED.value]}]}
    owed = {"$and": [moved, canceled_either, {"$eq": [f.ref(f.DEPENDENTS), True]}]}

    def when_moved(then: Expr, field: str) -> Expr:
        return {"$cond": [moved, then, f.ref(field)]}

    return {
        "$set": {
            f.CLAIMABLE_AT: when_moved({"$cond": [is_pending, RUN_AT, "$$REMOVE"]}, f.CLAIMABLE_AT),
            f.FINISHED_AT: when_moved({"$cond": [is_canceled, now, "$$REMOVE"]}, f.FINISHED_AT),
            f.ERROR: when_moved({"$cond": [is_canceled, upstream_error(heard), "$$REMOVE"]}, f.ERROR),
            f.NOTIFY: {"$cond": [owed, bumped(f.NOTIFY), f.ref(f.NOTIFY)]},
        }
    }


def upstream_error(heard: Heard) -> Expr:
    """``rules.upstream_error`` of the first key in ``canceled_by``."""
    first = {"$arrayElemAt": [f.ref(f.CANCELED_BY), 0]}
    named = {"$eq": [{"$type": "$$first"}, "string"]}
    keys, states = {"$literal": heard.keys}, {"$literal": list(heard.states.values())}
    at = {"$indexOfArray": [keys, "$$first"]}
    state = {"$cond": [{"$and": [named, {"$gte": [at, 0]}]}, {"$arrayElemAt": [states, at]}, UNHEARD]}
    name = {"$cond": [named, "$$first", "?"]}
    message = {"$concat": ["upstream '", name, "' ended ", state, "; retrying it re-arms this task"]}
    error = {f.ERROR_TYPE: f.UPSTREAM_FAILED, f.ERROR_MESSAGE: message, f.ERROR_TRACEBACK: None}
    return {"$let": {"vars": {"first": first}, "in": error}}


def markable(keys: Sequence[str]) -> dict[str, Any]:
    """``rules.markable``: through the key index."""
    unmarked_or_ended = [{f.DEPENDENTS: {"$ne": True}}, {f.STATE: {"$in": list(FINISHED)}}]
    return {f.KEY: {"$in": list(keys)}, "$or": unmarked_or_ended}


def mark_upstream() -> list[Expr]:
    """``rules.mark_upstream``."""
    ended = {"$in": [f.ref(f.STATE), list(FINISHED)]}
    return [{"$set": {f.DEPENDENTS: True, f.NOTIFY: {"$cond": [ended, bumped(f.NOTIFY), f.ref(f.NOTIFY)]}}}]


def stoppable(flow: str) -> dict[str, Any]:
    """``rules.stoppable``: the flow's unstarted steps, through the ``flow`` index."""
    return {
        f.FLOW: flow,
        f.STATE: {"$in": [WAITING, TaskState.PENDING.value]},
        f.WORKERS: {"$size": 0},
        f.COMPENSATES: {"$exists": False},
    }


def stop(error: dict[str, Any], now: Expr = NOW) -> list[Expr]:
    """``rules.stop``."""
    canceled = {f.STATE: TaskState.CANCELED.value, f.FINISHED_AT: now, f.UPDATED_AT: now}
    return [
        {"$set": {**canceled, f.ERROR: {"$literal": error}}},
        {"$unset": [f.CLAIMABLE_AT, f.CANCELED_BY]},
        announce(),
    ]


def owes_follow_up() -> dict[str, Any]:
    """Tasks owing a follow-up (``notify`` or ``link``), each through its small index; only
    string keys (a hand-written document without one could never be followed up, and would
    fill every sweep's page)."""
    return {"$or": [{f.NOTIFY: {"$exists": True}}, {f.LINK: {"$exists": True}}], f.KEY: {"$type": "string"}}
