"""The task state machine as plain Python over raw documents.

The in-memory store runs it; ``store/expressions.py`` states the same rules as MongoDB
filters and pipelines, which the Mongo store sends. Where a filter states a rule, the rule
reads fields as MongoDB's query language does (an array by its elements, a comparison with a
date matching dates only); a claim-time field that is missing, null or not a date never
matches.

The two modules are twins: each rule has one name in both. A predicate is an adjective
and a write a verb or noun: ``rules.claimable(doc, worker_id, now)`` says whether the
filter ``expressions.claimable(worker_id, now)`` matches ``doc``, and ``rules.claim(doc,
worker_id, run_id, now)`` changes ``doc`` as the pipeline ``expressions.claim(worker_id,
run_id, now)`` changes the stored document (likewise ``summarize``, ``fresh_claimable`` /
``fresh_claim``, ``reapable``, ``renewable`` / ``ping``, ``running_entry`` / ``succeed`` /
``fail`` / ``snooze`` / ``release``, ``cancelable`` / ``cancel``, ``updatable`` /
``pending_update`` (both given ``pending_changes``), ``sweepable``, ``unsettled``, ``hears``, ``normalize``, ``retryable`` /
``retry``, ``purgeable``, ``in_bucket_range``). ``tests/contract/test_twins.py`` runs each pair on
generated documents and compares (docs/design.md, "One set of rules, twice").
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, overload

from bson import DatetimeMS
from pydantic import ValidationError

from taskrunner.errors import InvalidState, MalformedTask
from taskrunner.models import EntryState, NewTask, Task, TaskOptions, TaskState
from taskrunner.store import fields as f
from taskrunner.store.base import RunStatus

Doc = dict[str, Any]
FINISHED = (TaskState.SUCCESS.value, TaskState.FAIL.value, TaskState.CANCELED.value)
WAITING = TaskState.WAITING.value
ACTIVE = (TaskState.PENDING.value, TaskState.RUNNING.value)
DATES = datetime | DatetimeMS


def _num(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None  # type: ignore[arg-type]


# -- MongoDB's query language (find, $match, update filters), where a filter states a rule --
# A predicate on a field tests the value and, for an array, each element; a comparison with
# a date matches dates only (type bracketing). Aggregation expressions (``$expr``, update
# pipelines) do neither: there an array is one value, compared as an array; the rules that
# those state read fields as plain Python does.


def _query_values(value: Any) -> list[Any]:
    """What a query predicate on a field tests: the value and, for an array, each element."""
    return [value, *value] if isinstance(value, list) else [value]


def is_one_of(value: Any, targets: Collection[str]) -> bool:
    """``{field: {$in: targets}}`` (or ``{field: target}``) for strings; ``$nin`` and ``$ne``
    are its negation (a missing field included)."""
    return any(isinstance(v, str) and v in targets for v in _query_values(value))


def has_string(value: Any) -> bool:
    """``{field: {$type: "string"}}``."""
    return any(isinstance(v, str) for v in _query_values(value))


def date_at_most(value: Any, bound: datetime) -> bool:
    """``{field: {$lte: bound}}`` for a date ``bound``: a date at most ``bound``, or an array
    holding one."""
    return any(isinstance(v, datetime) and v <= bound for v in _query_values(value))


def date_after(value: Any, bound: datetime) -> bool:
    """``{field: {$type: "date", $gt: bound}}``: a date after ``bound``, or an array holding one."""
    return any(isinstance(v, datetime) and v > bound for v in _query_values(value))


def allows(doc: Doc, worker_id: str) -> bool:
    """``options.worker_ids`` is empty or names the worker, as the filters' ``$or`` of
    ``{$size: 0}`` and equality judge it (a string equal to the id names it too)."""
    allowed = option(doc, f.WORKER_IDS)
    return allowed == [] or is_one_of(allowed, (worker_id,))


def tally(value: Any) -> Any:
    """A counter (``failures``, ``attempts``, ``snoozes``) as written, or 0 when it is not a
    number: a hand-broken counter counts as none, and the next write makes it one."""
    return value if _num(value) is not None else 0


def _entries(doc: Doc) -> list[Doc]:
    workers = doc.get(f.WORKERS)
    return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else []


def is_running(entry: Doc) -> bool:
    return entry.get(f.STATE) == EntryState.RUNNING.value


def is_live(entry: Doc, now: datetime) -> bool:
    expires = entry.get(f.EXPIRES_AT)
    return is_running(entry) and isinstance(expires, datetime) and expires > now


def is_expired(entry: Doc, now: datetime) -> bool:
    return is_running(entry) and not is_live(entry, now)


def successes(doc: Doc) -> int:
    return sum(w.get(f.STATE) == EntryState.SUCCESS.value for w in _entries(doc))


def option(doc: Doc, name: str) -> Any:
    opts = doc.get(f.OPTIONS)
    return opts.get(name) if isinstance(opts, dict) else None


def summarize(doc: Doc, now: datetime) -> None:
    """Recompute ``state`` and ``claimable_at`` (and ``updated_at``) in place."""
    doc[f.STATE] = _summary_state(doc)
    doc[f.UPDATED_AT] = now
    if doc[f.STATE] in FINISHED:
        doc.pop(f.CLAIMABLE_AT, None)
        if not isinstance(doc.get(f.FINISHED_AT), datetime):
            doc[f.FINISHED_AT] = now
        return
    doc.pop(f.FINISHED_AT, None)
    if doc[f.STATE] == WAITING:
        doc.pop(f.CLAIMABLE_AT, None)  # claimable once released (``settle``)
        return
    live = [w for w in _entries(doc) if is_live(w, now)]
    concurrency = _num(option(doc, f.CONCURRENCY))
    run_at: Any = doc.get(f.RUN_AT)
    if concurrency is not None and successes(doc) + len(live) < concurrency:
        doc[f.CLAIMABLE_AT] = run_at
    else:
        # Slots are full: a slot frees when the earliest live lease expires, so a new
        # claimer is not woken before then.
        earliest = min((w[f.EXPIRES_AT] for w in live), default=run_at)
        doc[f.CLAIMABLE_AT] = max(run_at, earliest) if isinstance(run_at, datetime) else earliest


def _summary_state(doc: Doc) -> str:
    concurrency = _num(option(doc, f.CONCURRENCY))
    max_failures = _num(option(doc, f.MAX_FAILURES))
    failures = tally(doc.get(f.FAILURES))
    if doc.get(f.STATE) in (TaskState.CANCELED.value, WAITING):
        return str(doc[f.STATE])
    if doc.get(f.FATAL) is True:
        return TaskState.FAIL.value
    if concurrency is None or successes(doc) >= concurrency:
        return TaskState.SUCCESS.value
    if any(is_running(w) for w in _entries(doc)):
        return TaskState.RUNNING.value
    if max_failures is None or failures >= max_failures:
        return TaskState.FAIL.value
    return TaskState.PENDING.value


def fresh(doc: Doc) -> bool:
    """Nobody ran this task yet: PENDING with no entries, not ``fatal`` (what ``fresh`` claims take)."""
    pending = is_one_of(doc.get(f.STATE), (TaskState.PENDING.value,))
    return pending and doc.get(f.WORKERS) == [] and doc.get(f.FATAL) is not True


def fresh_claimable(doc: Doc, worker_id: str, now: datetime) -> bool:
    """What a ``fresh`` claim takes: ``fresh`` and ``claimable`` (then ``claim`` applies)."""
    return fresh(doc) and claimable(doc, worker_id, now)


def claimable(doc: Doc, worker_id: str, now: datetime) -> bool:
    """May ``worker_id`` claim this task at server time ``now``? (the claim filter)"""
    claimable_at = doc.get(f.CLAIMABLE_AT)
    if not is_one_of(doc.get(f.STATE), ACTIVE) or not isinstance(claimable_at, datetime):
        return False  # an array holding a date is not one: a sweep finds it, normalizing marks it
    if not isinstance(doc.get(f.WORKERS), list) or not allows(doc, worker_id):
        return False
    if claimable_at > now or numbers(doc) is None:
        return False
    entries = _entries(doc)
    mine = [w for w in entries if w.get(f.WORKER_ID) == worker_id]
    mine_active = any(w.get(f.STATE) == EntryState.SUCCESS.value or is_live(w, now) for w in mine)
    return (not mine_active and _has_budget(doc, entries, now)) or reapable(doc, now)


def numbers(doc: Doc) -> tuple[float, float, float] | None:
    """Concurrency, max_failures and failures, when all three are numbers."""
    values = (_num(option(doc, f.CONCURRENCY)), _num(option(doc, f.MAX_FAILURES)), _num(doc.get(f.FAILURES)))
    return None if None in values else values  # type: ignore[return-value]


def _has_budget(doc: Doc, entries: list[Doc], now: datetime) -> bool:
    concurrency, max_failures, failures = numbers(doc) or (0.0, 0.0, 0.0)
    expired = sum(is_expired(w, now) for w in entries)
    live = sum(is_live(w, now) for w in entries)
    return failures + expired < max_failures and successes(doc) + live < concurrency


def reapable(doc: Doc, now: datetime) -> bool:
    """Only dead leases remain and counting them spends the budget: the task must end FAIL.

    The claim that finds such a task drops those leases and adds no entry, so a task
    whose last allowed run died does not stay RUNNING forever."""
    counters, entries = numbers(doc), _entries(doc)
    if counters is None or any(is_live(w, now) for w in entries):
        return False
    expired = sum(is_expired(w, now) for w in entries)
    return expired > 0 and counters[2] + expired >= counters[1]


LEASE_EXPIRED: Doc = {
    f.ERROR_TYPE: "LeaseExpired",
    f.ERROR_MESSAGE: "the worker stopped renewing its lease (it died, hung or lost the server) "
    "and no failure budget was left to run the task again",
    f.ERROR_TRACEBACK: None,
}
"""The error a reaped task's dead runs end with, so the FAIL document says why."""


