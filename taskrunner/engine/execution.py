"""One claimed run: call the handler, keep its lease alive, write its outcome once.

Every write carries the run's ``run_id``. A ping that matches nothing means the
claim is lost: the handler is cancelled and nothing more is written for this run.
A run that cannot confirm its lease for ``ping_timeout`` (server unreachable)
cancels its handler itself (self-fencing), since another worker may own it by now.
The outcome write is shielded from cancellation (procrastinate's worker does the
same), and a run stopped for shutdown releases its claim without spending budget.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import enum
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import bson
from pydantic import BaseModel

from taskrunner.client import TaskClient
from taskrunner.context import TaskContext
from taskrunner.engine.heartbeat import Heartbeat, RunLease
from taskrunner.engine.observe import NullObserver, WorkerObserver
from taskrunner.engine.observe import Outcome as RunOutcome
from taskrunner.engine.retries import delay as retry_delay
from taskrunner.engine.writes import RunWrites
from taskrunner.errors import (
    ClaimLost,
    DocumentTooLarge,
    Fail,
    InvalidParams,
    MalformedTask,
    RateLimited,
    Retry,
    StoreError,
    TaskRunnerError,
    UnknownTaskName,
)
from taskrunner.handlers import Handlers, Registration
from taskrunner.models import Task, TaskError
from taskrunner.observability import tracing
from taskrunner.observability.logs import get_logger
from taskrunner.observability.redact import redact
from taskrunner.store import sizes
from taskrunner.store.base import Claim, Failure, RunResult, RunStatus, RunWrite, RunWriteKind, Store
from taskrunner.workflows.upstream import Upstreams


class Stop(enum.Enum):
    """Why a run ended without its own outcome."""

    LOST = "claim lost"  # someone else owns it: write nothing
    UNCONFIRMED = "lease unconfirmed for ping_timeout"  # self-fenced: write nothing
    NOT_ALLOWED = "worker no longer in worker_ids"  # release
    CANCELED = "task canceled"  # release
    SHUTDOWN = "worker shutting down"  # release
    SLOT_LOST = "running slot lost"  # release: the run may not count against max_running


RELEASING = (Stop.NOT_ALLOWED, Stop.CANCELED, Stop.SHUTDOWN, Stop.SLOT_LOST)
LEASE_ENDS = {
    RunStatus.LOST: Stop.LOST,
    RunStatus.CANCELED: Stop.CANCELED,
    RunStatus.NOT_ALLOWED: Stop.NOT_ALLOWED,
}


@dataclass(frozen=True)
class Outcome:
    """How the handler ended: a result, an error (``final``: never retried), or a
    ``snooze`` (run again that many seconds from now, no failure counted)."""

    result: Any = None
    error: TaskError | None = None
    final: bool = False
    snooze: float | None = None
    throttle: bool = False
    """``RateLimited``: hold back the task's name (or limit_by value) for ``snooze`` seconds."""
    unfit: bool = False
    """Recorded in place of an outcome the server refused as too large (``too_large``)."""


Ended = Callable[[str, Callable[[], None] | None], None]
"""Told ``(key, done)`` when a run's outcome may have ended a task others wait on: its
follow-up is due; ``done``, if given, is called once the follow-up is done."""


class UnstorableResult(TaskRunnerError):
    """The handler returned something MongoDB cannot store."""


def storable(result: Any, budget: sizes.Budget) -> Any:
    """The result as BSON-compatible data within the task's share for a result
    (``sizes``); pydantic models are dumped to JSON types."""
    if isinstance(result, BaseModel):
        result = result.model_dump(mode="json")
    try:
        size = sizes.added_bytes(result)
    except (bson.errors.InvalidDocument, OverflowError, TypeError) as exc:
        raise UnstorableResult(f"the handler's result cannot be stored as BSON: {exc}") from None
    if size > budget.result:
        raise UnstorableResult(
            f"the handler's result is {size:,} bytes as BSON; this task's document has room for at most "
            f"{max(0, budget.result):,} per successful run (MongoDB stores at most 16 MiB a document, "
            f"and the task's params take {budget.params:,}): return less, or store it elsewhere "
            "and return a reference"
        )
    return result


