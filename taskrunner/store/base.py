"""The store seam: what the publish API and the worker ask of a database.

Two implementations pass one contract suite (tests/contract/test_store_contract.py):
``MongoStore`` (PyMongo async) and ``MemoryStore`` (in-process twin for users'
tests). Every write that concerns a run carries its ``run_id`` (the fencing
token) and raises ``ClaimLost`` when that run no longer owns a RUNNING entry.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeAlias

from taskrunner.errors import InvalidTask, MalformedTask, StoreError
from taskrunner.limits.state import LimitState
from taskrunner.models import (
    NewTask,
    PinnedAway,
    Task,
    TaskError,
    TaskState,
    TaskStats,
    Unreadable,
    WorkerEntry,
    WorkerInfo,
)
from taskrunner.schedules.model import Schedule, ScheduleState
from taskrunner.store import fields as f
from taskrunner.store.preflight import ServerInfo

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.synchronous.client_session import ClientSession

Session: TypeAlias = "AsyncClientSession | ClientSession"
"""A MongoDB client session the caller owns (``client.start_session()``): writes given one
are the session's, inside its transaction when one is open. Only ``MongoStore`` takes one: an
``AsyncClientSession`` on an ``AsyncMongoClient``, a ``ClientSession`` on a sync client's
store (``MongoStore.on_sync_client``)."""


def in_transaction(session: Session | None) -> bool:
    """Whether ``session`` has a transaction open: its writes exist only once it commits."""
    return session is not None and session.in_transaction


Window = tuple[datetime, datetime]
"""Server times between which a claim may happen (both included)."""

EventKind = Literal["insert", "update", "replace", "delete"]
RunWriteKind = Literal["ping", "success", "failure"]


@dataclass(frozen=True, slots=True)
class Claim:
    """A successful claim: the task as written and the run's fencing token; ``recovered``
    when the claim's reply was lost and what it landed was read back by its run id."""

    task: Task
    run_id: str
    recovered: bool = False

    @property
    def entry(self) -> WorkerEntry:
        entry = self.task.entry(self.run_id)
        assert entry is not None, "a claim always holds its own entry"
        return entry


