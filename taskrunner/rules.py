"""The task state machine as plain Python over raw documents.

This is the reference the in-memory store runs and the MongoDB pipelines in
``store/expressions.py`` mirror; the contract suite holds the two together.
Comparisons follow MongoDB's query semantics: a claim-time field that is missing,
null or not a date never matches.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from bson import DatetimeMS
from pydantic import ValidationError

from taskrunner import fields as f
from taskrunner.errors import InvalidState, MalformedTask
from taskrunner.models import EntryState, NewTask, Task, TaskOptions, TaskState
from taskrunner.store.base import RunStatus

Doc = dict[str, Any]
FINISHED = (TaskState.SUCCESS.value, TaskState.FAIL.value, TaskState.CANCELED.value)
ACTIVE = (TaskState.PENDING.value, TaskState.RUNNING.value)
DATES = datetime | DatetimeMS
PENDING_UNCHANGED = object()  # marks "state not among the changed fields" in ``wakes``


def _num(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None  # type: ignore[arg-type]


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
    failures = _num(doc.get(f.FAILURES)) or 0.0
    if doc.get(f.STATE) == TaskState.CANCELED.value:
        return TaskState.CANCELED.value
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
    """Nobody ran this task yet: PENDING with no entries (what ``fresh`` claims take)."""
    return doc.get(f.STATE) == TaskState.PENDING.value and doc.get(f.WORKERS) == []


def claimable_by(doc: Doc, worker_id: str, now: datetime) -> bool:
    """May ``worker_id`` claim this task at server time ``now``? (the claim filter)"""
    claimable_at = doc.get(f.CLAIMABLE_AT)
    if doc.get(f.STATE) not in ACTIVE or not isinstance(claimable_at, datetime):
        return False
    allowed = option(doc, f.WORKER_IDS)
    if (
        not isinstance(doc.get(f.WORKERS), list)
        or not isinstance(allowed, list)
        or (allowed and worker_id not in allowed)
    ):
        return False
    if claimable_at > now or _numbers(doc) is None:
        return False
    entries = _entries(doc)
    mine = [w for w in entries if w.get(f.WORKER_ID) == worker_id]
    mine_active = any(w.get(f.STATE) == EntryState.SUCCESS.value or is_live(w, now) for w in mine)
    return (not mine_active and _has_budget(doc, entries, now)) or reapable(doc, now)


def _numbers(doc: Doc) -> tuple[float, float, float] | None:
    values = (_num(option(doc, f.CONCURRENCY)), _num(option(doc, f.MAX_FAILURES)), _num(doc.get(f.FAILURES)))
    return None if None in values else values  # type: ignore[return-value]


def _has_budget(doc: Doc, entries: list[Doc], now: datetime) -> bool:
    concurrency, max_failures, failures = _numbers(doc) or (0.0, 0.0, 0.0)
    expired = sum(is_expired(w, now) for w in entries)
    live = sum(is_live(w, now) for w in entries)
    return failures + expired < max_failures and successes(doc) + live < concurrency


def reapable(doc: Doc, now: datetime) -> bool:
    """Only dead leases remain and counting them spends the budget: the task must end FAIL.

    The claim that finds such a task drops those leases and adds no entry, so a task
    whose last allowed run died does not stay RUNNING forever."""
    numbers, entries = _numbers(doc), _entries(doc)
    if numbers is None or any(is_live(w, now) for w in entries):
        return False
    expired = sum(is_expired(w, now) for w in entries)
    return expired > 0 and numbers[2] + expired >= numbers[1]


LEASE_EXPIRED: Doc = {
    f.ERROR_TYPE: "LeaseExpired",
    f.ERROR_MESSAGE: "the worker stopped renewing its lease (it died, hung or lost the server) "
    "and no failure budget was left to run the task again",
    f.ERROR_TRACEBACK: None,
}
"""The error a reaped task's dead runs end with, so the FAIL document says why."""


def apply_claim(doc: Doc, worker_id: str, run_id: str, now: datetime) -> None:
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
        return
    attempt = int(_num(doc.get(f.ATTEMPTS)) or 0) + 1
    timeout = _num(option(doc, f.PING_TIMEOUT))
    expires_at = None if timeout is None else now + timedelta(seconds=timeout)
    entry = new_entry(worker_id, run_id, now, expires_at, attempt, [w.get(f.WORKER_ID) for w in expired])
    doc[f.ATTEMPTS] = attempt
    doc[f.WORKERS] = [w for w in entries if w not in expired] + [entry]
    summarize(doc, now)


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
    """The RUNNING entry of ``run_id``: the fencing check every state write makes."""
    return next((w for w in _entries(doc) if w.get(f.RUN_ID) == run_id and is_running(w)), None)


