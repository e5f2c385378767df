"""The task document as Python objects: options, worker entries, tasks.

Models validate what services publish (``NewTask``) and what workers read
(``Task.from_document``), so bad input fails with the offending field named.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Generic, Literal, Protocol, Self, TypeVar

import bson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from taskrunner.errors import InvalidTask, MalformedTask
from taskrunner.store import fields as f
from taskrunner.store import sizes


class TaskState(enum.StrEnum):
    """Summary state of a task, derived from its worker entries. WAITING: it runs after
    other tasks (``after``), not all of which succeeded yet; then it is PENDING."""

    WAITING = "WAITING"
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAIL = "FAIL"
    CANCELED = "CANCELED"

    @property
    def finished(self) -> bool:
        return self in (TaskState.SUCCESS, TaskState.FAIL, TaskState.CANCELED)


class EntryState(enum.StrEnum):
    """State of one worker's claim on a task."""

    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAIL = "FAIL"


def to_seconds(value: object) -> object:
    """Durations are given as seconds (int/float) or ``timedelta``; stored as seconds."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool):
        raise ValueError("a duration must be seconds (int/float) or a timedelta, not a bool")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a duration must be a finite number of seconds, not {value}")
    return value


def to_utc(value: object) -> object:
    """BSON dates are UTC; naive datetimes are taken as UTC and truncated to ms."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        return value.replace(microsecond=value.microsecond // 1000 * 1000)
    return value


Seconds = Annotated[float, BeforeValidator(to_seconds)]
Duration = float | timedelta
"""Seconds (``int`` or ``float``) or a ``timedelta``."""
BACKOFF_POLICIES = ("exponential", "fixed")


def to_backoff(value: object) -> str | float:
    """A backoff policy name, or a fixed delay in seconds (number or ``timedelta``)."""
    if isinstance(value, str):
        if value not in BACKOFF_POLICIES:
            raise ValueError(f"must be 'exponential', 'fixed' or a number of seconds, got {value!r}")
        return value
    seconds = to_seconds(value)
    if not isinstance(seconds, int | float) or not 0 <= seconds <= 30 * 86_400:
        raise ValueError(f"must be 'exponential', 'fixed' or 0..2592000 seconds, got {value!r}")
    return float(seconds)


Backoff = Annotated[Literal["exponential", "fixed"] | float, PlainValidator(to_backoff)]
UtcDatetime = Annotated[datetime, BeforeValidator(to_utc)]


def _bucket(value: Any) -> int | None:
    # Only routing: a hand-written or foreign bucket never makes a document unreadable.
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < f.BUCKETS
    return value if ok else None


Bucket = Annotated[int | None, BeforeValidator(_bucket)]


def _carrier(value: Any) -> dict[str, str] | None:
    # Only tracing: a hand-written or foreign trace context never makes a document unreadable.
    ok = isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values())
    return {str(k): v for k, v in value.items()} if ok else None


TraceCarrier = Annotated[dict[str, str] | None, BeforeValidator(_carrier)]
"""A task's ``trace`` field: the publishing span's propagated context (``fields.TRACE``)."""

DAY = 86_400.0
MAX_KEY_LENGTH = 512
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:\-]{0,199}$")