def claim(doc: Doc, worker_id: str, run_id: str, now: datetime) -> None:
    """Drop expired leases (each spends one failure), append this worker's entry
    (none when the task is ``reapable``: then it ends, its dead runs kept as FAIL entries)."""
    reap = reapable(doc, now)  # decided before the expired leases are counted
    entries = _entries(doc)
    expired = [w for w in entries if is_expired(w, now)]
    doc[f.FAILURES] = doc[f.FAILURES] + len(expired)
    if reap:
        for dead in expired:
            dead.update({f.STATE: EntryState.FAIL.value, f.ERROR: dict(LEASE_EXPIRED), f.FINISHED_AT: now})
        summarize(doc, now)
        announce(doc)
        return
    attempt = tally(doc.get(f.ATTEMPTS)) + 1
    expires_at = after(now, option(doc, f.PING_TIMEOUT))
    entry = new_entry(worker_id, run_id, now, expires_at, attempt, [w.get(f.WORKER_ID) for w in expired])
    doc[f.ATTEMPTS] = attempt
    # Whatever else the list holds stays (an entry that is not an object is kept as written).
    doc[f.WORKERS] = [w for w in doc[f.WORKERS] if not (isinstance(w, dict) and is_expired(w, now))] + [entry]
    summarize(doc, now)
    announce(doc)  # a claim on a ``fatal`` task (written by hand) ends it


def new_entry(worker_id: Any, run_id: Any, now: Any, expires_at: Any, attempt: Any, took_over: Any) -> Doc:
    """The RUNNING entry a claim appends, in the field order the mongo shell shows.
    ``expressions.new_entry`` passes server expressions for the values."""
    return {
        f.WORKER_ID: worker_id,
        f.RUN_ID: run_id,
        f.STATE: EntryState.RUNNING.value,
        f.CLAIMED_AT: now,
        f.PING_AT: now,
        f.EXPIRES_AT: expires_at,
        f.ATTEMPT: attempt,
        f.PROGRESS: None,
        f.RESULT: None,
        f.ERROR: None,
        f.FINISHED_AT: None,
        f.TOOK_OVER: took_over,
    }


