"""taskrunner's exceptions. Driver errors never cross the store boundary.

::

    TaskRunnerError
    ├── InvalidTask (ValueError)        bad input on publish; names every bad field
    │   ├── InvalidParams               params fail the handler's model
    │   ├── UnknownTaskName (LookupError) no handler has that name (publish, or a run: FAIL)
    │   ├── UnknownUpstream (LookupError) a key in ``after`` names no task
    │   └── InvalidSchedule             a bad schedule declaration; names the field
    ├── TaskNotFound (LookupError)      no task with that key
    ├── ScheduleNotFound (LookupError)  no schedule with that id
    ├── FlowNotFound (LookupError)      no task of a flow with that id
    ├── InvalidState                    the task's state does not allow that (e.g. retry a SUCCESS)
    ├── WaitTimeout (TimeoutError)      wait() gave up; ``task`` holds the last state seen
    ├── MalformedTask                   a stored document taskrunner cannot read
    ├── ClaimLost                       a write's run_id no longer owns its entry
    ├── RunnerClosed (RuntimeError)     a SyncTaskRunner used after close()
    ├── ConfigurationError              bad worker options, app reference, or an app without handlers
    │   └── ServerTooOld                MongoDB older than taskrunner needs; names both versions
    └── StoreError                      the database failed the operation
        ├── StoreUnavailable            unreachable or timed out; retryable
        ├── WriteRejected               refused, e.g. by a $jsonSchema validator
        │   └── DocumentTooLarge        the document would exceed MongoDB's 16 MiB
        ├── DuplicateKey                a unique index refused an insert: another writer was first
        ├── PartialBulkWrite            some writes of one bulk write failed; each one's error
        ├── ChangeHistoryLost           a change stream cannot resume; rescan
        ├── ChangeStreamEnded           the server ended a change stream; open a new one, rescan
        └── ChangeStreamsUnsupported    e.g. a standalone mongod; poll instead

    NoLiveWorkerWarning (UserWarning)   a warning, not an error: pause, limit or publish named a
                                        task name no live worker serves or an id no live worker has

    Fail (Exception)                    raised by a handler: FAIL now, never retried
    Retry (Exception)                   raised by a handler: run again later, no failure counted
    └── RateLimited                     ... and start no task of this name for a while
"""

from __future__ import annotations

from collections.abc import Sequence


class TaskRunnerError(Exception):
    """Base class of every error taskrunner raises (``Fail``, ``Retry`` and
    ``NoLiveWorkerWarning`` are not errors of taskrunner's, so they are not under it).

    Catch it to handle whatever taskrunner refused or could not do; a handler's own
    exceptions never arrive as one (they end the run, recorded in ``task.errors``)."""


class InvalidTask(TaskRunnerError, ValueError):
    """A task cannot be published as given. ``problems`` lists every offending part as
    (dotted field path, message), so one call reports all that must change; ``field`` and
    ``message`` are the first of them. Nothing was written.

    Raised by ``publish``, ``publish_many`` and ``publish_specs`` (paths under
    ``tasks[i]``), ``new_task`` and ``Flow.publish`` for a bad field or option, an unknown
    option name, a key twice in one batch, params too large to store; by ``@runner.task`` for unknown option names or bad
    limits; by ``Flow`` and ``Flow.add`` for a bad flow id or a step key used twice; by
    ``set_limits``, ``pause`` and ``limits`` for a bad name (``"*"`` for limits) or a
    stored limits document that no longer reads; by ``failed`` for ``limit`` < 1 or a bad
    ``after``; by ``purge`` for an unfinished state. Also a ``ValueError``.
    What to do: fix the call as ``problems`` says; retrying it unchanged fails again."""

    def __init__(self, field: str, message: str, *, more: Sequence[tuple[str, str]] = ()) -> None:
        self.field = field
        self.message = message
        self.problems: list[tuple[str, str]] = [(field, message), *more]
        super().__init__(self._text())

    def _text(self) -> str:
        return "; ".join(f"{field}: {message}" for field, message in self.problems)

    def place(self, prefix: str) -> None:
        """Put every field path under ``prefix`` (e.g. ``tasks[1]``: an item of a batch)."""
        self.problems = [(f"{prefix}.{field}", message) for field, message in self.problems]
        self.field = self.problems[0][0]
        self.args = (self._text(),)


class InvalidParams(InvalidTask):
    """The params do not validate against the handler's model (or, for a handler without
    a model, are not an object).

    Raised by ``publish``, ``publish_many``, ``runner.schedule`` and ``Flow.publish`` when
    this runner has the handler; a worker that meets such params in a stored task (written
    by another app) ends it FAIL with ``fatal`` and this error, without calling the
    handler. What to do: send params the model accepts (``problems`` names each field)."""