def _runner_on(store: Store, handlers: Handlers) -> TaskClient:
    runner = TaskClient(store=store)
    runner.handlers = handlers
    return runner


def error_of(exc: BaseException, limit: int = sizes.ERROR_BYTES) -> TaskError:
    """The run's error record, cut to ``limit`` bytes (the traceback keeps its end)."""
    tb = redact("".join(traceback.format_exception(exc)))
    kind, message, cut_tb = sizes.fit_error(type(exc).__qualname__, redact(str(exc)), tb, limit)
    return TaskError(type=kind, message=message, traceback=cut_tb)


def too_large(outcome: Outcome, refusal: DocumentTooLarge) -> Outcome:
    """What a run records when the server refused its outcome for size: a final failure
    without result or traceback (the document is full, so running the task again would end
    the same way)."""
    what = "result" if outcome.error is None else f"{outcome.error.type} error"
    message = f"the run's {what} did not fit in the task document; {refusal}"
    return Outcome(error=TaskError(type="DocumentTooLarge", message=message[:1000]), final=True, unfit=True)


class Execution:
    """Runs one claim to its end; ``stop()`` ends it early for the given reason."""

    def __init__(
        self,
        claim: Claim,
        *,
        store: Store,
        handlers: Handlers,
        worker_id: str,
        executor: Executor | None = None,
        observer: WorkerObserver | None = None,
        writes: RunWrites | None = None,
        heartbeat: Heartbeat | None = None,
        throttle: Callable[[Task, float], Awaitable[None]] | None = None,
        holds_slot: Callable[[str], Awaitable[bool]] | None = None,
        runner: TaskClient | None = None,
        ended: Ended | None = None,
        upstreams: Upstreams | None = None,
        clock_offset: float = 0.0,
    ) -> None:
        """``writes`` and ``heartbeat`` are the worker's shared ones (one round trip
        for many runs); a lone run gets its own. ``throttle`` holds back the task's name
        when its handler raises ``RateLimited``. ``holds_slot``: whether the run still
        holds its fleet-wide running slot, asked before its outcome is written.
        ``runner`` is the handler's ``ctx.runner`` (the worker's); a lone run gets one
        on ``store`` with ``handlers``. ``ended(key)`` is told when an outcome that may
        have ended a task others wait on was written (their follow-up is due). ``upstreams``
        reads ``ctx.upstream`` (the worker's, keeping succeeded upstreams). ``clock_offset``:
        seconds the server's clock is ahead of this machine's (the worker's ``Clock``), so the
        run's span starts at the claim's server time on this machine's clock."""
        self.throttle, self.holds_slot, self.ended = throttle, holds_slot, ended
        self.upstreams = upstreams if upstreams is not None else Upstreams(store)
        self.observer: WorkerObserver = observer or NullObserver()
        self._owes_follow_up = False
        self._span: tracing.RunSpan | None = None
        self.started = time.monotonic()  # conservative start of the lease: the claim was sent before
        self.writes = RunWrites(store) if writes is None else writes
        self.heartbeat = Heartbeat(self.writes, worker_id) if heartbeat is None else heartbeat
        self.claim, self.store, self.handlers = claim, store, handlers
        self.runner = runner if runner is not None else _runner_on(store, handlers)
        self.task, self.run_id, self.worker_id, self.executor = claim.task, claim.run_id, worker_id, executor
        self.key = claim.task.key
        self.budget = claim.task.budget()
        self.log = get_logger("taskrunner.run").bind(
            key=self.key, run_id=self.run_id, name=self.task.name, worker_id=worker_id
        )
        self.stopped: Stop | None = None
        self.ctx: TaskContext | None = None
        self._handler: asyncio.Task[Outcome] | None = None
        self.clock_offset = clock_offset
        self.outcome: RunOutcome | None = None
        """How the run ended, as ``WorkerObserver.finished`` hears it (``success``, ...)."""
        self.raised: BaseException | None = None
        """What the handler (or the params' validation) raised, for a failed run."""

    def stop(self, reason: Stop) -> None:
        if self.stopped is None:
            self.stopped = reason
        if self.ctx is not None:
            self.ctx.cancelled = True
        if self._handler is not None:
            self._handler.cancel()

    async def run(self) -> None:
        """Run the claim to its end, inside its span when tracing is on (docs/observability.md)."""
        started_ns = int((self.claim.entry.claimed_at.timestamp() - self.clock_offset) * 1e9)
        task, entry = self.task, self.claim.entry
        run = tracing.Run(task.name, task.key, task.trace, self.run_id, entry.attempt, self.worker_id)
        span = self._span = tracing.run_span(run, started_ns)
        if span is None:
            await self._run()
            return
        try:
            with span.current():  # the handler's task, created inside, inherits the span
                await self._run()
        except BaseException as exc:
            span.end(self.outcome, None if isinstance(exc, asyncio.CancelledError) else exc)
            raise
        if not self._follow_up_ends(span):
            span.end(self.outcome, self.raised)

    async def _run(self) -> None:
        self.log.info("run started", attempt=self.claim.entry.attempt)
        try:
            registration, params = self._prepare()
        except (UnknownTaskName, InvalidParams) as exc:
            # Params the handler's model rejects fail the same way on every attempt.
            await self._write(Outcome(error=self._error(exc), final=isinstance(exc, InvalidParams)))
            self._finished("failure", 0.0)
            return
        attempt = self.claim.entry.attempt
        try:
            upstream = await self._upstream()
        except StoreError as exc:  # the server's fault, not the task's: run it later, no budget spent
            self.log.warning("could not read the tasks this one runs after; releasing it", error=str(exc))
            self.stopped = Stop.SHUTDOWN
            await self._release()
            return
        self.ctx = TaskContext(
            self.key, self.run_id, attempt, self.worker_id, params, runner=self.runner, upstream=upstream
        )
        self._handler = asyncio.create_task(
            self._attempts(registration, self.ctx), name=f"handler:{self.key}"
        )
        self.heartbeat.add(self._lease())
        try:
            await asyncio.wait([self._handler])
        except asyncio.CancelledError:
            self.stop(Stop.SHUTDOWN)
            await asyncio.shield(self._conclude())
            raise
        await self._conclude()

    async def _upstream(self) -> Mapping[str, Task]:
        """The tasks this one runs after, by key in ``after`` order (``ctx.upstream``)."""
        tasks = await self.upstreams.read(self.task.after)
        return MappingProxyType({key: task.bound(self.runner) for key, task in tasks.items()})

    async def _slot_held(self) -> bool:
        return self.holds_slot is None or await self.holds_slot(self.run_id)

    def _prepare(self) -> tuple[Registration, Any]:
        registration = self.handlers.get(self.task.name)
        return registration, registration.parse(self.task.params)

    async def _conclude(self) -> None:
        assert self._handler is not None
        with_outcome = not self._handler.cancelled() and self.stopped is None
        outcome = self._handler.result() if with_outcome else None
        if outcome is not None and outcome.snooze is None and not await self._slot_held():
            # Another run may hold its slot by now (this worker was frozen or cut off past
            # the slot's lease): recording this one as done would exceed max_running.
            self.stop(Stop.SLOT_LOST)
            outcome = None
        self.heartbeat.remove(self.run_id)
        seconds = time.monotonic() - self.started
        if outcome is not None and outcome.snooze is not None:
            if outcome.throttle and self.throttle is not None:
                await self.throttle(self.task, outcome.snooze)
            await self._snooze(outcome.snooze)
            self._finished("snoozed", seconds)
        elif outcome is not None:
            await self._write(outcome)
            self._finished("success" if outcome.error is None else "failure", seconds)
            self._owes_follow_up = self.task.dependents and self._may_end(outcome)
        elif self.stopped in RELEASING:
            await self._release()
            self._finished("released", seconds)
        else:
            reason = self.stopped and self.stopped.value
            self.log.warning("run abandoned: another worker may own it", reason=reason)
            self._finished("lost", seconds)
        if self._owes_follow_up and self.ended is not None and self._span is None:
            self.ended(self.key, None)

    def _finished(self, outcome: RunOutcome, seconds: float) -> None:
        self.outcome = outcome
        self.observer.finished(self.task, outcome, seconds)

    def _follow_up_ends(self, span: tracing.RunSpan) -> bool:
        """A run whose outcome may have ended a task others wait on owes a follow-up (done
        by the worker's ``Follower`` at once): the span ends once it is done, so that the
        releases it makes sit inside it. False when nothing is owed (end the span now)."""
        if not self._owes_follow_up or self.ended is None:
            return False
        outcome, raised = self.outcome, self.raised
        self.ended(self.key, lambda: span.end(outcome, raised))
        return True

    def _may_end(self, outcome: Outcome) -> bool:
        """Whether ``outcome`` may have ended the task (a failure with budget left does not)."""
        spent = self.task.failures + 1 >= self.task.options.max_failures
        return outcome.error is None or outcome.final or spent

    # -- handler ----------------------------------------------------------------------------
    async def _attempts(self, registration: Registration, ctx: TaskContext) -> Outcome:
        options = self.task.options
        for attempt in range(options.local_retries + 1):
            try:
                return Outcome(result=storable(await self._call(registration, self.ctx or ctx), self.budget))
            except asyncio.CancelledError:
                raise
            except Retry as exc:
                later = exc.delay if exc.delay is not None else retry_delay(options, self.task.failures + 1)
                return Outcome(snooze=later, throttle=isinstance(exc, RateLimited))
            except Fail as exc:
                return Outcome(error=self._error(exc), final=True)
            except UnstorableResult as exc:  # the same result would be refused again at once
                return Outcome(error=self._error(exc))
            except BaseException as exc:  # KeyboardInterrupt/SystemExit in a handler are its failures
                if attempt == options.local_retries:
                    return Outcome(error=self._error(exc))
                self.log.warning("handler raised; retrying locally", error=repr(exc), retry=attempt + 1)
                await asyncio.sleep(retry_delay(options, attempt + 1))
        raise AssertionError("unreachable")

    def _error(self, exc: BaseException) -> TaskError:
        self.raised = exc
        return error_of(exc, self.budget.error)

    async def _call(self, registration: Registration, ctx: TaskContext) -> Any:
        """One call of the handler, bounded by the task's ``timeout`` option (per call).

        A timed-out async handler is cancelled. A sync handler's thread cannot be killed:
        its ``ctx.cancelled`` is set (handlers should check it) and the failure is recorded
        anyway; a local retry gets a fresh context.
        """
        timeout = self.task.options.timeout
        args = (ctx.params, ctx) if registration.wants_context else (ctx.params,)
        bound = asyncio.timeout(timeout)
        try:
            async with bound:
                if registration.is_async:
                    return await registration.handler(*args)
                loop = asyncio.get_running_loop()
                # In the run's context (its span current), as asyncio.to_thread does.
                call = contextvars.copy_context().run
                return await loop.run_in_executor(self.executor, lambda: call(registration.handler, *args))
        except TimeoutError:
            if not bound.expired():
                raise  # the handler's own TimeoutError
            if not registration.is_async:
                ctx.cancelled = True  # the thread runs on; tell it to stop
                self.ctx = dataclasses.replace(ctx, cancelled=False, _progress=None)
            raise TimeoutError(f"handler exceeded its {timeout:g} s timeout") from None

    # -- lease --------------------------------------------------------------------------------
    def _lease(self) -> RunLease:
        options = self.task.options
        return RunLease(
            self.key,
            self.run_id,
            options.ping_interval,
            options.ping_timeout,
            self._lease_ended,
            take_progress=self._take_progress,
            give_back=self._give_back,
            confirmed=self.started,
        )

    def _take_progress(self) -> Any:
        return self.ctx.take_progress() if self.ctx else None

    def _give_back(self, progress: Any) -> None:
        if progress is not None and self.ctx is not None and self.ctx._progress is None:
            self.ctx._progress = progress  # resend with the next ping

    def _lease_ended(self, status: RunStatus | None) -> None:
        self._end(LEASE_ENDS.get(status, Stop.LOST) if status is not None else Stop.UNCONFIRMED)

    def _end(self, reason: Stop) -> None:
        self.log.warning("stopping run", reason=reason.value)
        self.stop(reason)

    # -- writes --------------------------------------------------------------------------------
    def _run_write(self, outcome: Outcome) -> RunWrite:
        kind: RunWriteKind = "success" if outcome.error is None else "failure"
        value = outcome.result
        if outcome.error is not None:
            retry_in = None if outcome.final else retry_delay(self.task.options, self.task.failures + 1)
            value = Failure(outcome.error, retry_in, outcome.final)
        last = self.ctx.last_progress if self.ctx is not None else None  # rides on the outcome
        return RunWrite(kind, self.key, self.run_id, self.worker_id, value, progress=last)

    async def _submit(self, outcome: Outcome) -> RunResult:
        """The outcome write's result; a size refusal is returned whether the store reports
        it for the write (a batch's) or raises it (a write alone)."""
        try:
            return await self.writes.submit(self._run_write(outcome))
        except DocumentTooLarge as refused:
            return refused

    async def _write(self, outcome: Outcome) -> None:
        async def write() -> None:
            nonlocal outcome
            result = await self._submit(outcome)
            if isinstance(result, DocumentTooLarge) and not outcome.unfit:
                # The budget keeps outcomes within the document; one changed by hand or by
                # other writers may still refuse one. Record that instead, so the run ends.
                self.log.error("outcome refused: the task document would exceed 16 MiB", error=str(result))
                outcome = too_large(outcome, result)
                result = await self._submit(outcome)
            if isinstance(result, StoreError):
                raise result
            if result is not RunStatus.DONE:
                raise ClaimLost(self.key, self.run_id)
            if outcome.error is None:
                self.log.info("run succeeded")
            else:
                self.log.warning("run failed", error_type=outcome.error.type, error=outcome.error.message)

        await self._persist(write)

    async def _release(self) -> None:
        async def release() -> None:
            await self.store.release(self.key, self.run_id)
            self.log.info("claim released", reason=self.stopped and self.stopped.value)

        await self._persist(release)

    async def _snooze(self, seconds: float) -> None:
        async def snooze() -> None:
            await self.store.snooze(self.key, self.run_id, seconds)
            self.log.info("run snoozed", seconds=seconds)

        await self._persist(snooze)

    async def _persist(self, write: Any) -> None:
        """Retry a final write until it lands, the claim is lost, or the lease must be gone."""
        deadline = time.monotonic() + self.task.options.ping_timeout
        delay = 0.1
        while True:
            try:
                # Bounded too: over a stalled connection the write would wait forever.
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    await asyncio.shield(write())
                return
            except ClaimLost:
                self.log.warning("claim lost before the outcome was written; nothing written")
                return
            except MalformedTask as exc:  # written, but the document no longer reads back
                self.log.error("outcome written to a malformed document", error=str(exc))
                return
            except DocumentTooLarge as exc:  # even the smallest failure: writing again cannot help
                self.log.error("the task document has no room for the run's outcome", error=str(exc))
                return
            except (StoreError, TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    error = redact(str(exc)) or "no reply before ping_timeout"
                    self.log.error("could not write the run's outcome", error=error)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