def claim_order(doc: Doc) -> tuple[float, str, str]:
    """Priority descending, then oldest (the claim sort), total even for odd field types."""
    created = doc.get(f.CREATED_AT)
    return (
        -(_num(doc.get(f.PRIORITY)) or 0.0),
        created.isoformat() if isinstance(created, datetime) else "",
        str(doc.get(f.ID)),
    )


def running_entry(doc: Doc, run_id: str) -> Doc | None:
    """The RUNNING entry of ``run_id``: the fencing check every state write makes (an
    ``$elemMatch``, so a state ``["RUNNING"]`` passes it)."""
    running = (EntryState.RUNNING.value,)
    return next(
        (w for w in _entries(doc) if w.get(f.RUN_ID) == run_id and is_one_of(w.get(f.STATE), running)), None
    )


def renewal_status(doc: Doc | None, run_id: str, worker_id: str) -> RunStatus:
    """Whether a lease renewal for ``run_id`` may land on ``doc`` (DONE) or why not."""
    if doc is None or running_entry(doc, run_id) is None:
        return RunStatus.LOST
    if is_one_of(doc.get(f.STATE), (TaskState.CANCELED.value,)):
        return RunStatus.CANCELED
    if not allows(doc, worker_id):
        return RunStatus.NOT_ALLOWED
    return RunStatus.DONE


def renewable(doc: Doc, run_id: str, worker_id: str) -> bool:
    """A lease renewal lands (``renewal_status`` is DONE)."""
    return renewal_status(doc, run_id, worker_id) is RunStatus.DONE


def outcome_status(doc: Doc | None, run_id: str, state: EntryState) -> RunStatus:
    """DONE when the run's entry holds the outcome ``state`` (written now or before), else LOST."""
    entries = _entries(doc) if doc is not None else []
    done = any(w.get(f.RUN_ID) == run_id and w.get(f.STATE) == state.value for w in entries)
    return RunStatus.DONE if done else RunStatus.LOST


@overload
def after(now: datetime, seconds: Any, otherwise: datetime) -> datetime: ...
@overload
def after(now: datetime, seconds: Any, otherwise: None = None) -> datetime | None: ...
def after(now: datetime, seconds: Any, otherwise: datetime | None = None) -> datetime | None:
    """``now`` plus ``seconds``, or ``otherwise`` when that is not a number (a lease whose
    ``ping_timeout`` does not read has no expiry: it counts as expired)."""
    number = _num(seconds)
    return otherwise if number is None else now + timedelta(seconds=number)


def ping(doc: Doc, entry: Doc, now: datetime, progress: Any = None) -> None:
    entry[f.PING_AT] = now
    entry[f.EXPIRES_AT] = after(now, option(doc, f.PING_TIMEOUT))
    if progress is not None:
        entry[f.PROGRESS] = progress
    summarize(doc, now)


def succeed(doc: Doc, entry: Doc, result: Any, now: datetime, progress: Any = None) -> None:
    """Record the success, and the run's last ``progress`` unless None."""
    entry.update({f.STATE: EntryState.SUCCESS.value, f.RESULT: result, f.FINISHED_AT: now})
    if progress is not None:
        entry[f.PROGRESS] = progress
    summarize(doc, now)
    announce(doc)


def fail(
    doc: Doc,
    entry: Doc,
    error: Doc,
    now: datetime,
    retry_in: float | None = None,
    final: bool = False,
    progress: Any = None,
) -> None:
    """Record the failure, and the run's last ``progress`` unless None. A ``final`` one ends
    the task FAIL (``fatal``) without spending budget; otherwise it counts, and the task
    is claimable again ``retry_in`` seconds from now (None: ``retry_backoff``)."""
    entry.update({f.STATE: EntryState.FAIL.value, f.ERROR: error, f.FINISHED_AT: now})
    if progress is not None:
        entry[f.PROGRESS] = progress
    if final:
        doc[f.FATAL] = True
    else:
        doc[f.FAILURES] = tally(doc.get(f.FAILURES)) + 1
        retry_at = after(now, option(doc, f.RETRY_BACKOFF) if retry_in is None else retry_in, now)
        run_at = doc.get(f.RUN_AT)
        doc[f.RUN_AT] = max(run_at, retry_at) if isinstance(run_at, datetime) else retry_at
    summarize(doc, now)
    announce(doc)


def _without(doc: Doc, entry: Doc) -> list[Any]:
    """The entries but ``entry`` (what else the list holds is kept as written)."""
    return [w for w in doc[f.WORKERS] if w is not entry]


def snooze(doc: Doc, entry: Doc, now: datetime, seconds: float) -> None:
    """Give the claim back and run again ``seconds`` from now; no failure is counted."""
    doc[f.WORKERS] = _without(doc, entry)
    doc[f.RUN_AT] = now + timedelta(seconds=seconds)
    doc[f.SNOOZES] = tally(doc.get(f.SNOOZES)) + 1
    summarize(doc, now)


def release(doc: Doc, entry: Doc, now: datetime) -> None:
    """Give the claim back without spending the failure budget."""
    doc[f.WORKERS] = _without(doc, entry)
    summarize(doc, now)


def cancelable(doc: Doc) -> bool:
    """A task that did not end SUCCESS or FAIL (canceling twice is harmless)."""
    return doc.get(f.STATE) not in (TaskState.SUCCESS.value, TaskState.FAIL.value)


def cancel(doc: Doc, now: datetime) -> None:
    """CANCELED, when ``cancelable``; a finished task is left as it is."""
    if not cancelable(doc):
        return
    doc[f.STATE] = TaskState.CANCELED.value
    doc.pop(f.CANCELED_BY, None)  # an operator's cancel: no upstream's retry re-arms it
    summarize(doc, now)
    announce(doc)