def renewal_status(doc: Doc | None, run_id: str, worker_id: str) -> RunStatus:
    """Whether a lease renewal for ``run_id`` may land on ``doc`` (DONE) or why not."""
    if doc is None or running_entry(doc, run_id) is None:
        return RunStatus.LOST
    if doc.get(f.STATE) == TaskState.CANCELED.value:
        return RunStatus.CANCELED
    allowed = option(doc, f.WORKER_IDS)
    if not isinstance(allowed, list) or (allowed and worker_id not in allowed):
        return RunStatus.NOT_ALLOWED
    return RunStatus.DONE


def outcome_status(doc: Doc | None, run_id: str, state: EntryState) -> RunStatus:
    """DONE when the run's entry holds the outcome ``state`` (written now or before), else LOST."""
    entries = _entries(doc) if doc is not None else []
    done = any(w.get(f.RUN_ID) == run_id and w.get(f.STATE) == state.value for w in entries)
    return RunStatus.DONE if done else RunStatus.LOST


def apply_ping(doc: Doc, entry: Doc, now: datetime, progress: Any = None) -> None:
    entry[f.PING_AT] = now
    entry[f.EXPIRES_AT] = now + timedelta(seconds=option(doc, f.PING_TIMEOUT))
    if progress is not None:
        entry[f.PROGRESS] = progress
    summarize(doc, now)


def apply_success(doc: Doc, entry: Doc, result: Any, now: datetime) -> None:
    entry.update({f.STATE: EntryState.SUCCESS.value, f.RESULT: result, f.FINISHED_AT: now})
    summarize(doc, now)


def apply_failure(
    doc: Doc, entry: Doc, error: Doc, now: datetime, retry_in: float | None = None, final: bool = False
) -> None:
    """Record the failure. A ``final`` one ends the task FAIL (``fatal``) without spending
    budget; otherwise it counts, and the task is claimable again ``retry_in`` seconds
    from now (None: ``retry_backoff``)."""
    entry.update({f.STATE: EntryState.FAIL.value, f.ERROR: error, f.FINISHED_AT: now})
    if final:
        doc[f.FATAL] = True
        summarize(doc, now)
        return
    doc[f.FAILURES] = doc[f.FAILURES] + 1
    seconds = _num(option(doc, f.RETRY_BACKOFF)) if retry_in is None else retry_in
    retry_at = now + timedelta(seconds=seconds or 0)
    run_at = doc.get(f.RUN_AT)
    doc[f.RUN_AT] = max(run_at, retry_at) if isinstance(run_at, datetime) else retry_at
    summarize(doc, now)


def apply_snooze(doc: Doc, entry: Doc, now: datetime, seconds: float) -> None:
    """Give the claim back and run again ``seconds`` from now; no failure is counted."""
    doc[f.WORKERS] = [w for w in _entries(doc) if w is not entry]
    doc[f.RUN_AT] = now + timedelta(seconds=seconds)
    doc[f.SNOOZES] = int(_num(doc.get(f.SNOOZES)) or 0) + 1
    summarize(doc, now)


def apply_release(doc: Doc, entry: Doc, now: datetime) -> None:
    """Give the claim back without spending the failure budget."""
    doc[f.WORKERS] = [w for w in _entries(doc) if w is not entry]
    summarize(doc, now)


def apply_cancel(doc: Doc, now: datetime) -> None:
    if doc.get(f.STATE) in (TaskState.SUCCESS.value, TaskState.FAIL.value):
        return
    doc[f.STATE] = TaskState.CANCELED.value
    summarize(doc, now)