@dataclass(frozen=True, slots=True)
class Claimed:
    """What one batched claim got: the claims, and the claimed documents that did not
    read back as tasks (each already recorded as its run's failure, so it cannot loop)."""

    claims: list[Claim]
    rejected: list[MalformedTask]


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed run's outcome: its error; seconds until the task may run again (None:
    its ``retry_backoff``); ``final`` ends the task FAIL at once, no budget spent."""

    error: TaskError
    retry_in: float | None = None
    final: bool = False


@dataclass(frozen=True, slots=True)
class RunWrite:
    """One fenced write for one run: a lease renewal (``value`` is progress or None),
    or its outcome (``value`` is the result, or the ``Failure``; ``progress`` the run's
    last progress, written with it, or None to keep what its renewals wrote)."""

    kind: RunWriteKind
    key: str
    run_id: str
    worker_id: str
    value: Any = None
    progress: Any = None


class RunStatus(enum.Enum):
    """What a fenced write for one run found (see ``Store.write_runs``)."""

    DONE = "done"
    LOST = "lost"  # no RUNNING entry of this run any more: another worker owns the task
    CANCELED = "canceled"  # renewal refused: the task was canceled
    NOT_ALLOWED = "not allowed"  # renewal refused: worker_ids no longer name this worker
    UNCONFIRMED = "unconfirmed"  # still owned, but this renewal cannot be shown to have landed


RunResult = RunStatus | StoreError
"""Per write: how it went, or the error that write alone met (e.g. a validator's refusal)."""


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """A change to the task collection; ``task`` is None for deletes and for unreadable
    documents (``unreadable`` says why).

    On a worker's stream (``watch(work_for=...)``) an update carries no task either: it is
    a *wake* (``wake`` True), saying some task may be claimable from ``wake_at`` on (when
    the update says; else now), without saying which. On a key's stream (``watch(key=...)``)
    an update carries no task: it says the task's state changed (read it). On a summary
    stream (``watch(summary=True)``) no event carries a task: each has the document's
    ``doc_id`` and, where the change wrote one, ``state``; only inserts and replacements
    carry the ``key``."""

    kind: EventKind
    key: str | None
    task: Task | None
    token: Mapping[str, Any] | None
    unreadable: Unreadable | None = None
    wake: bool = False
    wake_at: datetime | None = None
    doc_id: Any = None
    state: str | None = None


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a scan. ``after`` continues the scan; None when this page was the last."""

    tasks: list[Task]
    unreadable: list[Unreadable]
    after: str | None


def page_of(docs: Sequence[dict[str, Any]], limit: int) -> Page:
    """Read one scan page of raw documents; a page of ``limit`` documents may have a next."""
    tasks: list[Task] = []
    unreadable: list[Unreadable] = []
    for doc in docs:
        try:
            tasks.append(Task.from_document(doc))
        except MalformedTask as exc:
            unreadable.append(Unreadable.of(doc, exc))
    if not docs or len(docs) < limit:
        return Page(tasks, unreadable, None)
    # Pages go on after the last *string* key: later pages ask for keys greater than a
    # string, which only strings are, so a non-string key can never stall the scan.
    keys = [key for doc in docs if isinstance(key := doc.get(f.KEY), str)]
    return Page(tasks, unreadable, keys[-1] if keys else "")


def due_page(docs: Sequence[dict[str, Any]], limit: int, apart: Sequence[str] = ()) -> Page:
    """A sweep's page: RUNNING tasks, then PENDING tasks (those of each name in ``apart``
    on their own), at most ``limit`` of each; ``after`` is set (to "") when one reached
    ``limit``, so the worker sweeps again at once."""
    page = page_of(docs, len(docs) + 1)

    def group(doc: dict[str, Any]) -> tuple[Any, Any]:
        state, name = doc.get(f.STATE), doc.get(f.NAME)
        return state, name if state == TaskState.PENDING.value and name in apart else None

    full = any(n >= limit for n in Counter(map(group, docs)).values())
    return Page(page.tasks, page.unreadable, "" if full else None)


Position = tuple[datetime | None, str]
"""Where a listing goes on: after this ``(sort value, key)``; the value None is the part
of the listing whose sort value is not a date."""


def format_position(position: Position) -> str:
    """A position as the text a next page starts ``after`` (``parse_position`` reads it back;
    no time: the listing's part whose sort value is not a date)."""
    at, key = position
    return f"{at.isoformat() if at is not None else ''}|{key}"


def parse_position(text: str | None) -> Position | None:
    if not text:
        return None
    at, bar, key = text.partition("|")
    if not bar:
        raise InvalidTask("after", "not a position in the list")
    try:
        return (datetime.fromisoformat(at) if at else None), key
    except ValueError:
        raise InvalidTask("after", "not a position in the list") from None


@dataclass(frozen=True, slots=True)
class Listing:
    """One page of an operator's task listing (the dashboard's, ``taskrunner failed``):
    newest first by ``sort`` (``created_at``, ``updated_at``, or ``finished_at`` of FAIL
    tasks) then key, continuing after ``after`` (the previous
    page's ``Listed.after``), so no page ever skips over the ones before it. Documents whose
    sort value is not a date (written by hand: missing, null, a string, ...) come last, by
    key descending: MongoDB compares values of different types by type, so a range on a
    date never reaches them."""

    state: TaskState | None = None
    name: str | None = None
    worker_id: str | None = None
    key_prefix: str | None = None
    sort: str = f.CREATED_AT
    after: Position | None = None
    limit: int = 50


@dataclass(frozen=True, slots=True)
class Listed:
    """One page of a ``Listing``: its tasks, and the position after the last one when the
    page is full (None: this page was the last)."""

    tasks: list[Task]
    after: Position | None


class ChangeStream(Protocol):
    """An open stream of change events. Open it before scanning: then nothing written
    during the scan is missed (a write lands either before the scan reads or in the stream).

    The server may end a stream (MongoDB does after an invalidate: the collection or its
    database dropped or renamed); ``next`` then raises ``ChangeStreamEnded``, never returns
    None at once for ever. Open a new stream without this one's token and read again what
    it followed (``taskrunner.engine.follow``)."""

    @property
    def resume_token(self) -> Mapping[str, Any] | None:
        """Where a new stream resumes to continue exactly after what this one returned."""

    async def next(self, wait: float) -> ChangeEvent | None:
        """The next event, or None when none arrives within ``wait`` seconds; raises
        ``ChangeStreamEnded`` once the stream ended (or was closed)."""

    async def close(self) -> None: ...


class TaskStore(Protocol):
    """Tasks: publish, read, claim, run writes, operate, follow; and the server itself."""

    async def init(
        self,
        *,
        validator: bool = False,
        retain_finished: float | None = None,
        retain_failed: float | None = None,
    ) -> None:
        """Create indexes (idempotent); optionally install the $jsonSchema validator and TTL
        indexes deleting finished tasks ``retain_finished`` seconds after they finish and,
        apart, FAIL and CANCELED ones ``retain_failed`` seconds after (0 removes one; None
        keeps what is installed)."""

    async def publish(
        self,
        tasks: Sequence[NewTask],
        *,
        update_pending: bool = False,
        republish_finished: bool = False,
        session: Session | None = None,
    ) -> list[Task]:
        """Insert tasks whose key is new; see docs/publishing.md for the options. With a
        ``session`` (MongoDB only) the writes are the session's, inside its transaction if
        one is open (docs/publishing.md, "Publishing in a transaction")."""

    async def get(self, key: str, *, session: Session | None = None) -> Task:
        """The task with ``key`` (``Task.read``: a malformed document reads with its
        ``problem``); raises ``TaskNotFound``."""

    async def find(
        self,
        *,
        state: TaskState | None = None,
        name: str | None = None,
        worker_id: str | None = None,
        limit: int = 0,
    ) -> list[Task]:
        """Tasks by state, name and worker (any entry), oldest first; malformed ones as ``Task.read`` reads them."""

    async def count(self, *, state: TaskState | None = None, name: str | None = None) -> int: ...

    async def browse(self, listing: Listing) -> Listed:
        """One page of ``listing`` (keyset paging: no skip, the sort's index walks it)."""

    async def candidates(self, *, after: str | None = None, limit: int = 500) -> Page:
        """One page of unfinished tasks in key order, starting after key ``after``; unreadable
        documents are named in the page, not dropped, and never end the scan early."""

    async def due(
        self,
        worker_id: str,
        names: Sequence[str],
        *,
        horizon: datetime,
        limit: int = 100,
        apart: Sequence[str] = (),
    ) -> Page:
        """The sweep: unfinished tasks of ``names`` claimable by ``horizon`` (server time),
        allowed for ``worker_id``, not run by it with success nor held by a lease of its
        own live at ``horizon`` (``rules.sweepable``), earliest ``claimable_at`` first,
        through indexes. It finds new tasks nobody claimed, retries and expired leases
        (takeovers) without following anyone's renewals; ``after`` of the page is None
        unless ``limit`` was reached. Expired leases come first: RUNNING tasks (at most
        ``limit``), then PENDING ones, at most ``limit`` of the names not in ``apart``
        together and ``limit`` of each name in ``apart`` (the names with fleet-wide
        limits), so a takeover never waits behind a backlog of new tasks and a limited
        name's backlog neither hides nor is hidden by another name's. Then at most
        ``limit`` documents of any name that need ``normalize`` (``rules.unsettled``: no
        valid state, or unfinished without a claimable_at date), as unreadable ones."""

    async def normalize(self, key: str) -> Task:
        """Give a document written by hand or by another language the fields it lacks
        (``rules.normalization``: defaults, times in server time) in one write that sets
        only fields still missing when it lands, so racing workers agree. If it still does
        not read, mark it instead: FAIL, ``fatal`` and its own ``error`` (``MalformedTask``,
        naming the field and value). Returns the task as stored (``Task.read``: its
        ``problem`` set when it does not read); raises ``TaskNotFound``."""

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
        """Atomically claim ``key`` (or the best claimable task) for ``worker_id``.

        ``keys``: the best claimable task among these keys instead (one task), so a claim
        from a list some other worker may have taken from meanwhile skips what was taken.

        ``window``: claim only while the server's clock is within it (a gate's permit).

        ``fresh``: claim only a task nobody ran yet (PENDING, no entries), for a key the
        caller saw that way; it is the cheapest claim, and a task that changed since is
        refused, left to the caller's next look at it."""

    async def claim_many(
        self,
        worker_id: str,
        keys: Sequence[str],
        *,
        names: Sequence[str] | None = None,
        fresh: bool = False,
        window: Window | None = None,
    ) -> Claimed:
        """Atomically claim, each on its own, every one of ``keys`` still claimable by
        ``worker_id``, in at most two round trips (an update and a read back); ``fresh``
        and ``window`` as for ``claim``."""

    async def recover(
        self, worker_id: str, run_ids: Sequence[str], *, keys: Sequence[str] | None = None
    ) -> Claimed:
        """The claims among ``run_ids`` that landed for ``worker_id`` and still hold their
        RUNNING entry, read through the key index (``keys``) or, for a claim without a key,
        the worker index. A claim whose reply was lost (a network error after the server
        applied it) is found so, and run or released: its lease never expires unowned, so
        the fault spends no failure budget. ``claim`` and ``claim_many`` recover at once
        (their claims then say ``recovered``, so the worker can tell); when that read fails
        too they raise ``ClaimUnconfirmed`` for a later ``recover``."""

    async def write_runs(self, writes: Sequence[RunWrite]) -> list[RunResult]:
        """Apply many runs' fenced writes in one round trip; one result per write.

        A renewal lands only while the run owns a RUNNING entry, the task is not
        CANCELED and ``worker_ids`` still allow the worker; otherwise its status says
        which (``LOST``, ``CANCELED``, ``NOT_ALLOWED``), and nothing is written. An
        outcome is ``DONE`` once the entry holds it (so a retried outcome that landed
        before is ``DONE`` too), else ``LOST``. ``UNCONFIRMED``: the run still owns its
        entry but this renewal cannot be shown to have landed; renew again.
        Raises ``StoreError`` when the whole batch failed (e.g. the server is away)."""

    async def release(self, key: str, run_id: str) -> Task:
        """Give the claim back without spending the failure budget."""

    async def snooze(self, key: str, run_id: str, seconds: float) -> Task:
        """Give the claim back and make the task claimable ``seconds`` from server now,
        without counting a failure (``snoozes`` counts these)."""

    async def cancel(self, key: str, *, session: Session | None = None) -> Task:
        """Mark the task CANCELED; ``InvalidState`` if it already succeeded or failed."""

    async def retry(
        self, key: str, *, trace: Mapping[str, str] | None = None, session: Session | None = None
    ) -> Task:
        """Make a FAIL or CANCELED task claimable again with a fresh failure budget;
        ``InvalidState`` for other states and while a run still holds a live lease (a
        cancel still pending). A document marked unreadable goes back to ``normalize``.
        ``trace``, when given, becomes the task's ``trace`` (the retrying span's context)."""

    async def purge(self, states: Sequence[TaskState], older_than: float, *, dry_run: bool = False) -> int:
        """Delete (or count) tasks in ``states`` that finished more than ``older_than`` s ago."""

    async def stats(self) -> TaskStats: ...

    async def pinned_away(self, live: Sequence[str], *, examples: int = 5) -> list[PinnedAway]:
        """Unfinished tasks (string key) whose ``options.worker_ids`` hold a string and none
        of ``live``, grouped by their ``worker_ids``, most tasks first: how many, and the
        first ``examples`` keys in key order (the ``pinned`` index)."""

    async def server_time(self) -> datetime: ...

    async def server_info(self) -> ServerInfo | None:
        """The server's version, topology and this connection's privileges (the start-up
        check, ``taskrunner.store.preflight``); None when no server is behind the store."""

    async def watch(
        self,
        *,
        resume_after: Mapping[str, Any] | None = None,
        key: str | None = None,
        work_for: Sequence[str] | None = None,
        owned: Mapping[str, Sequence[int]] | None = None,
        summary: bool = False,
    ) -> ChangeStream:
        """Open a stream of change events in commit order, resumable from a token; every
        event carries its task (a MongoDB server looks each update's document up).

        ``key``: that task's stream, for ``wait``: its inserts and replacements (with the
        task), its deletes, and its updates that change ``state`` (without the task). The
        server filters by the document's ``_id`` (read when the stream opens; a key not yet
        published is matched by its insert, then followed by its ``_id``), so it looks no
        document up and skips every other task's updates and this task's lease renewals.

        ``work_for`` (task names) makes it a worker's stream: only inserts of those names
        and wakes (``rules.wakes``), filtered by the server; ``owned`` narrows the inserts
        of a name to the buckets listed for it (``rules.hears_insert``). Resuming with
        other ``owned`` buckets loses nothing.

        ``summary``: every change, with no document looked up (the dashboard's): each
        event's ``doc_id`` and the ``state`` it wrote; inserts and replacements also their
        ``key``.

        Raises ``ChangeHistoryLost`` when it cannot resume there (rescan instead) and
        ``ChangeStreamsUnsupported`` when the server has none (poll instead)."""

    async def close(self) -> None: ...


class RegistryStore(Protocol):
    """The worker registry (``<collection>.workers``): beats, stop requests, the live workers."""

    async def beat(self, worker: WorkerInfo, ttl: float) -> bool:
        """Register or refresh a worker, live for ``ttl`` seconds (server time).

        Returns True when an operator asked this worker to stop."""

    async def request_stop(self, worker_id: str) -> bool:
        """Ask a live worker to shut down gracefully; False if no such live worker."""

    async def workers(self) -> list[WorkerInfo]:
        """Workers whose registration has not expired."""

    async def unregister(self, worker_id: str) -> None: ...


class ScheduleStore(Protocol):
    """Stored schedules (``<collection>.schedules``): declarations, ticks, pauses."""

    async def declare_schedule(self, schedule: Schedule, next_at: datetime) -> None:
        """Create or update a schedule's definition (its state, e.g. ``paused``, is kept)."""

    async def schedules(self, ids: Sequence[str] | None = None) -> dict[str, ScheduleState | Unreadable]:
        """Stored schedules by id (all, or those of ``ids`` that exist); an unreadable
        document is an ``Unreadable`` naming its problem."""

    async def record_tick(
        self, schedule_id: str, previous: datetime | None, tick: datetime, key: str, next_at: datetime
    ) -> bool:
        """Record a fired tick if the last recorded tick is still ``previous``."""

    async def pause_schedule(self, schedule_id: str, paused: bool) -> ScheduleState:
        """Pause or resume (ticks that came due while paused never fire); raises
        ``ScheduleNotFound``."""


class LimitStore(Protocol):
    """Flow control (``<collection>.limits`` and ``.gates``): pauses, throttles, limits, gate documents."""

    async def limits(self, names: Sequence[str] | None = None) -> dict[str, LimitState | Unreadable]:
        """Stored limit documents by task name (all, or those of ``names`` that exist); an
        unreadable document is an ``Unreadable`` naming its problem."""

    async def pause(self, name: str, paused: bool) -> LimitState:
        """Pause or resume claiming tasks of ``name`` (``"*"``: every name); the document
        is created when missing."""

    async def watch_limits(self) -> ChangeStream:
        """A stream whose events say only that some limits document changed (workers then
        read them again); raises ``ChangeStreamsUnsupported`` when the server has none.
        Its ``next`` may wait for the server longer than asked (a getMore's await): await
        it across several waits rather than cancel it (``taskrunner.engine.follow.Reading``)."""

    async def throttle(self, name: str, seconds: float, *, gate: str | None = None) -> None:
        """Start no task of ``name`` for ``seconds`` from server now (``RateLimited``); a
        longer throttle already set is kept. With ``gate`` (a ``limit_by`` value's gate),
        only that gate's tasks, listed in ``throttled_gates`` (expired entries dropped)."""

    async def set_limits(self, name: str, changes: Mapping[str, Any], *, clear: bool = False) -> LimitState:
        """Set operators' limits of ``name`` (``rate_limit``, ``max_running``: a value, or
        None to lift that limit whatever the code says); ``clear`` first drops every
        operator's limit, so the code's apply. The document is created when missing."""

    async def declare_limits(self, name: str, declared: Mapping[str, Any]) -> None:
        """Record the limits an app's code declares for ``name`` (shown to operators)."""

    async def read_gate(self, gate: str) -> dict[str, Any] | None:
        """The stored gate document (``taskrunner.limits.gates``), or None."""

    async def gates(self, names: Sequence[str], *, limit: int = 1000) -> list[dict[str, Any]]:
        """The stored gate documents of ``names`` (at most ``limit``), for operators."""

    async def update_gate(
        self, gate: str, expect: Mapping[str, Any], changes: Mapping[str, Any], *, create: bool = False
    ) -> dict[str, Any] | None:
        """Set ``changes`` (dotted paths, array indexes allowed) if every ``expect`` path
        holds its value (None: null or missing); ``create`` makes the document when
        missing. The document written, or None when an expectation failed."""


@dataclass(frozen=True, slots=True)
class FollowUp:
    """A task that owes a follow-up, as one read found it: ``notify`` (its dependents have
    yet to hear its ``state``) and ``link`` (its upstreams have yet to learn of it), each
    the counter read, or None when not owed (docs/workflows.md)."""

    key: str
    state: str
    notify: Any = None
    link: Any = None
    upstreams: tuple[str, ...] = ()
    """What it waits on or was canceled by: the upstreams a link marks."""
    flow: str | None = None


def follow_up_of(doc: Mapping[str, Any]) -> FollowUp | None:
    """The follow-up ``doc`` owes (None for a key that is not a string)."""
    key = doc.get(f.KEY)
    if not isinstance(key, str):
        return None
    listed = [doc.get(f.WAITING_ON), doc.get(f.CANCELED_BY)]
    upstreams = [k for keys in listed if isinstance(keys, list) for k in keys if isinstance(k, str)]
    flow = doc.get(f.FLOW)
    return FollowUp(
        key=key,
        state=str(doc.get(f.STATE)),
        notify=doc.get(f.NOTIFY),
        link=doc.get(f.LINK),
        upstreams=tuple(dict.fromkeys(upstreams)),
        flow=flow if isinstance(flow, str) else None,
    )


def counters_read(done: Sequence[FollowUp]) -> dict[tuple[str, Any], list[str]]:
    """The keys of ``done`` by counter (``notify`` or ``link``) and the value read of it."""
    grouped: dict[tuple[str, Any], list[str]] = {}
    for up in done:
        for field, value in ((f.NOTIFY, up.notify), (f.LINK, up.link)):
            if value is not None:
                grouped.setdefault((field, value), []).append(up.key)
    return grouped


class FlowStore(Protocol):
    """Workflows (``taskrunner.workflows``): the follow-ups that release, cancel and re-arm
    the tasks that run after others, and a flow's steps."""

    async def follow_ups(
        self, *, keys: Sequence[str] | None = None, after: Sequence[str] | None = None, limit: int = 100
    ) -> list[FollowUp]:
        """Tasks owing a follow-up: any (at most ``limit``), or those among ``keys``, or those
        that run after one of ``after`` (their dependents)."""

    async def mark_upstreams(self, keys: Sequence[str]) -> None:
        """``rules.mark_upstream`` on the tasks of ``keys`` (one command)."""

    async def settle(self, states: Mapping[str, str]) -> None:
        """``rules.settle`` every ``settleable`` dependent of these upstream states (one command)."""

    async def followed_up(self, done: Sequence[FollowUp]) -> None:
        """Remove each ``notify`` and ``link`` of ``done`` that still holds the value read
        (one that changed since is owed again, and stays)."""

    async def states(self, keys: Sequence[str], *, session: Session | None = None) -> dict[str, str]:
        """The state of each of ``keys`` that exists."""

    async def get_many(self, keys: Sequence[str]) -> list[Task]:
        """The tasks of ``keys`` that exist (``Task.read``), in no particular order."""

    async def dependents(self, key: str, *, limit: int = 1000) -> list[Task]:
        """Tasks that run after ``key`` (the ``after`` index), oldest first."""

    async def flow_tasks(self, flow: str, *, limit: int = 100_000) -> list[Task]:
        """A flow's steps and compensations, oldest first (the ``flow`` index)."""

    async def count_flow(self, flow: str, states: Sequence[TaskState]) -> int:
        """How many of a flow's steps (not compensations) are in ``states``."""

    async def stop_flow(self, flow: str, error: TaskError) -> int:
        """``rules.stop`` the flow's ``stoppable`` steps; how many were stopped."""


class Store(TaskStore, RegistryStore, ScheduleStore, LimitStore, FlowStore, Protocol):
    """Where tasks live: ``MongoStore`` (MongoDB) and ``MemoryStore`` (in memory, for tests)
    implement the same rules, checked by one contract test suite."""

    bound_to_loop: ClassVar[bool]
    """True when the store's connection belongs to the event loop that first used it (a
    PyMongo client); False when any loop and thread may share it (the memory store)."""