def announce(doc: Doc) -> None:
    """A task others wait on (``dependents``) that ended owes them its state: count one more
    ``notify`` (``taskrunner.workflows`` settles them, then removes it)."""
    if doc.get(f.DEPENDENTS) is True and doc.get(f.STATE) in FINISHED:
        doc[f.NOTIFY] = tally(doc.get(f.NOTIFY)) + 1


def new_document(task: NewTask, publish_id: str) -> Doc:
    """The stored form of a new task. The time fields are placeholders each store fills
    with server time; they are listed here so the mongo shell shows fields in this order."""
    doc: Doc = {
        f.KEY: task.key,
        f.NAME: task.name,
        f.PARAMS: task.params,
        f.PRIORITY: task.priority,
        f.CREATED_AT: None,
        f.UPDATED_AT: None,
        f.RUN_AT: None,
        f.OPTIONS: task.options.model_dump(),
        f.WORKERS: [],
        f.STATE: TaskState.PENDING.value,
        f.FAILURES: 0,
        f.ATTEMPTS: 0,
        f.CLAIMABLE_AT: None,
        f.PUBLISH_ID: publish_id,
        f.BUCKET: bucket_of(task.key),
    }
    if task.trace:
        doc[f.TRACE] = task.trace
    workflow = workflow_fields(task)
    if workflow.get(f.STATE) == WAITING:
        del doc[f.CLAIMABLE_AT]
    return doc | workflow


def carried(old: Doc | None) -> Doc:
    """What a task republished over ``old`` keeps of it: that others wait on it, and one
    more ``notify`` (they hear it runs again)."""
    if old is None or old.get(f.DEPENDENTS) is not True:
        return {}
    return {f.DEPENDENTS: True, f.NOTIFY: tally(old.get(f.NOTIFY)) + 1}


def workflow_fields(task: NewTask) -> Doc:
    """A new task's workflow fields (none for a task outside workflows). One that runs
    after others starts WAITING, without ``claimable_at``, owing its upstreams a ``link``."""
    fields: Doc = {}
    if task.after:
        fields = {
            f.STATE: WAITING,
            f.AFTER: task.after,
            f.WAITING_ON: task.after,
            f.ON_UPSTREAM_FAILURE: task.on_upstream_failure,
            f.LINK: 1,
        }
    if task.dependents:
        fields[f.DEPENDENTS] = True
    if task.flow is not None:
        fields[f.FLOW] = task.flow
    if task.compensate is not None:
        fields[f.COMPENSATE] = task.compensate.model_dump()
    if task.compensates is not None:
        fields[f.COMPENSATES] = task.compensates
    return fields