class TaskOptions(BaseModel):
    """Per-task execution options (stored under ``options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: int = Field(1, ge=1, le=1000)
    """How many distinct workers must each succeed; at most that many run at once."""
    max_failures: int = Field(3, ge=1, le=10_000)
    """Task-wide budget: after this many failed runs the task is FAIL."""
    local_retries: int = Field(0, ge=0, le=100)
    """In-process retries of a crashing handler before a failure is recorded."""
    retry_backoff: Seconds = Field(10.0, ge=0, le=30 * DAY)
    """The base delay, in seconds, before a retry (local, or a new claim after a failure):
    ``backoff="fixed"`` waits exactly this long."""
    backoff: Backoff = "exponential"
    """How retries are spaced (docs/retries.md): ``"exponential"`` waits a random time up
    to ``min(backoff_cap, retry_backoff * backoff_factor ** (failures - 1))`` (full jitter),
    ``"fixed"`` waits ``retry_backoff``, a number waits that many seconds. Setting
    ``retry_backoff`` alone means ``"fixed"``, as before backoff policies existed."""
    backoff_factor: float = Field(2.0, ge=1, le=100)
    backoff_cap: Seconds = Field(3600.0, ge=0, le=30 * DAY)
    ping_interval: Seconds = Field(5.0, gt=0, le=DAY)
    ping_timeout: Seconds = Field(30.0, gt=0, le=7 * DAY)
    worker_ids: list[str] = Field(default_factory=list, max_length=1000)
    """Workers allowed to run the task; empty means any worker."""
    timeout: Seconds | None = Field(None, gt=0, le=7 * DAY)
    """An optional per-task timeout cancels a hanging handler: each call (attempt) of the
    handler gets this many seconds, then fails with ``TimeoutError``."""

    @model_validator(mode="before")
    @classmethod
    def _explicit_delay_is_fixed(cls, data: Any) -> Any:
        if isinstance(data, dict) and f.RETRY_BACKOFF in data and f.BACKOFF not in data:
            return {**data, f.BACKOFF: "fixed"}
        return data

    @staticmethod
    def set_by(names: Iterable[str]) -> frozenset[str]:
        """The options a call naming ``names`` sets: ``retry_backoff`` without ``backoff``
        sets ``backoff`` too (to ``"fixed"``, as validation does)."""
        named = frozenset(names)
        return named | {f.BACKOFF} if f.RETRY_BACKOFF in named else named

    @field_validator("worker_ids")
    @classmethod
    def _non_empty_ids(cls, ids: list[str]) -> list[str]:
        if any(not i for i in ids):
            raise ValueError("worker ids must be non-empty strings")
        for worker_id in ids:
            sizes.check_worker_id(worker_id)
        return list(dict.fromkeys(ids))

    @model_validator(mode="after")
    def _timeout_exceeds_interval(self) -> Self:
        if self.ping_timeout <= self.ping_interval:
            raise ValueError(
                f"ping_timeout ({self.ping_timeout}s) must be longer than "
                f"ping_interval ({self.ping_interval}s), or leases expire between pings"
            )
        return self


UpstreamPolicy = Literal["cancel", "run"]


class TaskError(BaseModel):
    """What went wrong in a run: exception type, message and traceback."""

    model_config = ConfigDict(frozen=True)

    type: str
    message: str
    traceback: str | None = None


class WorkerEntry(BaseModel):
    """One claim of a task by a worker (an element of ``workers``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    worker_id: str
    run_id: str
    state: EntryState
    claimed_at: UtcDatetime
    ping_at: UtcDatetime
    expires_at: UtcDatetime
    attempt: int = 1
    progress: Any = None
    result: Any = None
    error: TaskError | None = None
    finished_at: UtcDatetime | None = None
    took_over: list[str] = Field(default_factory=list)
    """Workers whose expired leases this claim dropped (a takeover)."""


class Compensation(BaseModel):
    """The task that undoes a flow's step (``flow.add(..., compensate=(name, params))``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


def _check_after(key: str, after: list[str]) -> list[str]:
    """``after`` without repeats; a key of its own or an empty one is an error."""
    for upstream in after:
        if not upstream:
            raise ValueError("a key in after must be a non-empty string")
        if upstream == key:
            raise ValueError(f"a task cannot run after itself ({key!r} names its own key)")
    return list(dict.fromkeys(after))


class NewTask(BaseModel):
    """A task as a service publishes it, validated before anything is written."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    run_at: UtcDatetime | None = None
    delay: Seconds | None = Field(None, ge=0, le=366 * DAY)
    """Start no earlier than this many seconds after publishing, by the server's clock."""
    options: TaskOptions = Field(default_factory=lambda: TaskOptions())
    after: list[str] = Field(default_factory=list, max_length=100_000)
    """Keys of the tasks this one runs after: it is WAITING until each is SUCCESS."""
    on_upstream_failure: UpstreamPolicy = "cancel"
    """``"cancel"``: an upstream ending FAIL or CANCELED cancels this task; ``"run"``: it
    runs once every upstream finished, whatever their states (``ctx.upstream`` has them)."""
    flow: str | None = Field(None, min_length=1, max_length=MAX_KEY_LENGTH)
    compensate: Compensation | None = None
    compensates: str | None = None
    dependents: bool = False
    """Set by publishing when a later task of the same call runs after this one."""
    trace: dict[str, str] | None = None
    """The publishing span's context (``fields.TRACE``), set by publishing with tracing on."""

    @model_validator(mode="after")
    def _valid_after(self) -> Self:
        try:
            checked = _check_after(self.key, self.after)
        except ValueError as exc:
            raise InvalidTask("after", str(exc)) from None
        if checked != self.after:
            object.__setattr__(self, "after", checked)
        return self

    @model_validator(mode="after")
    def _one_start_time(self) -> Self:
        if self.run_at is not None and self.delay is not None:
            raise ValueError("give run_at or delay, not both")
        return self

    @field_validator("params")
    @classmethod
    def _bson_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        try:
            bson.encode(params)
        except (bson.errors.InvalidDocument, OverflowError, TypeError) as exc:
            raise ValueError(f"cannot be stored as BSON: {exc}") from None
        return params

    @model_validator(mode="after")
    def _fits_a_document(self) -> Self:
        refusal = self.budget().refusal()
        if refusal is not None:
            raise InvalidTask(*refusal)
        return self

    def budget(self) -> sizes.Budget:
        """How this task's document is shared out between its params and its runs."""
        options = self.options.model_dump()
        params = sizes.params_bytes(self.params) + _links_bytes(self.after, self.compensate)
        return sizes.budget(
            key=self.key, name=self.name, priority=self.priority, options=options, params=params
        )

    @field_validator("key")
    @classmethod
    def _printable_key(cls, key: str) -> str:
        if not key.isprintable():
            raise ValueError("must contain printable characters only")
        return key

    @field_validator("name")
    @classmethod
    def _identifier_name(cls, name: str) -> str:
        if not _NAME_RE.match(name):
            raise ValueError(
                "must start with a letter or _ and contain only letters, digits, _ . : -"
                " (at most 200 characters)"
            )
        return name

    def naming(self, fields: Iterable[str], options: Iterable[str] = ()) -> NewTask:
        """This task as a publish call that named only ``fields`` (and, of the options,
        ``options``) gives it: they become its ``model_fields_set`` and its options', which
        is all ``update_pending`` rewrites of a stored task (``rules.pending_changes``)."""
        named_options = TaskOptions.model_construct(_fields_set=set(options), **dict(self.options))
        return NewTask.model_construct(_fields_set=set(fields), **{**dict(self), "options": named_options})

    @classmethod
    def build(cls, **values: Any) -> NewTask:
        """Validate, turning pydantic's error into ``InvalidTask`` naming the field."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise invalid_task(exc) from None


def _links_bytes(after: list[str], compensate: Compensation | None) -> int:
    """What a task's workflow fields add to its document: ``after`` and ``waiting_on``
    (the same keys at most), and its compensation."""
    if not after and compensate is None:
        return 0
    links: dict[str, Any] = {f.AFTER: after, f.WAITING_ON: after}
    if compensate is not None:
        links[f.COMPENSATE] = compensate.model_dump()
    return sizes.added_bytes(links)


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
SERVER_READS = (f.FAILURES, f.PRIORITY)
SERVER_OPTIONS = (f.CONCURRENCY, f.MAX_FAILURES, f.RETRY_BACKOFF, f.PING_TIMEOUT, f.WORKER_IDS)
"""What the server's claims and outcomes compute with: the model would fill a missing one
with its default or read ``"2"`` as 2, but the server's filters and updates do neither,
so a document lacking one is never claimed (or leases without an expiry); likewise an
unfinished task without a ``claimable_at`` date."""


def _unserved(doc: dict[str, Any]) -> tuple[str, str] | None:
    """The first field the server needs that ``doc`` lacks or holds as a string (or why the
    store could not decode it)."""
    if isinstance(undecodable := doc.get(f.UNDECODABLE), str):
        return "", undecodable
    options = doc.get(f.OPTIONS)
    found = (
        {f.opt(name): options.get(name, _MISSING) for name in SERVER_OPTIONS}
        if isinstance(options, dict)
        else {}
    )
    found |= {name: doc.get(name, _MISSING) for name in SERVER_READS}
    for path, value in found.items():
        if value is _MISSING:
            return path, f"{path}: missing (a worker fills in its default)"
        if isinstance(value, str):
            return path, f"{path}: must be a number, not a string (got {value!r:.100})"
    claimable_at = doc.get(f.CLAIMABLE_AT, _MISSING)
    if doc.get(f.STATE) in (TaskState.PENDING, TaskState.RUNNING) and not isinstance(claimable_at, datetime):
        got = "missing" if claimable_at is _MISSING else f"got {claimable_at!r:.100}"
        return f.CLAIMABLE_AT, f"{f.CLAIMABLE_AT}: a PENDING or RUNNING task needs a date here ({got})"
    return None


_MISSING = object()


def _placeholder(values: dict[str, Any], doc: dict[str, Any], field: str) -> None:
    """Put a readable stand-in for ``field`` into ``values`` (or drop it: its default)."""
    oid = doc.get(f.ID)
    born = oid.generation_time if isinstance(oid, bson.ObjectId) else EPOCH  # when it was inserted
    key = doc.get(f.KEY)
    stand_ins: dict[str, Any] = {
        f.KEY: key if isinstance(key, str) and key else str(oid),
        f.NAME: str(doc.get(f.NAME, "")),
        f.PARAMS: {},
        f.PRIORITY: 0,
        f.CREATED_AT: born,
        f.UPDATED_AT: born,
        f.RUN_AT: born,
        f.OPTIONS: {},
        f.WORKERS: [],
        f.STATE: TaskState.PENDING.value,
    }
    if field in stand_ins:
        values[field] = stand_ins[field]
    else:
        values.pop(field, None)


def described(exc: ValidationError) -> tuple[str, str]:
    """The first problem of a validation error: its dotted field path, and
    ``path: message (got value)`` (no value when the field is missing)."""
    err = exc.errors()[0]
    path = ".".join(str(p) for p in err["loc"])
    got = "" if err["type"] == "missing" else f" (got {err['input']!r:.100})"
    return path, f"{path}: {err['msg']}{got}"


def first_error(exc: ValidationError) -> str:
    """The first problem of a validation error as ``dotted.path: message``."""
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"


def invalid_task(exc: ValidationError, prefix: str = "", cls: type[InvalidTask] = InvalidTask) -> InvalidTask:
    """Every problem of a validation error as one ``InvalidTask``, each naming its dotted
    field path (pydantic reports all of a model's bad fields, not only the first). A check
    of the whole task (its document's budget) names its own field."""
    problems: list[tuple[str, str]] = []
    for err in exc.errors():
        raised = err.get("ctx", {}).get("error")
        if isinstance(raised, InvalidTask) and not prefix and cls is InvalidTask:
            problems += raised.problems
        else:
            path = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
            problems.append((path or "task", err["msg"]))
    (field, message), *more = problems
    return cls(field, message, more=more)


class Waiter(Protocol):
    """What ``Task.wait`` waits with: the ``TaskRunner`` that returned it."""

    async def wait(self, key: str, timeout: float | None = None) -> Task: ...  # noqa: ASYNC109


class SyncWaiter(Protocol):
    """What ``SyncTask.wait`` waits with: the ``SyncTaskRunner`` that returned it."""

    def wait(self, key: str, timeout: float | None = None) -> SyncTask: ...


W = TypeVar("W")


class _Binding(Generic[W]):
    """The runner a task waits with. No part of the task's value: equal whatever it holds,
    shared by copies, and dropped by pickling (a runner holds a connection)."""

    __slots__ = ("waiter",)

    def __init__(self, waiter: W | None = None) -> None:
        self.waiter = waiter

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Binding)

    def __hash__(self) -> int:
        return 0

    def __deepcopy__(self, memo: dict[int, Any]) -> _Binding[W]:
        return self

    def __reduce__(self) -> tuple[type[_Binding[W]], tuple[()]]:
        return _Binding, ()


def _unbound(key: str) -> RuntimeError:
    return RuntimeError(
        f"task {key!r} was not returned by a TaskRunner (it was built or read "
        "directly), so it knows no runner to wait with: use runner.wait(task.key)"
    )


class Unreadable(BaseModel):
    """A stored document no model reads (written by hand, or by another version): its key
    or id when it has a string one, and the first problem, ``field: message (got value)``.
    Reads, scans and streams hand one back in the document's place; nothing stops on it."""

    model_config = ConfigDict(frozen=True)

    key: str | None
    problem: str

    def __str__(self) -> str:
        return self.problem

    @classmethod
    def of(cls, doc: Mapping[str, Any], error: MalformedTask | str) -> Unreadable:
        """``doc`` as unreadable for ``error`` (the exception a read raised, or its message)."""
        key = doc.get(f.KEY, doc.get(f.ID))
        problem = error.problem if isinstance(error, MalformedTask) else error
        return cls(key=key if isinstance(key, str) else None, problem=problem)


class StoredTask(BaseModel):
    """A stored task, read back from its document: every field, no way to wait.

    Runners return it as a handle that can wait for it: ``Task`` from a ``TaskRunner``
    (``await task.wait()``) and ``SyncTask`` from a ``SyncTaskRunner`` (``task.wait()``
    blocks). Annotate ``StoredTask`` where code takes either."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    key: str
    name: str
    params: dict[str, Any]
    priority: int
    created_at: UtcDatetime
    updated_at: UtcDatetime
    run_at: UtcDatetime
    options: TaskOptions
    workers: list[WorkerEntry]
    state: TaskState
    failures: int = 0
    attempts: int = 0
    fatal: bool = False
    """A failure that is never retried ended the task (``Fail``, params the handler rejects)."""
    snoozes: int = 0
    """Runs that ended by ``Retry``, ``ctx.snooze`` or ``RateLimited``: rescheduled, no failure counted."""
    claimable_at: UtcDatetime | None = None
    """When a new claim may happen (server time); a stored PENDING or RUNNING task has one."""
    finished_at: UtcDatetime | None = None
    bucket: Bucket = None
    """Which worker's stream hears the insert (``fields.BUCKETS``); None when missing or out of range."""
    error: TaskError | None = None
    """Why no worker can run the document as written: set with state FAIL (and ``fatal``)
    when a worker found it unreadable; its type is ``MalformedTask`` and its message names
    the field and the value (docs/schema.md, "Documents written by hand")."""
    unreadable: Unreadable | None = None
    """Only on a task read from a document that does not follow the schema (``Task.read``):
    what a scan reports of it; the fields that do not read hold placeholders."""
    after: list[str] = Field(default_factory=list)
    """Keys of the tasks this one runs after (docs/workflows.md)."""
    waiting_on: list[str] = Field(default_factory=list)
    """Of ``after``, those it still waits for (WAITING), or that it did not see succeed."""
    on_upstream_failure: UpstreamPolicy = "cancel"
    canceled_by: list[str] = Field(default_factory=list)
    """Upstreams whose FAIL or CANCELED canceled this task (retrying one re-arms it)."""
    dependents: bool = False
    """Other tasks run after this one (or its flow undoes steps when one fails)."""
    flow: str | None = None
    """The flow this task is a step of (``runner.flow``)."""
    compensate: Compensation | None = None
    """The task that undoes this step if its flow fails."""
    compensates: str | None = None
    """On a compensation: the key of the step it undoes."""
    trace: TraceCarrier = None
    """The context of the span that published (or retried) it, the parent of its runs'
    spans (docs/observability.md); None without tracing, or when it does not read."""
    created: bool = Field(False, exclude=True)
    """True when the publish call that returned this task inserted it."""

    @classmethod
    def from_document(cls, doc: dict[str, Any], *, created: bool = False) -> Self:
        """The task in ``doc``; raises ``MalformedTask`` naming the first field that does not read."""
        try:
            task = cls.model_validate({**doc, "unreadable": None, "created": created})
        except ValidationError as exc:
            field, problem = described(exc)
            raise MalformedTask(doc.get(f.KEY, doc.get(f.ID)), problem, field=field) from None
        unserved = _unserved(doc)
        if unserved is not None:
            raise MalformedTask(doc.get(f.KEY, doc.get(f.ID)), unserved[1], field=unserved[0])
        return task

    @classmethod
    def read(cls, doc: dict[str, Any], *, created: bool = False) -> Self:
        """The task in ``doc`` even when the document does not follow the schema: then
        ``unreadable`` says why and each field that does not read holds a placeholder, so
        operators can list, show, cancel, retry and purge it."""
        try:
            return cls.from_document(doc, created=created)
        except MalformedTask as exc:
            values = {**doc, "unreadable": Unreadable.of(doc, exc), "created": created}
        for _ in range(len(values)):  # each pass replaces what the last one could not read
            try:
                return cls.model_validate(values)
            except ValidationError as exc:
                for field in {str(e["loc"][0]) for e in exc.errors()}:
                    _placeholder(values, doc, field)
        raise AssertionError(f"no placeholder makes {doc!r} readable")

    def entry(self, run_id: str) -> WorkerEntry | None:
        return next((w for w in self.workers if w.run_id == run_id), None)

    def budget(self) -> sizes.Budget:
        """How this task's document is shared out between its params and its runs: what
        a worker lets a run record (docs/publishing.md, "How big params and results may be")."""
        try:
            params = sizes.params_bytes(self.params) + _links_bytes(self.after, self.compensate)
        except (bson.errors.InvalidDocument, OverflowError, TypeError):
            params = 0  # not from MongoDB (a test store's hand-made document): nothing to measure
        options = self.options.model_dump()
        return sizes.budget(
            key=self.key, name=self.name, priority=self.priority, options=options, params=params
        )

    @property
    def successes(self) -> int:
        return sum(w.state is EntryState.SUCCESS for w in self.workers)

    @property
    def results(self) -> list[Any]:
        """The results of the successful runs, in claim order."""
        return [w.result for w in self.workers if w.state is EntryState.SUCCESS]

    @property
    def errors(self) -> list[TaskError]:
        """The error records of the failed runs, in claim order, then the document's own
        ``error`` when a worker marked it unreadable."""
        runs = [w.error for w in self.workers if w.state is EntryState.FAIL and w.error is not None]
        return [*runs, self.error] if self.error is not None else runs

    @property
    def last_error(self) -> TaskError | None:
        errors = self.errors
        return errors[-1] if errors else None


class Task(StoredTask):
    """A stored task as a ``TaskRunner`` returns it: ``await task.wait()`` waits for it."""

    _binding: _Binding[Waiter] = PrivateAttr(default_factory=_Binding)

    async def wait(self, timeout: float | None = None) -> Task:  # noqa: ASYNC109
        """Wait until this task is SUCCESS, FAIL or CANCELED and return it as stored then,
        as ``runner.wait(task.key, timeout)`` does: raises ``WaitTimeout`` after ``timeout``
        seconds. Works on tasks a ``TaskRunner`` returned."""
        waiter = self._binding.waiter
        if waiter is None:
            raise _unbound(self.key)
        return await waiter.wait(self.key, timeout)

    def bound(self, waiter: Waiter) -> Task:
        """A copy whose ``wait`` waits with ``waiter`` (runners bind the tasks they return)."""
        copy = self.model_copy()
        copy._binding = _Binding(waiter)
        return copy


class SyncTask(StoredTask):
    """A stored task as a ``SyncTaskRunner`` returns it: ``task.wait()`` blocks until it
    finishes and returns it (a ``SyncTask`` again).

    It is not a ``Task``: one method cannot both block and be awaited, so each handle has
    its own ``wait`` and type checkers tell them apart (``await`` on this one's result, or
    a ``Task.wait()`` left un-awaited, is an error under mypy)."""

    _binding: _Binding[SyncWaiter] = PrivateAttr(default_factory=_Binding)

    def wait(self, timeout: float | None = None) -> SyncTask:
        """Block until this task is SUCCESS, FAIL or CANCELED and return it as stored then,
        as ``sync_runner.wait(task.key, timeout)`` does: raises ``WaitTimeout`` after
        ``timeout`` seconds, ``RunnerClosed`` once its ``SyncTaskRunner`` is closed."""
        waiter = self._binding.waiter
        if waiter is None:
            raise _unbound(self.key)
        return waiter.wait(self.key, timeout)

    @classmethod
    def of(cls, task: StoredTask, waiter: SyncWaiter) -> SyncTask:
        """``task`` as a handle whose ``wait`` blocks on ``waiter``."""
        handle = cls.model_construct(_fields_set=set(task.model_fields_set), **dict(task))
        handle._binding = _Binding(waiter)
        return handle


class WorkerInfo(BaseModel):
    """A live worker as it registers itself (the registry collection)."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    worker_id: str = Field(alias="_id")
    host: str
    pid: int
    started_at: UtcDatetime
    names: list[str]
    concurrency: int
    running: list[str] = Field(default_factory=list)
    """Keys of the tasks it runs now."""
    version: str = ""
    beat_at: UtcDatetime | None = None
    expires_at: UtcDatetime | None = None
    stop_requested: bool = False
    """Set by ``taskrunner stop-worker``; the worker shuts down gracefully at its next beat."""
    schedules: list[str] = Field(default_factory=list)
    """Ids of the schedules its app declares (it fires them)."""
    paused: list[str] = Field(default_factory=list)
    """Names it serves but does not claim now: paused (``taskrunner pause``)."""


class TaskPage(BaseModel):
    """One page of a listing (``runner.failed``) and where the next one starts: pass
    ``after`` back for it (None: this is the last page)."""

    tasks: list[Task]
    after: str | None = None


class PinnedAway(BaseModel):
    """Unfinished tasks pinned (``options.worker_ids``) only to ids no live worker has: they
    wait until a worker with one of those ids runs (a typo, a worker gone for good)."""

    worker_ids: list[str]
    tasks: int
    keys: list[str]
    """The first few of their keys, in key order."""

    @field_validator("worker_ids", mode="before")
    @classmethod
    def _as_text(cls, value: Any) -> list[str]:
        """A stored ``worker_ids`` as text: an array's items, or a lone value written by hand."""
        return [str(v) for v in value] if isinstance(value, list) else [str(value)]


class TaskStats(BaseModel):
    """Counts for dashboards, computed by one aggregation (``taskrunner stats``)."""

    counts: dict[str, dict[str, int]]
    """Task name -> state -> number of tasks."""
    running: int
    oldest_pending_seconds: float | None
    """Age of the oldest PENDING task (server time), None when there is none."""
    finished_last_hour: int
    """Runs (worker entries) that succeeded or failed in the last hour."""
    failed_last_hour: int
    paused: list[str] = Field(default_factory=list)
    """Task names paused (``taskrunner pause``); ``"*"`` when every name is."""
    unserved: dict[str, int] = Field(default_factory=dict)
    """Task name -> PENDING tasks, for names no live worker serves (a typo, a missing deploy)."""
    pinned_away: list[PinnedAway] = Field(default_factory=list)
    """Unfinished tasks whose ``worker_ids`` name no live worker, by their ``worker_ids``."""

    @property
    def failure_rate_last_hour(self) -> float | None:
        return self.failed_last_hour / self.finished_last_hour if self.finished_last_hour else None


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, None: 1}


def parse_duration(text: str) -> float:
    """Seconds from '90', '1.5s', '30m', '12h', '7d' or '2w'."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r}; use e.g. 30s, 15m, 12h, 7d")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