class UnknownTaskName(InvalidTask, LookupError):
    """A task name no handler of this runner has (``name``; ``known`` are the registered
    ones). ``publish``, ``publish_many``, ``runner.schedule`` and ``Flow.publish`` raise it
    on a runner with handlers (likely a typo; ``allow_unknown=True`` publishes it anyway,
    for workers of another app; a runner without handlers publishes any name); a run of
    such a name ends FAIL with it, since no other attempt can find a handler.
    What to do: fix the name, or pass ``allow_unknown=True`` when another app runs it."""

    def __init__(self, name: str, known: list[str], *, hint: str = "") -> None:
        self.name, self.known = name, known
        listed = f" (known: {', '.join(known)})" if known else ""
        super().__init__("name", f"no handler registered for task name {name!r}{listed}{hint}")


class InvalidSchedule(InvalidTask):
    """A schedule cannot be declared as given (cron, every, timezone, catch_up, ...).

    Raised by ``runner.schedule`` at declaration, naming the field: an invalid cron
    expression, both or neither of ``cron`` and ``every``, ``every`` below 1 s, an id this
    runner declared already, an unknown time zone or ``catch_up``; and by
    ``pause_schedule``/``resume_schedule`` when the stored schedule no longer reads (edited
    by hand). What to do: fix the declaration (or the stored document)."""


class ScheduleNotFound(TaskRunnerError, LookupError):
    """No stored schedule has that id; ``schedule_id`` names it.

    Raised by ``pause_schedule``, ``resume_schedule`` and ``trigger_schedule``. Schedules
    are stored by the app's workers when they start, so a schedule declared in code but
    never run by a worker is not stored yet. What to do: check the id
    (``schedule_overview`` lists the stored ones), or start a worker of the app first."""

    def __init__(self, schedule_id: str) -> None:
        self.schedule_id = schedule_id
        super().__init__(f"no schedule with id {schedule_id!r}")


class UnknownUpstream(InvalidTask, LookupError):
    """A key in ``after`` names no stored task and no task earlier in the same publish call
    (``upstream`` names it, ``key`` the task that named it); nothing was published.

    Raised by ``publish``, ``publish_many`` and ``Flow.publish``. What to do: publish the
    upstream first (or earlier in the same batch), or fix the key; an upstream purged
    already cannot be waited for."""

    def __init__(self, key: str, upstream: str) -> None:
        self.key, self.upstream = key, upstream
        message = (
            f"task {key!r} runs after {upstream!r}, which is neither stored nor published earlier "
            "in this call (publish upstreams first)"
        )
        super().__init__("after", message)


class FlowNotFound(TaskRunnerError, LookupError):
    """No task belongs to a flow of that id; ``flow`` names it.

    Raised by ``get_flow`` (and ``SyncTaskRunner.get_flow``); the dashboard answers 404.
    What to do: check the id (a flow exists once ``Flow.publish`` stored its steps, and
    until they are purged)."""

    def __init__(self, flow: str) -> None:
        self.flow = flow
        super().__init__(f"no flow with id {flow!r}")


class TaskNotFound(TaskRunnerError, LookupError):
    """No task has that key; ``key`` names it.

    Raised by ``get``, ``wait`` (and ``Task.wait``), ``cancel``, ``retry`` and
    ``upstream`` for a key never published or purged since. What to do: check the key;
    ``publish`` it if it should exist."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"no task with key {key!r}")


class InvalidState(TaskRunnerError):
    """The task's state does not allow the operation; ``key`` and ``state`` name the task
    and its state.

    Raised by ``cancel`` for a task already SUCCESS or FAIL (canceling twice is
    harmless), and by ``retry`` for a task that is not FAIL or CANCELED, or whose last run
    is still stopping on a worker. What to do: read the task (``get``) and act on its state; a retry refused
    because a run is stopping succeeds once it has stopped."""

    def __init__(self, key: str, state: str, operation: str, allowed: str, *, why: str = "") -> None:
        self.key, self.state = key, state
        super().__init__(
            f"cannot {operation} task {key!r}: it is {state}; {why or f'only {allowed} tasks can be'}"
        )


class WaitTimeout(TaskRunnerError, TimeoutError):
    """``wait`` reached its timeout before the task finished; ``task`` holds the task as
    last seen (still unfinished) and ``key`` its key.

    Raised by ``wait`` and ``Task.wait`` (and their ``SyncTaskRunner``/``SyncTask`` forms)
    given a ``timeout``. Also a ``TimeoutError``. The task goes on: waiting stopped, the
    task did not. What to do: wait again, or ``cancel`` it if it should not run anymore."""

    def __init__(self, key: str, timeout: float, task: object) -> None:
        self.key, self.task = key, task
        super().__init__(f"task {key!r} did not finish within {timeout:g} s")


class MalformedTask(TaskRunnerError):
    """A stored document does not follow the task schema: ``field`` names the first field
    that does not read, ``problem`` what is wrong, ``key`` the document's key (or id).

    Raised by ``Task.from_document``. Reads never raise it: ``get``, ``list_tasks`` and
    the rest return such a task with ``unreadable`` set, and a worker that claims one
    ends it FAIL with ``fatal`` and an ``error`` of type ``MalformedTask``
    (docs/schema.md, "Documents written by hand"). What to do: fix or delete the
    document, then ``retry`` it."""

    def __init__(self, key: object, problem: str, *, field: str = "") -> None:
        self.key = key
        self.problem = problem
        self.field = field
        """The dotted path of the field that does not read ("" when not known)."""
        super().__init__(f"malformed task document {key!r}: {problem}")


class ClaimLost(TaskRunnerError):
    """The run's entry is gone or finished: another owner, a release or a takeover."""

    def __init__(self, key: str, run_id: str) -> None:
        self.key = key
        self.run_id = run_id
        super().__init__(f"claim lost on task {key!r} (run {run_id})")


