"""``MemoryStore``: the in-process twin of ``MongoStore`` for tests and prototypes.

It keeps raw documents, so it can also hold malformed ones a test inserts by
hand, and runs ``taskrunner.store.rules`` with MongoDB's comparison semantics. Every
operation completes without awaiting and holds the store's lock, which makes each one
atomic on any number of event loops and threads (a worker on the main loop and
``runner.sync()``'s loop share one store, as two clients share one MongoDB database).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, TypeVar

import bson
from bson import ObjectId

from taskrunner.errors import (
    ChangeHistoryLost,
    ChangeStreamEnded,
    ClaimLost,
    ConfigurationError,
    DocumentTooLarge,
    InvalidSchedule,
    InvalidState,
    MalformedTask,
    ScheduleNotFound,
    TaskNotFound,
)
from taskrunner.limits.state import LimitState, readable_limit
from taskrunner.models import (
    EntryState,
    NewTask,
    PinnedAway,
    Task,
    TaskError,
    TaskState,
    TaskStats,
    Unreadable,
    WorkerInfo,
    to_utc,
)
from taskrunner.schedules.model import Schedule, ScheduleState
from taskrunner.store import fields as f
from taskrunner.store import rules
from taskrunner.store.base import (
    ChangeEvent,
    ChangeStream,
    Claim,
    Claimed,
    EventKind,
    FollowUp,
    Listed,
    Listing,
    Page,
    RunResult,
    RunStatus,
    RunWrite,
    Session,
    Window,
    due_page,
    follow_up_of,
    page_of,
)
from taskrunner.store.preflight import ServerInfo
from taskrunner.store.sizes import MAX_DOCUMENT_BYTES

Doc = dict[str, Any]
_Change = tuple[int, EventKind, str | None, Doc | None, Doc | None, Any]
"""One change: sequence, kind, key, document after, top-level fields an update changed, ``_id``."""


_IMMUTABLE = (str, int, float, bool, bytes, datetime, ObjectId, type(None))


def _at_path(doc: Any, path: str) -> Any:
    """The value at a dotted path (array indexes allowed), None when missing."""
    for part in path.split("."):
        if isinstance(doc, dict):
            doc = doc.get(part)
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            return None
    return doc


def _set_path(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    target: Any = doc
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value


def _clone(value: Any) -> Any:
    """A deep copy of documents as this store holds them; much cheaper than
    ``copy.deepcopy`` because scalars (strings, numbers, dates, ids) are shared."""
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value if isinstance(value, _IMMUTABLE) else copy.deepcopy(value)


def _no_session(session: Session | None) -> None:
    """A session belongs to a MongoDB client: the memory store has no transactions to join."""
    if session is not None:
        raise ConfigurationError(
            "session= joins a MongoDB transaction; a MemoryStore has none (use a MongoDB store)"
        )


def _refuse_too_large(doc: Doc) -> None:
    """Raise ``DocumentTooLarge`` if MongoDB would refuse ``doc`` (over 16 MiB as BSON)."""
    try:
        size = len(bson.encode(doc))
    except (bson.errors.InvalidDocument, OverflowError, TypeError):
        return  # written by hand with values BSON has no type for: not this check's to judge
    if size > MAX_DOCUMENT_BYTES:
        raise DocumentTooLarge(
            f"the document would exceed MongoDB's 16 MiB limit: {size:,} bytes as BSON, "
            f"at most {MAX_DOCUMENT_BYTES:,}"
        )


def _changed(doc: Doc, change: Callable[[Doc], None]) -> None:
    """Apply ``change`` to ``doc`` only if the result is a document MongoDB would store
    (else raise ``DocumentTooLarge``, ``doc`` unchanged), as a refused write leaves it."""
    trial = _clone(doc)
    change(trial)
    _refuse_too_large(trial)
    doc.clear()
    doc.update(trial)


def _utcnow() -> datetime:
    now = to_utc(datetime.now(UTC))
    assert isinstance(now, datetime)
    return now


class _Signal:
    """Wakes the waiters of every event loop and thread (an ``asyncio.Event`` belongs to one
    loop, and setting it from another thread wakes nobody)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    async def wait(self, seconds: float, *, until: Callable[[], bool]) -> None:
        """Return once ``until()`` holds, at the next ``notify``, or after ``seconds``."""
        loop = asyncio.get_running_loop()
        waiter = (loop, loop.create_future())
        with self._lock:
            self._waiters.add(waiter)
        try:
            # Checked after joining the waiters: a notify from here on is not missed.
            if not until():
                with suppress(TimeoutError):
                    await asyncio.wait_for(waiter[1], seconds)
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def notify(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, future in waiters:
            with suppress(RuntimeError):  # that loop is closed: nobody waits there any more
                loop.call_soon_threadsafe(_wake, future)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


M = TypeVar("M", bound=Callable[..., Any])


def _atomic(method: M) -> M:
    """``method`` under the store's lock (it never suspends, so the lock is held for its
    whole body and released before anything else runs on its loop)."""

    @functools.wraps(method)
    async def call(self: MemoryStore, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return await method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


class MemoryStore:
    """A ``Store`` held in memory; ``clock`` stands in for the server's clock.

    Safe on any event loop and thread: ``copy()`` of its runner and ``runner.sync()``
    share it, as they would share one MongoDB database.
    """

    bound_to_loop: ClassVar[bool] = False

    def __init__(self, *, clock: Callable[[], datetime] = _utcnow, history: int = 10_000) -> None:
        self._docs: dict[str, Doc] = {}
        self._clock = clock
        self._events: list[_Change] = []
        self._images: dict[str, Doc] = {}  # each key's last emitted document, to diff updates against
        self._seq = 0
        self._history = history
        self._lock = threading.RLock()
        self._changed = _Signal()
        self._registry: dict[str, WorkerInfo] = {}
        self._schedules: dict[str, Doc] = {}
        self._limits: dict[str, Doc] = {}
        self._limits_version = 0
        self._gates: dict[str, Doc] = {}
        self._limits_changed = _Signal()
        self._streams: weakref.WeakSet[_MemoryChangeStream | _LimitsStream] = weakref.WeakSet()

    # -- test helpers ---------------------------------------------------------------
    def insert_document(self, doc: Doc) -> None:
        """Store a raw document as-is, as a hand-written mongo-shell insert would."""
        doc = _clone(doc)
        doc.setdefault(f.ID, ObjectId())
        with self._lock:
            self._docs[str(doc.get(f.KEY, doc[f.ID]))] = doc
            self._emit("insert", doc)

    def document(self, key: str) -> Doc:
        """A copy of the stored document of ``key`` as it is, malformed or not (``KeyError`` if none)."""
        with self._lock:
            doc: Doc = _clone(self._docs[key])
        return doc

    def documents(self) -> list[Doc]:
        """Copies of every stored task document, in insertion order."""
        with self._lock:
            return [_clone(doc) for doc in self._docs.values()]

    def end_streams(self) -> int:
        """End every open change stream as MongoDB ends one after an invalidate hidden by
        its ``$match``: each delivers what was written before, then its ``next`` raises
        ``ChangeStreamEnded`` (cursor closed by the server). Streams opened later are
        unaffected. Returns how many ended."""
        with self._lock:
            streams = list(self._streams)
            for stream in streams:
                stream.end()
        self._changed.notify()
        self._limits_changed.notify()
        return len(streams)

    # -- Store --------------------------------------------------------------------
    async def init(
        self,
        *,
        validator: bool = False,
        retain_finished: float | None = None,
        retain_failed: float | None = None,
    ) -> None:
        return None

    async def publish(
        self,
        tasks: Sequence[NewTask],
        *,
        update_pending: bool = False,
        republish_finished: bool = False,
        session: Session | None = None,
    ) -> list[Task]:
        _no_session(session)
        publish_id = uuid.uuid4().hex
        return [self._publish_one(t, publish_id, update_pending, republish_finished) for t in tasks]

    def _publish_one(
        self, task: NewTask, publish_id: str, update_pending: bool, republish_finished: bool
    ) -> Task:
        now, doc = self._clock(), self._docs.get(task.key)
        if doc is None or rules.is_seed(doc) or (republish_finished and doc.get(f.STATE) in rules.FINISHED):
            fresh = self._fresh(task, publish_id, now, doc)
            _refuse_too_large(fresh)
            self._docs[task.key] = fresh
            self._emit("insert" if doc is None else "replace", fresh)
            return self._task(fresh, created=True)
        if update_pending and rules.updatable(doc):
            _changed(doc, lambda trial: rules.pending_update(trial, task, now))
            self._emit("update", doc)
        return self._task(doc)

    @staticmethod
    def _fresh(task: NewTask, publish_id: str, now: datetime, old: Doc | None) -> Doc:
        doc = {f.ID: old[f.ID] if old else ObjectId(), **rules.new_document(task, publish_id)}
        run_at = rules.start_time(task, now)
        times = {f.CREATED_AT: now, f.UPDATED_AT: now, f.RUN_AT: run_at, f.CLAIMABLE_AT: run_at}
        if doc[f.STATE] == rules.WAITING:
            del times[f.CLAIMABLE_AT]
        fresh: Doc = _clone({**doc, **times, **rules.carried(old)})
        return fresh

    async def get(self, key: str, *, session: Session | None = None) -> Task:
        _no_session(session)
        doc = self._docs.get(key)
        if doc is None:
            raise TaskNotFound(key)
        return self._task(doc)

    async def find(
        self,
        *,
        state: TaskState | None = None,
        name: str | None = None,
        worker_id: str | None = None,
        limit: int = 0,
    ) -> list[Task]:
        docs = [d for d in self._matching(state, name) if worker_id is None or _has_worker(d, worker_id)]
        docs.sort(key=lambda d: (str(d.get(f.CREATED_AT)), str(d[f.ID])))
        tasks = [self._task(d) for d in docs]
        return tasks[:limit] if limit else tasks

    async def count(self, *, state: TaskState | None = None, name: str | None = None) -> int:
        return len(self._matching(state, name))

    async def browse(self, listing: Listing) -> Listed:
        docs = [d for d in self._matching(listing.state, listing.name) if _listed(d, listing)]
        dated = [d for d in docs if isinstance(d.get(listing.sort), datetime)]
        dated.sort(key=lambda d: (d[listing.sort], str(d.get(f.KEY))), reverse=True)
        undated = sorted((d for d in docs if d not in dated), key=lambda d: str(d.get(f.KEY)), reverse=True)
        chosen = (dated + undated)[: listing.limit]
        if len(chosen) < listing.limit or not chosen:
            return Listed([self._task(d) for d in chosen], None)
        at = chosen[-1].get(listing.sort)
        tasks = [self._task(d) for d in chosen]
        return Listed(tasks, (at if isinstance(at, datetime) else None, tasks[-1].key))

    def _matching(self, state: TaskState | None, name: str | None) -> list[Doc]:
        return [
            d
            for d in self._docs.values()
            if (state is None or d.get(f.STATE) == state.value) and (name is None or d.get(f.NAME) == name)
        ]

    async def candidates(self, *, after: str | None = None, limit: int = 500) -> Page:
        keys = sorted(k for k, d in self._docs.items() if d.get(f.STATE) in rules.ACTIVE)
        keys = [k for k in keys if after is None or k > after][: limit or None]
        page = page_of([_clone(self._docs[k]) for k in keys], limit)
        # Documents are filed here under str(key), so that is what the next page goes after.
        return page if page.after is None else replace(page, after=keys[-1])

    async def due(
        self,
        worker_id: str,
        names: Sequence[str],
        *,
        horizon: datetime,
        limit: int = 100,
        apart: Sequence[str] = (),
    ) -> Page:
        docs = sorted(
            (d for d in self._docs.values() if rules.sweepable(d, worker_id, names, horizon)),
            key=rules.sweep_order,
        )
        running = [d for d in docs if rules.is_one_of(d.get(f.STATE), (TaskState.RUNNING.value,))][:limit]
        waiting = [d for d in docs if rules.is_one_of(d.get(f.STATE), (TaskState.PENDING.value,))]
        pending: list[Doc] = []
        for group in rules.sweep_groups(names, apart):
            pending += [d for d in waiting if rules.is_one_of(d.get(f.NAME), group)][:limit]
        unsettled = [d for d in self._docs.values() if rules.unsettled(d)][:limit]
        return due_page([_clone(d) for d in running + pending + unsettled], limit, apart)

    async def claim(
        self,
        worker_id: str,
        *,
        key: str | None = None,
        names: Sequence[str] | None = None,
        fresh: bool = False,
        window: Window | None = None,
        keys: Sequence[str] | None = None,
    ) -> Claim | None:
        return self._claim(worker_id, [key] if key is not None else keys, names, fresh, window)

    def _claim(
        self,
        worker_id: str,
        keys: Sequence[str] | None,
        names: Sequence[str] | None,
        fresh: bool,
        window: Window | None,
    ) -> Claim | None:
        now = self._clock()
        if window is not None and not window[0] <= now <= window[1]:
            return None
        if keys is None:
            docs = list(self._docs.values())
        else:
            docs = [d for d in map(self._docs.get, dict.fromkeys(keys)) if d is not None]
        eligible = [
            d
            for d in docs
            if (keys is None or d.get(f.KEY) in keys)
            and (names is None or d.get(f.NAME) in names)
            and (not fresh or rules.fresh(d))
            and rules.claimable(d, worker_id, now)
        ]
        if not eligible:
            return None
        doc = min(eligible, key=rules.claim_order)
        run_id = uuid.uuid4().hex
        _changed(doc, lambda trial: rules.claim(trial, worker_id, run_id, now))
        self._emit("update", doc)
        if rules.running_entry(doc, run_id) is None:
            return None  # the task's dead leases spent its budget: it was ended, not claimed
        try:
            return Claim(Task.from_document(_clone(doc)), run_id)
        except MalformedTask as exc:
            # Record the unreadable document as this run's failure, so it cannot loop.
            error = TaskError(type="MalformedTask", message=str(exc)).model_dump()
            rules.fail(doc, rules.running_entry(doc, run_id) or {}, error, now, final=True)
            self._emit("update", doc)
            raise

    async def claim_many(
        self,
        worker_id: str,
        keys: Sequence[str],
        *,
        names: Sequence[str] | None = None,
        fresh: bool = False,
        window: Window | None = None,
    ) -> Claimed:
        claims: list[Claim] = []
        rejected: list[MalformedTask] = []
        for key in dict.fromkeys(keys):
            try:
                claim = self._claim(worker_id, [key], names, fresh, window)
            except MalformedTask as exc:
                rejected.append(exc)
                continue
            if claim is not None:
                claims.append(claim)
        return Claimed(claims, rejected)

    async def recover(
        self, worker_id: str, run_ids: Sequence[str], *, keys: Sequence[str] | None = None
    ) -> Claimed:
        claimed = Claimed([], [])
        docs = (
            self._docs.values() if keys is None else [d for k in keys if (d := self._docs.get(k)) is not None]
        )
        for doc in docs:
            entry = next((e for r in run_ids if (e := rules.running_entry(doc, r)) is not None), None)
            if entry is None or entry.get(f.WORKER_ID) != worker_id:
                continue
            try:
                claimed.claims.append(Claim(Task.from_document(_clone(doc)), entry[f.RUN_ID]))
            except MalformedTask as exc:
                claimed.rejected.append(exc)
        return claimed

    async def write_runs(self, writes: Sequence[RunWrite]) -> list[RunResult]:
        return [self._write_run(w) for w in writes]

    def _write_run(self, write: RunWrite) -> RunResult:
        doc = self._docs.get(write.key)
        entry = rules.running_entry(doc, write.run_id) if doc is not None else None
        now, value = self._clock(), _clone(write.value)
        if write.kind == "ping":
            status = rules.renewal_status(doc, write.run_id, write.worker_id)
            if status is not RunStatus.DONE:
                return status
        elif doc is None or entry is None:
            state = EntryState.SUCCESS if write.kind == "success" else EntryState.FAIL
            return rules.outcome_status(doc, write.run_id, state)
        assert doc is not None

        def apply(trial: Doc) -> None:
            entry = rules.running_entry(trial, write.run_id)
            assert entry is not None
            if write.kind == "ping":
                rules.ping(trial, entry, now, value)
            elif write.kind == "success":
                rules.succeed(trial, entry, value, now, _clone(write.progress))
            else:
                rules.fail(
                    trial,
                    entry,
                    value.error.model_dump(),
                    now,
                    value.retry_in,
                    value.final,
                    _clone(write.progress),
                )

        try:
            _changed(doc, apply)
        except DocumentTooLarge as exc:
            return exc  # that write's own error, as MongoDB's bulk write reports it
        self._emit("update", doc)
        return RunStatus.DONE

    def _run_write(self, key: str, run_id: str, apply: Callable[[Doc, Doc, datetime], None]) -> Task:
        doc = self._docs.get(key)
        entry = rules.running_entry(doc, run_id) if doc is not None else None
        if doc is None or entry is None:
            raise ClaimLost(key, run_id)
        apply(doc, entry, self._clock())
        self._emit("update", doc)
        return self._task(doc)

    async def release(self, key: str, run_id: str) -> Task:
        return self._run_write(key, run_id, rules.release)

    async def snooze(self, key: str, run_id: str, seconds: float) -> Task:
        return self._run_write(key, run_id, lambda d, e, now: rules.snooze(d, e, now, seconds))

    async def normalize(self, key: str) -> Task:
        doc = self._docs.get(key)
        if doc is None:
            raise TaskNotFound(key)
        now = self._clock()
        fill, problem = rules.verdict(doc, now)
        if (fill or problem) and not (problem and rules.is_marked(doc)):
            rules.normalize(doc, fill, problem, now)
            self._emit("update", doc)
        return self._task(doc)

    async def cancel(self, key: str, *, session: Session | None = None) -> Task:
        _no_session(session)
        doc = self._docs.get(key)
        if doc is None:
            raise TaskNotFound(key)
        if not rules.cancelable(doc):
            raise InvalidState(key, doc[f.STATE], "cancel", "WAITING, PENDING or RUNNING")
        rules.cancel(doc, self._clock())
        self._emit("update", doc)
        return self._task(doc)

    async def retry(
        self, key: str, *, trace: Mapping[str, str] | None = None, session: Session | None = None
    ) -> Task:
        _no_session(session)
        doc = self._docs.get(key)
        if doc is None:
            raise TaskNotFound(key)
        now = self._clock()
        if not rules.retryable(doc, now):
            raise rules.retry_refused(key, str(doc.get(f.STATE)), rules.still_running(doc, now))
        rules.retry(doc, now, trace)
        self._emit("update", doc)
        return self._task(doc)

    async def purge(self, states: Sequence[TaskState], older_than: float, *, dry_run: bool = False) -> int:
        cutoff = self._clock() - timedelta(seconds=older_than)
        doomed = [k for k, d in self._docs.items() if rules.purgeable(d, [s.value for s in states], cutoff)]
        if not dry_run:
            for key in doomed:
                self._emit("delete", None, key=key)
                del self._docs[key]
        return len(doomed)

    async def stats(self) -> TaskStats:
        now = self._clock()
        counts: dict[str, dict[str, int]] = {}
        for doc in self._docs.values():
            by_state = counts.setdefault(str(doc.get(f.NAME)), {})
            by_state[str(doc.get(f.STATE))] = by_state.get(str(doc.get(f.STATE)), 0) + 1
        pending = [
            created
            for d in self._docs.values()
            if d.get(f.STATE) == TaskState.PENDING.value
            and isinstance(created := d.get(f.CREATED_AT), datetime)
        ]
        hour_ago = now - timedelta(hours=1)
        recent = [
            w.get(f.STATE)
            for d in self._docs.values()
            for w in d.get(f.WORKERS) or []
            if isinstance(w, dict)
            and isinstance(w.get(f.FINISHED_AT), datetime)
            and w[f.FINISHED_AT] >= hour_ago
        ]
        return TaskStats(
            counts=counts,
            running=sum(c.get(TaskState.RUNNING.value, 0) for c in counts.values()),
            oldest_pending_seconds=(now - min(pending)).total_seconds() if pending else None,
            finished_last_hour=sum(s in (EntryState.SUCCESS.value, EntryState.FAIL.value) for s in recent),
            failed_last_hour=recent.count(EntryState.FAIL.value),
        )

    async def pinned_away(self, live: Sequence[str], *, examples: int = 5) -> list[PinnedAway]:
        groups: dict[str, tuple[Any, list[str]]] = {}
        for doc in self._docs.values():
            options = doc.get(f.OPTIONS)
            ids = options.get(f.WORKER_IDS) if isinstance(options, dict) else None
            key = doc.get(f.KEY)
            if (
                isinstance(key, str)
                and rules.is_one_of(doc.get(f.STATE), rules.ACTIVE)
                and rules.has_string(ids)
                and not rules.is_one_of(ids, live)
            ):
                groups.setdefault(repr(ids), (ids, []))[1].append(key)
        found = [
            PinnedAway(worker_ids=ids, tasks=len(keys), keys=sorted(keys)[:examples])
            for ids, keys in groups.values()
        ]
        # MongoDB's $sort places an array at its least item (ascending).
        return sorted(found, key=lambda p: (-p.tasks, min(p.worker_ids)))

    async def server_time(self) -> datetime:
        return self._clock()

    async def server_info(self) -> ServerInfo | None:
        return None  # in-process: no server to check

    async def beat(self, worker: WorkerInfo, ttl: float) -> bool:
        now, old = self._clock(), self._registry.get(worker.worker_id)
        stop = old is not None and old.stop_requested
        self._registry[worker.worker_id] = worker.model_copy(
            update={f.BEAT_AT: now, f.EXPIRES_AT: now + timedelta(seconds=ttl), f.STOP_REQUESTED: stop}
        )
        return stop

    async def request_stop(self, worker_id: str) -> bool:
        live = {w.worker_id: w for w in await self.workers()}
        if worker_id not in live:
            return False
        self._registry[worker_id] = live[worker_id].model_copy(update={f.STOP_REQUESTED: True})
        return True

    async def workers(self) -> list[WorkerInfo]:
        now = self._clock()
        live = [w for w in self._registry.values() if w.expires_at is not None and w.expires_at > now]
        return sorted(live, key=lambda w: w.worker_id)

    async def unregister(self, worker_id: str) -> None:
        self._registry.pop(worker_id, None)

    async def declare_schedule(self, schedule: Schedule, next_at: datetime) -> None:
        now, old = self._clock(), self._schedules.get(schedule.id, {})
        self._schedules[schedule.id] = {
            **old,
            f.ID: schedule.id,
            **_clone(schedule.definition()),
            f.PAUSED: old.get(f.PAUSED, False),
            f.NEXT_AT: next_at,
            f.CREATED_AT: old.get(f.CREATED_AT, now),
            f.DECLARED_AT: now,
            f.UPDATED_AT: now,
        }

    async def schedules(self, ids: Sequence[str] | None = None) -> dict[str, ScheduleState | Unreadable]:
        chosen = sorted(self._schedules if ids is None else set(ids) & set(self._schedules))
        return {i: ScheduleState.read(_clone(self._schedules[i])) for i in chosen}

    async def record_tick(
        self, schedule_id: str, previous: datetime | None, tick: datetime, key: str, next_at: datetime
    ) -> bool:
        doc = self._schedules.get(schedule_id)
        if doc is None or doc.get(f.LAST_TICK) != previous:
            return False
        doc.update({f.LAST_TICK: tick, f.LAST_KEY: key, f.NEXT_AT: next_at, f.UPDATED_AT: self._clock()})
        return True

    async def pause_schedule(self, schedule_id: str, paused: bool) -> ScheduleState:
        doc = self._schedules.get(schedule_id)
        if doc is None:
            raise ScheduleNotFound(schedule_id)
        now = self._clock()
        doc.update({f.PAUSED: paused, f.UPDATED_AT: now, **({} if paused else {f.RESUMED_AT: now})})
        state = ScheduleState.read(_clone(doc))
        if isinstance(state, Unreadable):
            raise InvalidSchedule(schedule_id, f"the stored schedule is unreadable: {state}")
        return state

    async def limits(self, names: Sequence[str] | None = None) -> dict[str, LimitState | Unreadable]:
        chosen = sorted(self._limits if names is None else set(names) & set(self._limits))
        return {name: LimitState.read(_clone(self._limits[name])) for name in chosen}

    async def pause(self, name: str, paused: bool) -> LimitState:
        now = self._clock()
        doc = self._limits.setdefault(name, {f.ID: name})
        doc.update({f.PAUSED: paused, f.PAUSED_AT if paused else f.RESUMED_AT: now, f.UPDATED_AT: now})
        self._limit_written()
        return readable_limit(_clone(doc))

    async def throttle(self, name: str, seconds: float, *, gate: str | None = None) -> None:
        doc = self._limits.setdefault(name, {f.ID: name})
        now = self._clock()
        until = now + timedelta(seconds=seconds)
        if gate is None:
            current = doc.get(f.THROTTLED_UNTIL)
            doc[f.THROTTLED_UNTIL] = max(current, until) if isinstance(current, datetime) else until
        else:
            listed = doc.get(f.THROTTLED_GATES)
            listed = listed if isinstance(listed, list) else []
            same = [t[f.UNTIL] for t in listed if isinstance(t, dict) and t.get(f.GATE) == gate]
            others = [
                t
                for t in listed
                if isinstance(t, dict)
                and t.get(f.GATE) != gate
                and isinstance(t.get(f.UNTIL), datetime)
                and t[f.UNTIL] > now
            ]
            longest = max([until, *(u for u in same if isinstance(u, datetime))])
            doc[f.THROTTLED_GATES] = [*others, {f.GATE: gate, f.UNTIL: longest}]
        doc[f.UPDATED_AT] = now
        self._limit_written()

    async def watch_limits(self) -> ChangeStream:
        stream = _LimitsStream(self)
        self._streams.add(stream)
        return stream

    async def set_limits(self, name: str, changes: Mapping[str, Any], *, clear: bool = False) -> LimitState:
        doc = self._limits.setdefault(name, {f.ID: name})
        if clear:
            doc.pop(f.RATE_LIMIT, None)
            doc.pop(f.MAX_RUNNING, None)
        doc.update(_clone(dict(changes)))
        doc[f.UPDATED_AT] = self._clock()
        self._limit_written()
        return readable_limit(_clone(doc))

    async def declare_limits(self, name: str, declared: Mapping[str, Any]) -> None:
        doc = self._limits.setdefault(name, {f.ID: name})
        declared = dict(sorted(declared.items()))
        if doc.get(f.DECLARED) != declared:
            doc[f.DECLARED] = _clone(declared)
            self._limit_written()

    async def read_gate(self, gate: str) -> dict[str, Any] | None:
        doc = self._gates.get(gate)
        return dict(_clone(doc)) if doc is not None else None

    async def gates(self, names: Sequence[str], *, limit: int = 1000) -> list[dict[str, Any]]:
        chosen = [doc for doc in self._gates.values() if doc.get(f.NAME) in names]
        return [dict(_clone(doc)) for doc in chosen[:limit]]

    async def update_gate(
        self, gate: str, expect: Mapping[str, Any], changes: Mapping[str, Any], *, create: bool = False
    ) -> dict[str, Any] | None:
        doc = self._gates.get(gate)
        if doc is None and not create:
            return None
        current = doc if doc is not None else {f.ID: gate}
        if any(_at_path(current, path) != value for path, value in expect.items()):
            return None
        updated = _clone(current)
        for path, value in changes.items():
            _set_path(updated, path, _clone(value))
        updated[f.UPDATED_AT] = self._clock()
        self._gates[gate] = updated
        return dict(_clone(updated))

    def _limit_written(self) -> None:
        self._limits_version += 1
        self._limits_changed.notify()

    async def watch(
        self,
        *,
        resume_after: Mapping[str, Any] | None = None,
        key: str | None = None,
        work_for: Sequence[str] | None = None,
        owned: Mapping[str, Sequence[int]] | None = None,
        summary: bool = False,
    ) -> ChangeStream:
        stream = _MemoryChangeStream(self, self._position_after(resume_after), key, work_for, owned, summary)
        stream.check_history()
        self._streams.add(stream)
        return stream

    def _position_after(self, token: Mapping[str, Any] | None) -> int:
        if token is None:
            return self._seq
        try:
            return int(str(token["_data"]))
        except (KeyError, ValueError):
            raise ValueError(f"not a MemoryStore resume token: {token!r}") from None

    async def close(self) -> None:
        return None

    # -- internals ------------------------------------------------------------------
    # -- workflows (taskrunner.workflows) ------------------------------------------------
    async def follow_ups(
        self, *, keys: Sequence[str] | None = None, after: Sequence[str] | None = None, limit: int = 100
    ) -> list[FollowUp]:
        docs = [d for d in self._docs.values() if f.NOTIFY in d or f.LINK in d]
        if keys is not None:
            wanted = set(keys)
            docs = [d for d in docs if rules.is_one_of(d.get(f.KEY), wanted)]
        if after is not None:
            upstreams = set(after)
            docs = [d for d in docs if rules.is_one_of(d.get(f.AFTER), upstreams)]
        found = [up for up in map(follow_up_of, docs) if up is not None]
        return found if keys is not None else found[:limit]

    async def mark_upstreams(self, keys: Sequence[str]) -> None:
        wanted = set(keys)
        for key in dict.fromkeys(keys):
            if (doc := self._docs.get(key)) is not None and rules.markable(doc, wanted):
                rules.mark_upstream(doc)
                self._emit("update", doc)

    async def settle(self, states: Mapping[str, str]) -> None:
        heard, now = rules.Heard(dict(states)), self._clock()
        keys = set(heard.keys)
        for doc in [d for d in self._docs.values() if rules.settleable(d, keys)]:
            _changed(doc, lambda trial: rules.settle(trial, heard, now))
            self._emit("update", doc)

    async def followed_up(self, done: Sequence[FollowUp]) -> None:
        for up in done:
            doc = self._docs.get(up.key)
            changed = False
            for field, value in ((f.NOTIFY, up.notify), (f.LINK, up.link)):
                if doc is not None and value is not None and doc.get(field) == value:
                    del doc[field]
                    changed = True
            if changed:
                self._emit("update", doc)

    async def states(self, keys: Sequence[str], *, session: Session | None = None) -> dict[str, str]:
        _no_session(session)
        return {k: str(d.get(f.STATE)) for k in keys if (d := self._docs.get(k)) is not None}

    async def get_many(self, keys: Sequence[str]) -> list[Task]:
        return [self._task(d) for k in dict.fromkeys(keys) if (d := self._docs.get(k)) is not None]

    async def dependents(self, key: str, *, limit: int = 1000) -> list[Task]:
        return self._oldest(
            [d for d in self._docs.values() if rules.is_one_of(d.get(f.AFTER), (key,))], limit
        )

    async def flow_tasks(self, flow: str, *, limit: int = 100_000) -> list[Task]:
        return self._oldest(
            [d for d in self._docs.values() if rules.is_one_of(d.get(f.FLOW), (flow,))], limit
        )

    def _oldest(self, docs: list[Doc], limit: int) -> list[Task]:
        docs.sort(key=lambda d: (str(d.get(f.CREATED_AT)), str(d[f.ID])))
        return [self._task(d) for d in docs[:limit]]

    async def count_flow(self, flow: str, states: Sequence[TaskState]) -> int:
        wanted = [s.value for s in states]
        return sum(
            rules.is_one_of(d.get(f.FLOW), (flow,)) and rules.is_one_of(d.get(f.STATE), wanted)
            for d in self._docs.values()
            if f.COMPENSATES not in d
        )

    async def stop_flow(self, flow: str, error: TaskError) -> int:
        now, stopped = self._clock(), 0
        for doc in [d for d in self._docs.values() if rules.stoppable(d, flow)]:
            rules.stop(doc, error.model_dump(), now)
            self._emit("update", doc)
            stopped += 1
        return stopped

    def _emit(self, kind: EventKind, doc: Doc | None, key: str | None = None) -> None:
        self._seq += 1
        snapshot = _clone(doc)
        key = key if doc is None else doc.get(f.KEY)
        image = str(key)
        before = self._images.pop(image, None)
        doc_id = (snapshot or before or {}).get(f.ID)
        changed = rules.changed_fields(before, snapshot) if kind == "update" and before and snapshot else None
        if snapshot is not None:
            self._images[image] = snapshot
        self._events.append((self._seq, kind, key, snapshot, changed, doc_id))
        del self._events[: max(0, len(self._events) - self._history)]
        self._changed.notify()

    def _event(self, seq: int, kind: EventKind, key: str | None, doc: Doc | None) -> ChangeEvent:
        token = {"_data": str(seq)}
        if doc is None:
            return ChangeEvent(kind, key, None, token)
        try:
            return ChangeEvent(kind, key, Task.from_document(doc), token)
        except MalformedTask as exc:
            return ChangeEvent(kind, key, None, token, unreadable=Unreadable.of(doc, exc))

    @staticmethod
    def _task(doc: Doc, *, created: bool = False) -> Task:
        return Task.read(_clone(doc), created=created)


# Every public operation of the store is atomic across threads as well as on its loop.
for _name, _member in list(vars(MemoryStore).items()):
    if not _name.startswith("_") and inspect.iscoroutinefunction(_member):
        setattr(MemoryStore, _name, _atomic(_member))


class _LimitsStream:
    """``watch_limits`` of the in-memory store: an event whenever a limits document is written."""

    def __init__(self, store: MemoryStore) -> None:
        self._store, self._seen = store, store._limits_version
        self._ended: str | None = None

    @property
    def resume_token(self) -> Mapping[str, Any] | None:
        return None

    def end(self) -> None:
        self._ended = self._ended or ChangeStreamEnded.CURSOR_CLOSED

    async def next(self, wait: float) -> ChangeEvent | None:
        await self._store._limits_changed.wait(
            wait, until=lambda: self._store._limits_version != self._seen or self._ended is not None
        )
        if self._ended is not None:
            raise ChangeStreamEnded(self._ended)
        if self._store._limits_version == self._seen:
            return None
        self._seen = self._store._limits_version
        return ChangeEvent("update", None, None, None)

    async def close(self) -> None:
        self._ended = self._ended or ChangeStreamEnded.CLOSED
        self._store._streams.discard(self)


class _MemoryChangeStream:
    def __init__(
        self,
        store: MemoryStore,
        position: int,
        key: str | None,
        work_for: Sequence[str] | None,
        owned: Mapping[str, Sequence[int]] | None = None,
        summary: bool = False,
    ) -> None:
        self._store = store
        self._position = position
        self._key = key
        self._work_for = None if work_for is None else frozenset(work_for)
        self._owned = None if owned is None else {name: frozenset(b) for name, b in owned.items()}
        self._summary = summary
        self._ended: str | None = None
        self._end_at: int | None = None  # the sequence number after which the server ended it

    @property
    def resume_token(self) -> Mapping[str, Any] | None:
        return {"_data": str(self._position)}

    def check_history(self) -> None:
        with self._store._lock:
            self._check_history()

    def _check_history(self) -> None:
        events = self._store._events
        first = events[0][0] if events else self._store._seq + 1
        if self._position + 1 < first and self._position < self._store._seq:
            raise ChangeHistoryLost("change history lost: the resume token is older than the kept history")

    def end(self) -> None:
        if self._end_at is None:
            self._end_at = self._store._seq

    async def next(self, wait: float) -> ChangeEvent | None:
        self.check_history()
        seen = self._store._seq  # read first: any write after it wakes the wait below
        fresh = self._fresh()
        if fresh is None and not self._over():
            await self._store._changed.wait(wait, until=lambda: self._store._seq != seen or self._over())
            self.check_history()
            fresh = self._fresh()
        if fresh is None:
            if self._over():
                self._ended = self._ended or ChangeStreamEnded.CURSOR_CLOSED
                raise ChangeStreamEnded(self._ended)
            return None
        self._position = fresh[0]
        return self._read(*fresh)

    def _over(self) -> bool:
        """Closed, or ended by the server with every event before its end delivered."""
        return self._ended is not None or (self._end_at is not None and self._position >= self._end_at)

    def _read(
        self, seq: int, kind: EventKind, key: str | None, doc: Doc | None, changed: Doc | None, doc_id: Any
    ) -> ChangeEvent:
        token = {"_data": str(seq)}
        if self._work_for is not None and kind == "update":
            return ChangeEvent(kind, None, None, token, wake=True, wake_at=rules.wake_at(changed or {}))
        if self._summary:  # as MongoStore's: nothing looked up, the key only where the event has the document
            state = (
                (doc or {}).get(f.STATE) if kind in ("insert", "replace") else (changed or {}).get(f.STATE)
            )
            return ChangeEvent(
                kind,
                key if kind in ("insert", "replace") and isinstance(key, str) else None,
                None,
                token,
                doc_id=doc_id,
                state=state if isinstance(state, str) else None,
            )
        if self._key is not None and kind in ("update", "delete"):  # a key's stream: read the task
            state = (changed or {}).get(f.STATE)
            return ChangeEvent(
                kind, key, None, token, doc_id=doc_id, state=state if isinstance(state, str) else None
            )
        return self._store._event(seq, kind, key, doc)

    def _fresh(self) -> _Change | None:
        with self._store._lock:  # another thread's write may trim the history meanwhile
            return self._next_wanted()

    def _next_wanted(self) -> _Change | None:
        if self._ended is not None:
            return None
        events = self._store._events
        start = max(0, self._position + 1 - events[0][0]) if events else 0  # sequence numbers are contiguous
        for event in events[start:]:
            if event[0] <= self._position:
                continue
            if self._end_at is not None and event[0] > self._end_at:
                return None  # written after the server ended this stream
            if self._wanted(event[1], event[2], event[3], event[4]):
                return event
            self._position = event[0]  # filtered out, like a server-side $match
        return None

    def _wanted(self, kind: EventKind, key: str | None, doc: Doc | None, changed: Doc | None) -> bool:
        if self._work_for is not None:  # the worker's stream (expressions.hears)
            if kind in ("insert", "replace"):
                return doc is not None and rules.hears_insert(doc, self._work_for, self._owned)
            return kind == "update" and changed is not None and rules.wakes(changed)
        if self._key is not None:  # as MongoStore's _key_match: arrivals, deletes, state changes
            return key == self._key and (kind != "update" or f.STATE in (changed or {}))
        return True

    async def close(self) -> None:
        self._ended = self._ended or ChangeStreamEnded.CLOSED
        self._store._streams.discard(self)


def _listed(doc: Doc, listing: Listing) -> bool:
    """Whether ``doc`` is on ``listing``'s pages at or past its ``after`` position."""
    if listing.worker_id is not None and not _has_worker(doc, listing.worker_id):
        return False
    if listing.key_prefix is not None and not str(doc.get(f.KEY)).startswith(listing.key_prefix):
        return False
    if listing.after is None:
        return True
    at, key = listing.after
    value = doc.get(listing.sort)
    if not isinstance(value, datetime):  # the undated part comes after every date, by key
        return at is not None or str(doc.get(f.KEY)) < key
    return at is not None and (value, str(doc.get(f.KEY))) < (at, key)


def _has_worker(doc: Doc, worker_id: str) -> bool:
    workers = doc.get(f.WORKERS)
    return isinstance(workers, list) and any(
        isinstance(w, dict) and w.get(f.WORKER_ID) == worker_id for w in workers
    )