def new_document(task: NewTask, publish_id: str) -> Doc:
    """The stored form of a new task. The time fields are placeholders each store fills
    with server time; they are listed here so the mongo shell shows fields in this order."""
    return {
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


def bucket_of(key: str) -> int:
    """A task's bucket: a hash of its key, so a republished key keeps its bucket. Any
    integer in range works (a publisher in another language may pick one at random)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % f.BUCKETS


def in_bucket_range(value: object) -> bool:
    """Is ``value`` a number in ``[0, BUCKETS)``, as ``{$gte: 0, $lt: BUCKETS}`` judges?"""
    number = _num(value)
    return number is not None and 0 <= number < f.BUCKETS


def hears_insert(doc: Doc, names: Collection[str], owned: Mapping[str, Collection[int]] | None) -> bool:
    """Does a worker for ``names`` that owns the buckets ``owned`` (per name; a name not
    there: every bucket) hear this new document? (``expressions.work_match`` on inserts.)
    A name that is not a string, or a bucket out of range, is heard by every worker."""
    name = doc.get(f.NAME)
    if not isinstance(name, str):
        return True
    if name not in names:
        return False
    bucket = doc.get(f.BUCKET)
    return owned is None or name not in owned or not in_bucket_range(bucket) or bucket in owned[name]


def updatable(doc: Doc) -> bool:
    """``update_pending`` applies only to a task no worker is running or has succeeded."""
    started = any(is_running(w) or w.get(f.STATE) == EntryState.SUCCESS.value for w in _entries(doc))
    return doc.get(f.STATE) == TaskState.PENDING.value and not started


def apply_publish_update(doc: Doc, task: NewTask, now: datetime) -> None:
    """``update_pending``: new params, priority, run_at and options; not a new task."""
    run_at = start_time(task, now)
    doc.update(
        {
            f.PARAMS: task.params,
            f.PRIORITY: task.priority,
            f.OPTIONS: task.options.model_dump(),
            f.RUN_AT: run_at,
            f.CLAIMABLE_AT: run_at,
            f.UPDATED_AT: now,
        }
    )
    if doc[f.FAILURES] >= task.options.max_failures:
        doc[f.STATE] = TaskState.FAIL.value
        doc.pop(f.CLAIMABLE_AT)
        doc[f.FINISHED_AT] = now


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
    state = changed.get(f.STATE, PENDING_UNCHANGED)
    return state == TaskState.PENDING.value or (f.RUN_AT in changed and state not in FINISHED)


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
    worker take it over (``claimable_by``), and a claim whose reply was lost leaves just
    such an entry; hidden, the task could stay RUNNING for good when no other worker may
    start it (a gate with a single owner)."""
    claimable_at = doc.get(f.CLAIMABLE_AT)
    allowed = option(doc, f.WORKER_IDS)
    mine = [w for w in _entries(doc) if w.get(f.WORKER_ID) == worker_id]
    return (
        doc.get(f.STATE) in ACTIVE
        and doc.get(f.NAME) in names
        and isinstance(claimable_at, datetime)
        and claimable_at <= horizon
        and (allowed == [] or (isinstance(allowed, list) and worker_id in allowed))
        and not any(w.get(f.STATE) == EntryState.SUCCESS.value or is_live(w, horizon) for w in mine)
    )


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
    unfinished = state in ACTIVE and dateless(doc.get(f.CLAIMABLE_AT))
    return isinstance(doc.get(f.KEY), str) and (state not in STATES or unfinished)


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
    if f.CLAIMABLE_AT not in doc and fill.get(f.STATE, doc.get(f.STATE)) in ACTIVE:
        fill[f.CLAIMABLE_AT] = fill.get(f.RUN_AT, doc.get(f.RUN_AT))
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


def apply_normalization(doc: Doc, fill: Doc, problem: MalformedTask | None, now: datetime) -> None:
    """Set ``fill``; a document that still does not read is marked: FAIL, ``fatal``, and
    its own ``error`` naming the field and value. Nothing written by hand is removed."""
    doc.update(fill)
    doc[f.UPDATED_AT] = now
    if problem is None:
        return
    doc.update({f.STATE: TaskState.FAIL.value, f.FATAL: True, f.ERROR: marked_error(problem.problem)})
    doc[f.FINISHED_AT] = now
    doc.pop(f.CLAIMABLE_AT, None)


def still_running(doc: Doc, now: datetime) -> list[str]:
    """Workers whose run still holds a live lease: a FAIL or CANCELED task with one is
    not retried until that run has stopped (a canceled run stops at its next renewal)."""
    return [str(w.get(f.WORKER_ID)) for w in _entries(doc) if is_live(w, now)]


def retry_refused(key: str, state: str, workers: Sequence[str]) -> InvalidState:
    """Why ``retry`` refuses a task: its state, or the runs still stopping."""
    if state not in RETRYABLE:
        return InvalidState(key, state, "retry", "FAIL or CANCELED")
    why = f"its run on {', '.join(workers)} is still stopping; retry it once it has stopped"
    return InvalidState(key, state, "retry", "FAIL or CANCELED", why=why)


def apply_retry(doc: Doc, now: datetime) -> None:
    """A FAIL or CANCELED task gets a fresh failure budget; its entries stay as history.

    A document marked unreadable (or whose counters do not read) is left without a
    ``claimable_at`` instead: the next sweep normalizes it again, or marks it again."""
    numbers = (_num(option(doc, f.CONCURRENCY)), _num(option(doc, f.MAX_FAILURES)))
    recheck = isinstance(doc.get(f.ERROR), dict) or None in numbers
    doc.update({f.STATE: TaskState.PENDING.value, f.FAILURES: 0, f.RUN_AT: now})
    doc.pop(f.FATAL, None)
    doc.pop(f.ERROR, None)
    if not recheck:
        summarize(doc, now)
        return
    doc[f.UPDATED_AT] = now
    doc.pop(f.CLAIMABLE_AT, None)
    doc.pop(f.FINISHED_AT, None)


def purgeable(doc: Doc, states: Sequence[str], cutoff: datetime) -> bool:
    finished = doc.get(f.FINISHED_AT)
    return doc.get(f.STATE) in states and isinstance(finished, datetime) and finished < cutoff