class RunnerClosed(TaskRunnerError, RuntimeError):
    """A ``SyncTaskRunner`` was used after ``close()`` (or its ``with`` block ended): its
    connection and event loop are gone. ``operation`` names the call.

    Raised by the ``SyncTaskRunner`` calls that reach the database (``publish``,
    ``publish_many``, ``get``, ``init``, ``wait``, ``cancel``, ``retry``, ``publish_flow``,
    ``get_flow``) and a ``SyncTask``'s ``wait``; ``close`` may be called again. Also a ``RuntimeError``. What to do: make a new one with ``runner.sync()``."""

    def __init__(self, operation: str) -> None:
        self.operation = operation
        super().__init__(
            f"cannot {operation}: this SyncTaskRunner is closed; make a new one with runner.sync()"
        )


class ConfigurationError(TaskRunnerError):
    """taskrunner was set up wrongly, before any task ran.

    Raised by ``WorkerOptions``, ``Worker``, ``run_worker`` and ``taskrunner worker`` for
    an option out of range or unknown (the message names it); by ``Worker.run`` (and
    ``run_worker``) for an app without handlers; by the CLI's ``--app MODULE:OBJECT``
    (``TASKRUNNER_APP``) when it does not import or is not a ``TaskRunner``. A MongoDB
    URI that does not parse is a ``StoreError`` instead (it is the driver's to judge).
    What to do: fix the setting the message names."""


class ServerTooOld(ConfigurationError):
    """The MongoDB server is older than the oldest version taskrunner runs on (the start-up
    check of ``TaskRunner.init`` and of a worker); ``version`` is the server's, ``minimum``
    the oldest supported (docs/compatibility.md).

    Raised by ``init`` (``taskrunner init``) and when a worker starts (``Worker.run``,
    ``run_worker``, ``taskrunner worker``); nothing was written. What to do: upgrade the
    server."""

    def __init__(self, version: str, minimum: str, why: str) -> None:
        self.version, self.minimum = version, minimum
        super().__init__(
            f"MongoDB {version} is older than {minimum}, the oldest version taskrunner runs on "
            f"({why}); upgrade the server (docs/compatibility.md)"
        )


class StoreError(TaskRunnerError):
    """The database could not carry out an operation: the driver's error, mapped at the
    store boundary (its message, credentials redacted).

    Raised by any call that reaches MongoDB (``publish``, ``get``, ``wait``, ``init``,
    ...): a command the server refused, a document that does not decode, a MongoDB URI
    that does not parse (at the first call that connects). Its subclasses say more; the
    worker handles them itself, so they reach your code only from the calls you make.
    What to do: read the message; a ``StoreUnavailable`` may be retried as it is."""


class StoreUnavailable(StoreError):
    """The database could not be reached in time (no server selected within the
    runner's ``timeout``, a connection refused or dropped); the operation may be retried.

    Raised by any call that reaches MongoDB. A publish that raised it may have landed:
    publishing is idempotent by key, so publish again with the same key. Workers ride
    outages out on their own (one log line when the server goes, one when it is back).
    What to do: retry, with a backoff, once the server is back."""