def bucket_of(key: str) -> int:
    """A task's bucket: a hash of its key, so a republished key keeps its bucket. Any
    integer in range works (a publisher in another language may pick one at random)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % f.BUCKETS


def in_bucket_range(value: object) -> bool:
    """Is ``value`` a number in ``[0, BUCKETS)``, as ``{$gte: 0, $lt: BUCKETS}`` judges? (An
    array passes when one element is at least 0 and one, maybe another, below BUCKETS.)"""
    numbers = [n for n in map(_num, _query_values(value)) if n is not None]
    return any(n >= 0 for n in numbers) and any(n < f.BUCKETS for n in numbers)


def number_in(value: object, targets: Collection[int]) -> bool:
    """``{field: {$in: targets}}`` for numbers (1.0 is 1; true is not)."""
    return any(n in targets for n in map(_num, _query_values(value)) if n is not None)


def hears_insert(doc: Doc, names: Collection[str], owned: Mapping[str, Collection[int]] | None) -> bool:
    """Does a worker for ``names`` that owns the buckets ``owned`` (per name; a name not
    there: every bucket) hear this new document? (``expressions.hears`` on inserts.)
    A name that is not a string, or a bucket out of range, is heard by every worker."""
    name, bucket = doc.get(f.NAME), doc.get(f.BUCKET)
    if not has_string(name):
        return True
    if is_one_of(name, [n for n in names if owned is None or n not in owned]):
        return True
    routed = [n for n in names if owned is not None and n in owned]
    return any(
        is_one_of(name, (n,)) and (number_in(bucket, owned[n]) or not in_bucket_range(bucket))
        for n in routed
        if owned is not None
    )


def hears(event: Doc, names: Collection[str], owned: Mapping[str, Collection[int]] | None) -> bool:
    """Does a worker's change stream pass this change event? New documents it
    ``hears_insert``, updates that ``wakes`` it."""
    kind = event.get(f.OPERATION_TYPE)
    if kind in ("insert", "replace"):
        return hears_insert(event.get(f.FULL_DOCUMENT) or {}, names, owned)
    changed = (event.get(f.UPDATE_DESCRIPTION) or {}).get(f.UPDATED_FIELDS)
    return kind == "update" and isinstance(changed, dict) and wakes(changed)


def updatable(doc: Doc) -> bool:
    """``update_pending`` applies only to a task no worker is running or has succeeded
    (PENDING, or WAITING for its upstreams)."""
    started = any(is_running(w) or w.get(f.STATE) == EntryState.SUCCESS.value for w in _entries(doc))
    return doc.get(f.STATE) in (TaskState.PENDING.value, WAITING) and not started


@dataclass(frozen=True)
class PendingChanges:
    """What ``update_pending`` rewrites on a stored task: only what the publish call named
    (the ``NewTask``'s ``model_fields_set``), as Oban's ``replace: [...]`` names fields."""

    fields: Doc
    """Top-level values to set: ``params`` and ``priority``, when named."""
    options: Doc
    """Options to set, merged into the stored ones (which replace them whole when they are
    not an object); ``ping_interval`` and ``ping_timeout`` go together, since a lease
    needs the timeout above the interval, and the task checked them as a pair."""
    whole_options: Doc
    """Every option of the new task: stored when the stored options are not an object."""
    run_time: bool
    """``run_at`` or ``delay`` named: ``run_at`` and ``claimable_at`` move to that time."""


PING_PAIR = frozenset({f.PING_INTERVAL, f.PING_TIMEOUT})


def pending_changes(task: NewTask) -> PendingChanges:
    """What ``update_pending`` rewrites with ``task``: the fields and options its call named."""
    named = task.model_fields_set
    fields: Doc = {name: getattr(task, name) for name in (f.PARAMS, f.PRIORITY) if name in named}
    chosen = set(task.options.model_fields_set) if f.OPTIONS in named else set()
    if chosen & PING_PAIR:
        chosen |= PING_PAIR
    whole = task.options.model_dump()
    options = {name: value for name, value in whole.items() if name in chosen}
    return PendingChanges(fields, options, whole, task.run_at is not None or task.delay is not None)


def pending_update(doc: Doc, task: NewTask, now: datetime) -> None:
    """``update_pending``: set what the call named (``pending_changes``), nothing else;
    not a new task. A ``max_failures`` at or below the failures spent ends it FAIL."""
    changes = pending_changes(task)
    doc.update(changes.fields)
    if changes.options:
        stored = doc.get(f.OPTIONS)
        doc[f.OPTIONS] = {**stored, **changes.options} if isinstance(stored, dict) else changes.whole_options
    if changes.run_time:
        run_at = start_time(task, now)
        doc[f.RUN_AT] = run_at
        if doc.get(f.STATE) != WAITING:  # a WAITING task gets its claimable_at when released
            doc[f.CLAIMABLE_AT] = run_at
    doc[f.UPDATED_AT] = now
    budget = changes.options.get(f.MAX_FAILURES)
    if budget is None or tally(doc.get(f.FAILURES)) < budget:
        doc.pop(f.FINISHED_AT, None)
        return
    doc[f.STATE] = TaskState.FAIL.value
    doc.pop(f.CLAIMABLE_AT, None)
    if not isinstance(doc.get(f.FINISHED_AT), datetime):
        doc[f.FINISHED_AT] = now
    announce(doc)


def is_seed(doc: Doc) -> bool:
    """A document holding nothing but its key (and ``_id``): what an upsert starts from;
    publishing writes the new task over it."""
    return doc.keys() <= {f.ID, f.KEY}


def start_time(task: NewTask, now: datetime) -> datetime:
    """``run_at``, or server ``now`` plus ``delay``."""
    return task.run_at or now + timedelta(seconds=task.delay or 0)


def next_claim(task: Task, worker_id: str) -> datetime | None:
    """When ``worker_id`` may next claim ``task`` (server time), or None if it never may.

    ``claimable_at`` is the server's answer for a new claimer; this adds what only
    applies to this worker. The server re-checks everything when the claim is made.
    """
    opts = task.options
    if task.claimable_at is None or task.failures >= opts.max_failures:
        return None
    if opts.worker_ids and worker_id not in opts.worker_ids:
        return None
    mine = [w for w in task.workers if w.worker_id == worker_id]
    if any(w.state is EntryState.SUCCESS for w in mine):
        return None  # a worker never runs the same task twice (its success counts once)
    running = [w.expires_at for w in mine if w.state is EntryState.RUNNING]
    return max([task.claimable_at, *running])


def wakes(changed: Mapping[str, Any]) -> bool:
    """Does an update that changed these top-level fields (to these values) give a worker
    new work? Yes when the task went back to PENDING (a release, a failure with budget
    left, a retry, a republish) or got a new ``run_at`` while unfinished (a failure that
    freed one of several slots, ``update_pending``). Claims, renewals and outcomes do
    not: those are exactly the events a worker's change stream leaves out."""
    state = changed.get(f.STATE)
    return is_one_of(state, (TaskState.PENDING.value,)) or (
        f.RUN_AT in changed and not is_one_of(state, FINISHED)
    )


def wake_at(changed: Mapping[str, Any]) -> datetime | None:
    """When a wake's task may be claimable: its new ``claimable_at``, else its new ``run_at``."""
    at = changed.get(f.CLAIMABLE_AT, changed.get(f.RUN_AT))
    return at if isinstance(at, datetime) else None


def changed_fields(before: Doc, after: Doc) -> Doc:
    """Top-level fields whose value differs, with their new values (removed fields: None)."""
    names = before.keys() | after.keys()
    return {n: after.get(n) for n in names if n not in before or n not in after or before[n] != after[n]}


def sweepable(doc: Doc, worker_id: str, names: Sequence[str], horizon: datetime) -> bool:
    """The sweep's filter (``Store.due``): an unfinished task of one of ``names`` that becomes
    claimable by now or ``horizon``, allowed for the worker, and neither run by it with
    success nor held by a lease of its own that is still live at ``horizon``.

    An own lease that expires by then does not hide the task: the claim filter lets the
    worker take it over (``claimable``), and a claim whose reply was lost leaves just
    such an entry; hidden, the task could stay RUNNING for good when no other worker may
    start it (a gate with a single owner)."""
    mine = [w for w in _entries(doc) if is_one_of(w.get(f.WORKER_ID), (worker_id,))]
    succeeded, running = (EntryState.SUCCESS.value,), (EntryState.RUNNING.value,)
    held = any(is_one_of(w.get(f.STATE), running) and date_after(w.get(f.EXPIRES_AT), horizon) for w in mine)
    return (
        is_one_of(doc.get(f.STATE), ACTIVE)
        and is_one_of(doc.get(f.NAME), names)
        and date_at_most(doc.get(f.CLAIMABLE_AT), horizon)
        and allows(doc, worker_id)
        and not any(is_one_of(w.get(f.STATE), succeeded) for w in mine)
        and not held
    )


def sweep_order(doc: Doc) -> datetime:
    """What a sweep sorts by: ``claimable_at``, of an array the earliest date (a sweepable
    document has one)."""
    return min(v for v in _query_values(doc.get(f.CLAIMABLE_AT)) if isinstance(v, datetime))


def sweep_groups(names: Sequence[str], apart: Sequence[str]) -> list[list[str]]:
    """The names a sweep reads PENDING tasks of together, then each name in ``apart`` alone."""
    together = [name for name in names if name not in apart]
    return ([together] if together else []) + [[name] for name in names if name in apart]


RETRYABLE = (TaskState.FAIL.value, TaskState.CANCELED.value)
STATES = tuple(state.value for state in TaskState)
BSON_TYPES = (
    "double",
    "string",
    "object",
    "array",
    "binData",
    "undefined",
    "objectId",
    "bool",
    "date",
    "null",
    "regex",
    "dbPointer",
    "javascript",
    "symbol",
    "javascriptWithScope",
    "int",
    "timestamp",
    "long",
    "decimal",
    "minKey",
    "maxKey",
)
"""Every BSON type, by its ``$type`` alias (the manual's table, deprecated ones included)."""

# -- documents written by hand or by other languages (docs/schema.md) ------------------------
MALFORMED = "MalformedTask"
"""The error type of a document marked unreadable (and of a claimed one that did not read)."""
STAMPED = (f.CREATED_AT, f.UPDATED_AT, f.RUN_AT)
"""Times a hand-written document may leave out: they default to server now."""
HAND_DEFAULTS: Doc = {
    f.PARAMS: {},
    f.PRIORITY: 0,
    f.WORKERS: [],
    f.STATE: TaskState.PENDING.value,
    f.FAILURES: 0,
    f.ATTEMPTS: 0,
}
"""Defaults of the other fields a hand-written document may leave out (``key`` and
``name`` are required); each option it lacks gets its default, and an unfinished task
without ``claimable_at`` becomes claimable at its ``run_at``."""


def unsettled(doc: Doc) -> bool:
    """Should a worker's sweep normalize this document? A string key and no valid state,
    or unfinished without a ``claimable_at`` date: nothing else would ever claim it."""
    state = doc.get(f.STATE)
    unfinished = is_one_of(state, ACTIVE) and dateless(doc.get(f.CLAIMABLE_AT))
    return has_string(doc.get(f.KEY)) and (not is_one_of(state, STATES) or unfinished)


def dateless(value: Any) -> bool:
    """Not a date, as MongoDB's ``{$in: [null, []]}`` or ``{$type: <every type but date
    and array>}`` judge a field: an array by its elements (one that is null, empty or of
    another type than date), so ``[date]`` has a date; a nested array is not looked into.
    A date out of Python's range (``DatetimeMS``, as MongoStore reads it) is a date."""
    if not isinstance(value, list):
        return not isinstance(value, DATES)
    return value == [] or any(v is None or v == [] or not isinstance(v, DATES | list) for v in value)


def normalization(doc: Doc, now: Any) -> Doc:
    """The fields normalizing ``doc`` sets: each one it lacks, with its default (``now``
    for times), and ``options`` with the options it lacks (when it is an object)."""
    fill: Doc = {field: now for field in STAMPED if field not in doc}
    fill |= {field: copy.deepcopy(value) for field, value in HAND_DEFAULTS.items() if field not in doc}
    options = _filled_options(doc)
    if options is not None:
        fill[f.OPTIONS] = options
    fill |= _waiting(doc)
    if f.CLAIMABLE_AT not in doc and fill.get(f.STATE, doc.get(f.STATE)) in ACTIVE:
        fill[f.CLAIMABLE_AT] = fill.get(f.RUN_AT, doc.get(f.RUN_AT))
    return fill


def _waiting(doc: Doc) -> Doc:
    """A hand-written task with an ``after`` and no state waits for those keys, as a
    published one does: WAITING, waiting on all of them, owing its upstreams a ``link``."""
    after = doc.get(f.AFTER)
    if f.STATE in doc or not (isinstance(after, list) and after):
        return {}
    fill: Doc = {f.STATE: WAITING}
    if f.WAITING_ON not in doc:
        fill[f.WAITING_ON] = copy.deepcopy(after)
    if f.LINK not in doc:
        fill[f.LINK] = 1
    return fill


def _filled_options(doc: Doc) -> Doc | None:
    """``options`` with every option it lacks at its default; None when nothing is missing
    or it does not read (then the document is marked, naming the option)."""
    options = doc.get(f.OPTIONS, {})
    if not isinstance(options, dict):
        return None
    try:
        full = TaskOptions.model_validate(options).model_dump()
    except ValidationError:
        return None
    filled = {**full, **options}  # the given ones kept as written
    return filled if f.OPTIONS not in doc or filled.keys() != options.keys() else None


def verdict(doc: Doc, now: Any) -> tuple[Doc, MalformedTask | None]:
    """What normalizing ``doc`` sets, and why the result still does not read (or None)."""
    fill = normalization(doc, now)
    try:
        Task.from_document({**doc, **fill})
    except MalformedTask as exc:
        return fill, exc
    return fill, None


def is_marked(doc: Doc) -> bool:
    """Was ``doc`` marked unreadable (its own ``error`` is a ``MalformedTask``)?"""
    error = doc.get(f.ERROR)
    return isinstance(error, dict) and error.get(f.ERROR_TYPE) == MALFORMED


def marked_error(problem: str) -> Doc:
    """The ``error`` a document marked unreadable holds."""
    message = f"{problem}; fix the document, then retry it"
    return {f.ERROR_TYPE: MALFORMED, f.ERROR_MESSAGE: message, f.ERROR_TRACEBACK: None}


def normalize(doc: Doc, fill: Doc, problem: MalformedTask | None, now: datetime) -> None:
    """Set ``fill``; a document that still does not read is marked: FAIL, ``fatal``, and
    its own ``error`` naming the field and value. Nothing written by hand is removed."""
    doc.update(fill)
    doc[f.UPDATED_AT] = now
    if problem is None:
        return
    doc.update({f.STATE: TaskState.FAIL.value, f.FATAL: True, f.ERROR: marked_error(problem.problem)})
    doc[f.FINISHED_AT] = now
    doc.pop(f.CLAIMABLE_AT, None)
    announce(doc)


def still_running(doc: Doc, now: datetime) -> list[str]:
    """Workers whose run still holds a live lease: a FAIL or CANCELED task with one is
    not retried until that run has stopped (a canceled run stops at its next renewal)."""
    return [str(w.get(f.WORKER_ID)) for w in _entries(doc) if is_live(w, now)]


def retryable(doc: Doc, now: datetime) -> bool:
    """``retry`` applies: FAIL or CANCELED, and no run ``still_running``."""
    return is_one_of(doc.get(f.STATE), RETRYABLE) and not still_running(doc, now)


def retry_refused(key: str, state: str, workers: Sequence[str]) -> InvalidState:
    """Why ``retry`` refuses a task: its state, or the runs still stopping."""
    if state not in RETRYABLE:
        return InvalidState(key, state, "retry", "FAIL or CANCELED")
    why = f"its run on {', '.join(workers)} is still stopping; retry it once it has stopped"
    return InvalidState(key, state, "retry", "FAIL or CANCELED", why=why)


def kept_failed_runs(doc: Doc) -> float | None:
    """How many FAIL entries a retry keeps: as many as one budget cycle may record
    (``max_failures + concurrency - 1``), so that the document's size stays bounded however
    often the task is retried (``sizes``). None (all kept) when the options do not read."""
    concurrency, max_failures = _num(option(doc, f.CONCURRENCY)), _num(option(doc, f.MAX_FAILURES))
    if concurrency is None or max_failures is None or not (concurrency >= 1 and max_failures >= 1):
        return None
    return max_failures + concurrency - 1


def is_failed(entry: Any) -> bool:
    return isinstance(entry, dict) and entry.get(f.STATE) == EntryState.FAIL.value


def trim_failed_runs(doc: Doc) -> None:
    """Drop the oldest FAIL entries beyond ``kept_failed_runs`` (the list as written otherwise)."""
    keep, workers = kept_failed_runs(doc), doc.get(f.WORKERS)
    if keep is None or not isinstance(workers, list):
        return
    failed = sum(map(is_failed, workers))
    kept: list[Any] = []
    seen = 0  # FAIL entries before this one: it goes when at least ``keep`` come after it
    for w in workers:
        if is_failed(w):
            seen += 1
            if seen - 1 + keep < failed:
                continue
        kept.append(w)
    doc[f.WORKERS] = kept


def retry(doc: Doc, now: datetime, trace: Mapping[str, str] | None = None) -> None:
    """A FAIL or CANCELED task gets a fresh failure budget; its entries stay as history,
    the FAIL ones up to ``kept_failed_runs`` (the most recent).

    A document marked unreadable (or whose counters do not read) is left without a
    ``claimable_at`` instead: the next sweep normalizes it again, or marks it again.
    ``trace`` (the retrying span's context) replaces the task's, when given."""
    trim_failed_runs(doc)
    if trace:
        doc[f.TRACE] = dict(trace)
    numbers = (_num(option(doc, f.CONCURRENCY)), _num(option(doc, f.MAX_FAILURES)))
    recheck = _own_error(doc.get(f.ERROR)) or None in numbers
    doc.update({f.STATE: TaskState.PENDING.value, f.FAILURES: 0, f.RUN_AT: now})
    for field in (f.FATAL, f.ERROR, f.CANCELED_BY):
        doc.pop(field, None)
    waiting = doc.get(f.WAITING_ON)
    if isinstance(waiting, list) and waiting:
        # Back to its upstreams: linking them again settles it with their states now.
        doc[f.STATE] = WAITING
        doc[f.LINK] = tally(doc.get(f.LINK)) + 1
    if doc.get(f.DEPENDENTS) is True:
        doc[f.NOTIFY] = tally(doc.get(f.NOTIFY)) + 1  # its dependents canceled for it re-arm
    if not recheck:
        summarize(doc, now)
        return
    doc[f.UPDATED_AT] = now
    doc.pop(f.CLAIMABLE_AT, None)
    doc.pop(f.FINISHED_AT, None)


CANCEL_REASONS = (f.UPSTREAM_FAILED, f.FLOW_FAILED)
"""The ``error.type`` of a task a workflow canceled: not a mark, retried as any other."""


def _own_error(error: Any) -> bool:
    """A document-level ``error`` that makes ``retry`` look at the document again: a mark
    (or one written by hand), not a workflow's cancel reason."""
    return isinstance(error, dict) and error.get(f.ERROR_TYPE) not in CANCEL_REASONS


def purgeable(doc: Doc, states: Sequence[str], cutoff: datetime) -> bool:
    """Finished in one of ``states`` before ``cutoff`` (a ``finished_at`` that is not a date never is)."""
    finished = doc.get(f.FINISHED_AT)
    return is_one_of(doc.get(f.STATE), states) and isinstance(finished, datetime) and finished < cutoff


# -- workflows: releasing and canceling the tasks that run after others (docs/workflows.md) ----
RUN_ANYWAY = "run"
UNHEARD = "FAIL or CANCELED"
"""What a cancel reason says of an upstream whose state the settling read did not include."""
FAILED = (TaskState.FAIL.value, TaskState.CANCELED.value)


@dataclass(frozen=True)
class Heard:
    """Upstreams' states as one read found them, sorted the ways ``settle`` uses them."""

    states: Mapping[str, str]

    @property
    def keys(self) -> list[str]:
        return list(self.states)

    def where(self, states: Collection[str], *, inside: bool = True) -> list[str]:
        return [k for k, s in self.states.items() if (s in states) == inside]


def settleable(doc: Doc, keys: Collection[str]) -> bool:
    """What ``settle`` writes on: a task that runs after one of ``keys`` and is WAITING, or
    was canceled by an upstream (``canceled_by`` present)."""
    state = doc.get(f.STATE)
    after_one = is_one_of(doc.get(f.AFTER), keys)
    return after_one and (
        is_one_of(state, (WAITING,))
        or (is_one_of(state, (TaskState.CANCELED.value,)) and f.CANCELED_BY in doc)
    )


def _bson_key(value: Any) -> Any:
    """A value as a set of BSON values tells it apart (numbers by value, bools apart)."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        return ("number", float(value))
    if isinstance(value, str):
        return ("string", value)
    return ("other", repr(value))


def set_difference(left: Sequence[Any], right: Collection[Any]) -> list[Any]:
    """``$setDifference``: ``left``'s values not in ``right``, each once, in ``left``'s order
    (as MongoDB returns them)."""
    seen = {_bson_key(v) for v in right}
    kept: list[Any] = []
    for value in left:
        key = _bson_key(value)
        if key not in seen:
            seen.add(key)
            kept.append(value)
    return kept


def _array(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def settle(doc: Doc, heard: Heard, now: datetime) -> None:
    """Bring a ``settleable`` task up to date with upstream states just read: an upstream
    SUCCESS leaves ``waiting_on`` (any end does, for ``on_upstream_failure: "run"``); one
    FAIL or CANCELED it still waits on cancels it (``canceled_by``); one active again (a
    retry) no longer does. Then it is CANCELED while ``canceled_by`` holds a key, WAITING
    while ``waiting_on`` does, else PENDING: claimable from its ``run_at``. A change into or
    out of CANCELED is announced to its own dependents (``notify``)."""
    run_anyway = doc.get(f.ON_UPSTREAM_FAILURE) == RUN_ANYWAY
    met = heard.where(FINISHED) if run_anyway else heard.where((TaskState.SUCCESS.value,))
    waiting = set_difference(_array(doc.get(f.WAITING_ON)), met)
    kept = set_difference(_array(doc.get(f.CANCELED_BY)), heard.where(FAILED, inside=False))
    failed = {_bson_key(k) for k in heard.where(FAILED)}
    added = [] if run_anyway else set_difference([k for k in waiting if _bson_key(k) in failed], kept)
    canceled_by = kept + added
    was = doc.get(f.STATE)
    state = TaskState.CANCELED.value if canceled_by else WAITING if waiting else TaskState.PENDING.value
    doc.update({f.WAITING_ON: waiting, f.STATE: state, f.UPDATED_AT: now})
    if canceled_by:
        doc[f.CANCELED_BY] = canceled_by
    else:
        doc.pop(f.CANCELED_BY, None)
    if state == was:
        return
    _settled_times(doc, state, heard, now)
    if doc.get(f.DEPENDENTS) is True and TaskState.CANCELED.value in (was, state):
        doc[f.NOTIFY] = tally(doc.get(f.NOTIFY)) + 1


def _settled_times(doc: Doc, state: str, heard: Heard, now: datetime) -> None:
    """What a task whose state ``settle`` changed gets: when it may be claimed, when it
    finished, and why it was canceled."""
    for field in (f.CLAIMABLE_AT, f.FINISHED_AT, f.ERROR):
        doc.pop(field, None)
    if state == TaskState.PENDING.value:
        doc[f.CLAIMABLE_AT] = doc.get(f.RUN_AT)
    elif state == TaskState.CANCELED.value:
        doc[f.FINISHED_AT] = now
        doc[f.ERROR] = upstream_error(doc[f.CANCELED_BY][0], heard.states)


def upstream_error(upstream: Any, states: Mapping[str, str]) -> Doc:
    """The ``error`` of a task canceled because ``upstream`` did not succeed."""
    name = upstream if isinstance(upstream, str) else "?"
    state = states.get(name, UNHEARD) if isinstance(upstream, str) else UNHEARD
    message = f"upstream '{name}' ended {state}; retrying it re-arms this task"
    return {f.ERROR_TYPE: f.UPSTREAM_FAILED, f.ERROR_MESSAGE: message, f.ERROR_TRACEBACK: None}


def markable(doc: Doc, keys: Collection[str]) -> bool:
    """What ``mark_upstream`` writes on: a task of ``keys`` not yet marked, or finished."""
    unmarked = not any(v is True for v in _query_values(doc.get(f.DEPENDENTS)))
    return is_one_of(doc.get(f.KEY), keys) and (unmarked or is_one_of(doc.get(f.STATE), FINISHED))


def mark_upstream(doc: Doc) -> None:
    """An upstream a dependent links to has ``dependents`` from now on, so the write that
    ends it announces it; one that ended already owes a ``notify`` now."""
    doc[f.DEPENDENTS] = True
    if doc.get(f.STATE) in FINISHED:
        doc[f.NOTIFY] = tally(doc.get(f.NOTIFY)) + 1


def stoppable(doc: Doc, flow: str) -> bool:
    """A step of ``flow`` that no worker started (WAITING, or PENDING without entries), not
    a compensation: what a saga stops when one of its steps fails."""
    unstarted = is_one_of(doc.get(f.STATE), (WAITING, TaskState.PENDING.value)) and doc.get(f.WORKERS) == []
    return is_one_of(doc.get(f.FLOW), (flow,)) and unstarted and f.COMPENSATES not in doc


def flow_error(flow: str, step: str) -> Doc:
    """The ``error`` of a step canceled because another step of its flow failed."""
    message = f"step {step!r} of flow {flow!r} failed: the flow stops and undoes its finished steps"
    return {f.ERROR_TYPE: f.FLOW_FAILED, f.ERROR_MESSAGE: message, f.ERROR_TRACEBACK: None}


def stop(doc: Doc, error: Doc, now: datetime) -> None:
    """Cancel a ``stoppable`` step with ``error`` (``flow_error``), announced to its dependents."""
    doc.update({f.STATE: TaskState.CANCELED.value, f.FINISHED_AT: now, f.UPDATED_AT: now, f.ERROR: error})
    doc.pop(f.CLAIMABLE_AT, None)
    doc.pop(f.CANCELED_BY, None)
    announce(doc)