class ClaimUnconfirmed(StoreUnavailable):
    """A claim met a transport error after it was sent, so it may have landed, and reading
    back what it claimed failed too: ``Store.recover(worker_id, run_ids, keys=keys)`` finds
    what landed (``keys`` None: a claim without a key)."""

    def __init__(self, message: str, run_ids: list[str], keys: list[str] | None) -> None:
        self.run_ids, self.keys = run_ids, keys
        super().__init__(message)


class WriteRejected(StoreError):
    """The database refused a write: the collection's ``$jsonSchema`` validator
    (``init(validator=True)``) rejected a document, or it is too large
    (``DocumentTooLarge``).

    Raised by the call that wrote (``publish``, ``cancel``, ``retry``, ...), most often
    after a document was written by hand or by another version. What to do: fix the
    document the message names; retrying the same write fails again."""


class DocumentTooLarge(WriteRejected):
    """The write would make a document larger than MongoDB's 16 MiB (``maxBsonObjectSize``):
    the server refused it (whatever code its version answers with) or the driver would not
    send it. Publishing refuses such tasks first (``InvalidTask``) and workers bound what a
    run records, so this reaches code only for documents changed by hand or by other
    writers (docs/publishing.md, "How big params and results may be")."""


class DuplicateKey(StoreError):
    """A unique index refused the write: another writer created that document first."""


class PartialBulkWrite(StoreError):
    """Some writes of one bulk write failed: ``errors`` holds each failed write's error by
    its position, ``matched`` how many of the others matched a document."""

    def __init__(self, message: str, matched: int, errors: dict[int, StoreError]) -> None:
        self.matched, self.errors = matched, errors
        super().__init__(message)


class ChangeHistoryLost(StoreError):
    """The change stream cannot resume from its token: rescan the collection."""


class ChangeStreamEnded(StoreError):
    """The server ended a change stream: after an invalidate (the watched collection or
    database was dropped or renamed) MongoDB closes the stream's cursor, even when the
    stream's ``$match`` hides the invalidate event. Nothing more comes from it, and it cannot
    be resumed (MongoDB refuses a resume after an invalidate): open a new stream without
    its token and read again what it followed. ``reason`` says how it ended."""

    INVALIDATED = "invalidate event"
    CURSOR_CLOSED = "cursor closed by the server"
    CLOSED = "closed by this process"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"change stream ended: {reason}")


class ChangeStreamsUnsupported(StoreError):
    """The server offers no change streams (a standalone mongod): fall back to polling."""


class NoLiveWorkerWarning(UserWarning):
    """A warning, not an error: ``pause`` or ``set_limits`` named a task name no live
    worker serves (``names``), or ``publish``/``publish_many`` pinned a task
    (``worker_ids``) to ids no live worker has (``worker_ids``), per the worker registry.
    The call went ahead: a pause or a limit set ahead of a deploy, or a task pinned to a
    worker about to start, is legitimate; otherwise it is likely a typo, and the message
    suggests the nearest live name or id. Turn it into an error with
    ``warnings.simplefilter("error", NoLiveWorkerWarning)``; ``force=True`` (the CLI's
    ``--force``) skips the check of ``pause`` and ``set_limits``, and the CLI prints it."""

    def __init__(self, message: str, *, names: list[str], worker_ids: list[str]) -> None:
        self.names, self.worker_ids = names, worker_ids
        super().__init__(message)


class Fail(Exception):
    """Raise inside a handler to end the task as FAIL now: no local retry, no later
    attempt, whatever failure budget is left (the task gets ``fatal: true``). taskrunner
    never raises it to you; its message is the run's error (``task.errors``)."""


class Retry(Exception):
    """Raise inside a handler to run the task again ``delay`` seconds from now (server
    time) without counting a failure (Oban's snooze). ``ctx.snooze(seconds)`` raises it.
    ``delay`` None waits what the task's backoff would after its next failure.
    Constructing it with a ``delay`` outside 0..366 days raises ``ValueError``."""

    def __init__(self, delay: float | None = None, reason: str = "") -> None:
        if delay is not None and not 0 <= delay <= 366 * 86_400:
            raise ValueError(f"retry delay must be 0..31622400 seconds, got {delay!r}")
        self.delay = delay
        super().__init__(reason or (f"retry in {delay:g} s" if delay is not None else "retry"))


class RateLimited(Retry):
    """Raise inside a handler when a remote service says "slow down": the task runs
    again ``retry_after`` seconds from now, no failure counted, and no worker starts a
    task of this name (or of this ``limit_by`` value) before then (docs/limits.md)."""

    def __init__(self, retry_after: float, reason: str = "") -> None:
        super().__init__(retry_after, reason or f"rate limited for {retry_after:g} s")
        self.retry_after = retry_after
