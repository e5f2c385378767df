"""``TaskClient``: register handlers, publish tasks and operate on them.

It is everything ``TaskRunner`` does but run workers, and what the worker engine and a
handler's ``ctx.runner`` are typed against: the engine sits above this module and below
``taskrunner.runner``, so no module imports one that imports it back.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Self, TypeVar, Unpack

from pydantic import ValidationError

from taskrunner.engine import fleet
from taskrunner.engine.follow import StreamEnds
from taskrunner.errors import (
    ChangeStreamEnded,
    ConfigurationError,
    FlowNotFound,
    InvalidSchedule,
    InvalidTask,
    ScheduleNotFound,
    StoreError,
    StoreUnavailable,
    TaskNotFound,
    UnknownTaskName,
    WaitTimeout,
)
from taskrunner.handlers import Handlers, Registration, plain_params
from taskrunner.limits.gates import Limit, check_max_running, parse_rate
from taskrunner.limits.state import ALL, LimitState, LimitView
from taskrunner.models import (
    NewTask,
    Task,
    TaskOptions,
    TaskPage,
    TaskState,
    TaskStats,
    Unreadable,
    UpstreamPolicy,
    WorkerInfo,
    invalid_task,
)
from taskrunner.observability import tracing
from taskrunner.observability.logs import get_logger
from taskrunner.options import TaskOptionsDict, TaskSpec
from taskrunner.schedules.model import DEFAULT_GRACE, Schedule, ScheduleState, ScheduleView, declare
from taskrunner.store import fields as f
from taskrunner.store import preflight
from taskrunner.store.base import in_transaction
from taskrunner.store.preflight import ServerCheck
from taskrunner.workflows import linking, saga, settling
from taskrunner.workflows.builder import Flow
from taskrunner.workflows.model import FlowView
from taskrunner.workflows.upstream import Upstreams

if TYPE_CHECKING:
    from pymongo import AsyncMongoClient

    from taskrunner.store.base import ChangeStream, Session, Store

log = get_logger("taskrunner.runner")
H = TypeVar("H", bound=Callable[..., Any])
Duration = float | int | timedelta
DEFAULT_URI = f.DEFAULT_URI
OPTION_NAMES = frozenset(TaskOptions.model_fields)
TASK_FIELDS = frozenset({"name", "params", "key", "priority", "run_at", "delay"})
WORKFLOW_FIELDS = frozenset(
    {f.AFTER, f.ON_UPSTREAM_FAILURE, f.FLOW, f.COMPENSATE, f.COMPENSATES, f.DEPENDENTS}
)
"""Publish keywords of workflows (docs/workflows.md); ``runner.flow`` sets the last four."""
ALLOW_UNKNOWN = "; pass allow_unknown=True (CLI: --allow-unknown) to publish it for workers of another app"
INIT_POLLING = "workers will poll for tasks instead (every --poll-interval, 5 s by default)"


class TaskClient:
    """Handlers plus a store: services publish through it. ``TaskRunner`` adds running
    workers; a handler's ``ctx.runner`` is typed as this class (it is the worker's runner).

    ``mongo_uri`` defaults to ``$TASKRUNNER_MONGO_URI`` or ``mongodb://localhost:27017``;
    ``client=`` shares the application's ``AsyncMongoClient`` instead (its sessions and
    transactions then span the application's writes and taskrunner's: ``session=``), and
    ``close`` leaves it open; pass ``store=MemoryStore()`` to run without MongoDB (tests).
    """

    def __init__(
        self,
        mongo_uri: str | None = None,
        *,
        database: str = f.DEFAULT_DATABASE,
        collection: str = f.DEFAULT_COLLECTION,
        store: Store | None = None,
        client: AsyncMongoClient[Any] | None = None,
        timeout: float = 10.0,
    ) -> None:
        if client is not None and (store is not None or mongo_uri is not None):
            raise ConfigurationError("give client= or mongo_uri/store=, not both: client= is the connection")
        self.mongo_uri = mongo_uri or os.environ.get("TASKRUNNER_MONGO_URI", DEFAULT_URI)
        self.database, self.collection, self.timeout = database, collection, timeout
        self.handlers = Handlers()
        self.schedules: dict[str, Schedule] = {}
        """Schedules declared with ``schedule``, by id; workers store and fire them."""
        self._client = client
        self._store = store if client is None else _shared(client, database, collection)

    @property
    def store(self) -> Store:
        """The store, connected on first use (PyMongo connects lazily too)."""
        if self._store is None:
            from taskrunner.store.mongo import MongoStore

            self._store = MongoStore.connect(
                self.mongo_uri, database=self.database, collection=self.collection, timeout=self.timeout
            )
        return self._store

    def task(
        self,
        name: str | None = None,
        *,
        rate_limit: str | None = None,
        max_running: int | None = None,
        limit_by: str | None = None,
        **options: Unpack[TaskOptionsDict],
    ) -> Callable[[H], H]:
        """Register a handler: ``async def h(params: Model, ctx: TaskContext)``.

        ``options`` are the handler's default task options (see ``TaskOptions``).
        Fleet-wide limits (docs/limits.md): at most ``rate_limit`` starts (``"100/m"``) in
        any sliding window and at most ``max_running`` runs at once across all workers,
        per value of the params field ``limit_by`` if given.
        """
        limit = _limit(rate_limit, max_running, limit_by)

        def register(handler: H) -> H:
            _check_option_names(options)
            self.handlers.add(name or handler.__name__, handler, dict(options), limit)
            return handler

        return register

    def schedule(
        self,
        name: str,
        *,
        cron: str | None = None,
        every: Duration | None = None,
        params: Any = None,
        id: str | None = None,
        timezone: str = "UTC",
        catch_up: str = "latest",
        max_catch_up: int = 10,
        jitter: Duration | None = None,
        grace: Duration = DEFAULT_GRACE,
        priority: int = 0,
        allow_unknown: bool = False,
        **options: Unpack[TaskOptionsDict],
    ) -> Schedule:
        """Declare a recurring task: ``cron`` (5 fields, or 6 with leading seconds, in
        ``timezone``) or ``every`` (a duration). Each tick publishes one task keyed
        ``<id>@<tick, UTC ISO 8601>``; workers of this app store and fire it. Errors name
        the field at declaration (``InvalidSchedule``): ``every`` below 1 s, an ``id``
        (default: ``name``) declared already, ...; see docs/schedules.md."""
        probe = self.new_task(
            {"name": name, "params": params, "priority": priority, "key": "probe", **options},
            allow_unknown=allow_unknown,
        )
        schedule = declare(
            name=name,
            schedule_id=id,
            cron=cron,
            every=every,
            timezone=timezone,
            params=probe.params,
            priority=priority,
            options=options,
            catch_up=catch_up,
            max_catch_up=max_catch_up,
            jitter=jitter,
            grace=grace,
        )
        declared = self.schedules.get(schedule.id)
        if declared is not None:
            raise InvalidSchedule(
                "id",
                f"schedule {schedule.id!r} is already declared (task {declared.name!r},"
                f" {declared.recurrence.expression}); give this one its own id=",
            )
        self.schedules[schedule.id] = schedule
        return schedule

    async def schedule_overview(self, upcoming: int = 3) -> list[ScheduleView]:
        """Each stored schedule with its next fire times, last task and whether any live
        worker declares it (``taskrunner schedules``)."""
        stored = await self.store.schedules()
        declared = {i for w in await self.workers() for i in w.schedules}
        now = await self.store.server_time()
        return [await self._view(i, s, i not in declared, now, upcoming) for i, s in stored.items()]

    async def _view(
        self,
        schedule_id: str,
        state: ScheduleState | Unreadable,
        orphaned: bool,
        now: datetime,
        upcoming: int,
    ) -> ScheduleView:
        if isinstance(state, Unreadable):
            return ScheduleView(id=schedule_id, orphaned=orphaned, unreadable=state)
        last = None
        if state.last_key is not None:
            with suppress(TaskNotFound):
                last = await self.get(state.last_key)
        next_at = [] if state.paused else state.recurrence.upcoming(now, upcoming)  # none fire while paused
        return ScheduleView(
            id=schedule_id, schedule=state, orphaned=orphaned, last_task=last, next_at=next_at
        )

    async def pause_schedule(self, schedule_id: str) -> ScheduleState:
        """No tick fires until ``resume_schedule``; ticks in between never do."""
        return await self.store.pause_schedule(schedule_id, True)

    async def resume_schedule(self, schedule_id: str) -> ScheduleState:
        """Fire the schedule's ticks again, from the next one on (missed ticks never fire)."""
        return await self.store.pause_schedule(schedule_id, False)

    async def trigger_schedule(self, schedule_id: str) -> Task:
        """Publish the schedule's task now, once, keyed ``<id>@trigger-<server time>``."""
        stored = (await self.store.schedules([schedule_id])).get(schedule_id)
        if stored is None:
            raise ScheduleNotFound(schedule_id)
        if isinstance(stored, Unreadable):
            raise InvalidSchedule(schedule_id, f"the stored schedule is unreadable: {stored}")
        now = await self.store.server_time()
        [published] = await tracing.publish([stored.triggered(now)], self.store.publish, schedule=schedule_id)
        return published.bound(self)

    async def publish(
        self,
        name: str,
        params: Any = None,
        *,
        key: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: Duration | None = None,
        after: Iterable[str] | None = None,
        on_upstream_failure: UpstreamPolicy | None = None,
        update_pending: bool = False,
        republish_finished: bool = False,
        allow_unknown: bool = False,
        session: Session | None = None,
        **options: Unpack[TaskOptionsDict],
    ) -> Task:
        """Publish one task; an existing key is returned untouched with ``created=False``.

        ``after``: keys of tasks this one runs after; it is WAITING until each is SUCCESS,
        and canceled when one ends FAIL or CANCELED, unless ``on_upstream_failure="run"``
        (then it runs once each has finished). Each key must be a stored task
        (``UnknownUpstream`` otherwise); see docs/workflows.md.

        ``update_pending`` rewrites, on a task no worker has started, only what this call
        names: ``params``, ``priority``, the run time (``run_at`` or ``delay``) and each
        option given; whatever is left out or None stays as stored (a new task gets
        priority 0, params ``{}``, the handler's option defaults). ``republish_finished``
        starts a finished key afresh. A runner with handlers refuses a name none of them
        has (``UnknownTaskName``) unless ``allow_unknown``: the task is for workers of
        another app. ``worker_ids`` that no live worker has give a
        ``NoLiveWorkerWarning`` (the task is published and waits for one; checking costs one
        read of the worker registry).

        ``session`` (a session of the ``client=`` this runner shares) makes the write the
        session's: inside its transaction, the task exists if and only if the transaction
        commits (docs/publishing.md, "Publishing in a transaction").
        """
        spec = dict(
            name=name,
            params=params,
            key=key,
            priority=priority,
            run_at=run_at,
            delay=delay,
            after=after,
            on_upstream_failure=on_upstream_failure,
            **options,
        )
        new = self.new_task(spec, allow_unknown=allow_unknown)
        await self._check_live(worker_ids=new.options.worker_ids)
        [task] = await self._publish([new], update_pending, republish_finished, session)
        return task.bound(self)

    async def publish_many(
        self,
        tasks: Iterable[TaskSpec],
        *,
        update_pending: bool = False,
        republish_finished: bool = False,
        allow_unknown: bool = False,
        session: Session | None = None,
    ) -> list[Task]:
        """Publish many tasks in one write; each item takes ``publish``'s keywords. An
        item's ``after`` may name keys of items before it. ``session`` as for ``publish``."""
        return await self.publish_specs(
            tasks,
            update_pending=update_pending,
            republish_finished=republish_finished,
            allow_unknown=allow_unknown,
            session=session,
        )

    async def publish_specs(
        self,
        tasks: Iterable[Mapping[str, Any]],
        *,
        update_pending: bool = False,
        republish_finished: bool = False,
        allow_unknown: bool = False,
        session: Session | None = None,
    ) -> list[Task]:
        """``publish_many`` for items a type checker cannot see: dicts read from JSON (the
        CLI) or built field by field. The same checks run, at run time."""
        build = partial(self.new_task, allow_unknown=allow_unknown)
        new = [_at_index(i, build, spec) for i, spec in enumerate(tasks)]
        _check_unique_keys(new)
        await self._check_live(worker_ids=dict.fromkeys(i for task in new for i in task.options.worker_ids))
        published = await self._publish(new, update_pending, republish_finished, session)
        return [task.bound(self) for task in published]

    @tracing.publishes
    async def _publish(
        self, new: list[NewTask], update_pending: bool, republish_finished: bool, session: Session | None
    ) -> list[Task]:
        """Store ``new``; tasks with an ``after`` are checked first (their upstreams exist),
        and their upstreams learn of those created (``link``) before this returns."""
        if not any(task.after for task in new):
            return await self.store.publish(
                new, update_pending=update_pending, republish_finished=republish_finished, session=session
            )
        linking.check_republish(new, republish_finished)
        outside = linking.outside(new)
        stored = await self.store.states(outside, session=session) if outside else {}
        new = linking.linked(new, stored)
        published = await self.store.publish(
            new, update_pending=update_pending, republish_finished=False, session=session
        )
        await self._follow_up([t.key for t in published if t.created and t.after], session)
        return published

    async def _follow_up(self, keys: Sequence[str], session: Session | None = None) -> None:
        """Do at once the follow-ups ``keys`` owe (workers' sweeps would, within a second).
        Inside a transaction they are left to the sweeps: a follow-up reads and writes
        other tasks outside the transaction, which must see it committed."""
        if keys and not in_transaction(session):
            owed = await self.store.follow_ups(keys=keys)
            await settling.follow_up(self.store, owed, self._check_flow)

    async def _check_flow(self, flow: str) -> None:
        """A step of ``flow`` ended: stop it and publish its compensations if one failed."""
        await saga.check(self.store, flow, partial(self.publish_specs, allow_unknown=True))

    def flow(self, flow_id: str) -> Flow:
        """A flow to build step by step and publish in one call (docs/workflows.md):
        ``a = flow.add("extract", p)``, ``bs = flow.group(("transform", q1), ("transform", q2),
        after=a)``, ``flow.add("load", r, after=bs)``, then ``await flow.publish()``."""
        return Flow(self, flow_id)

    async def get_flow(self, flow_id: str) -> FlowView:
        """The flow's steps, compensations and state as stored now; ``FlowNotFound`` if none."""
        tasks = await self.store.flow_tasks(flow_id)
        if not tasks:
            raise FlowNotFound(flow_id)
        return FlowView.of(flow_id, [t.bound(self) for t in tasks])

    async def dependents(self, key: str, *, limit: int = 1000) -> list[Task]:
        """Tasks that run after ``key``, oldest first."""
        return [t.bound(self) for t in await self.store.dependents(key, limit=limit)]

    async def upstream(self, key: str) -> dict[str, Task]:
        """The tasks ``key`` runs after, by key (those still stored), as ``ctx.upstream`` has them."""
        task = await self.store.get(key)
        return {k: t.bound(self) for k, t in (await Upstreams(self.store).read(task.after)).items()}

    def new_task(self, spec: Mapping[str, Any], *, allow_unknown: bool = False) -> NewTask:
        """Validate one publish request; nothing is written if this raises."""
        _check_option_names(set(spec) - TASK_FIELDS - WORKFLOW_FIELDS)
        name = spec.get("name")
        if not isinstance(name, str):
            raise InvalidTask("name", "must be a string")
        registration = self.handlers.find(name)
        known = self.handlers.names()
        if registration is None and known and not allow_unknown:
            raise UnknownTaskName(name, known, hint=ALLOW_UNKNOWN)
        params = (
            registration.validate(spec.get("params") or {})
            if registration
            else plain_params(spec.get("params"))
        )
        return _build(name, params, spec, registration)

    async def get(self, key: str) -> Task:
        """The task stored under ``key``; raises ``TaskNotFound``."""
        return (await self.store.get(key)).bound(self)

    # wait(key, timeout=...), like TaskFlow's job.wait and BullMQ's waitUntilFinished;
    # asyncio.timeout() around it works too.
    async def wait(
        self,
        key: str,
        timeout: float | None = None,  # noqa: ASYNC109
        *,
        poll_interval: float = 1.0,
    ) -> Task:
        """Wait until the task is SUCCESS, FAIL or CANCELED and return it: ``task.results``
        holds its successful runs' results, ``task.errors`` its failures' error records.

        Follows the change stream and re-reads the task every ``poll_interval`` seconds
        (the fallback when the server has no change streams). Raises ``WaitTimeout``
        after ``timeout`` seconds, and ``TaskNotFound`` for an unknown key.
        ``await task.wait(timeout)`` on a task this runner returned does the same.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        following = _Following(self.store, key)
        await following.open()
        try:
            task = await self.store.get(key)
            while not task.state.finished:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise WaitTimeout(key, timeout or 0.0, task.bound(self))
                step = poll_interval if remaining is None else min(poll_interval, remaining)
                task = await following.next_version(step)
            return task.bound(self)
        finally:
            await following.close()

    async def cancel(self, key: str, *, session: Session | None = None) -> Task:
        """Cancel a task: a pending one never starts; running handlers are cancelled at
        their next ping (``CancelledError`` in the handler). Raises ``InvalidState`` for a
        task that already succeeded or failed. ``session`` as for ``publish``: in a
        transaction, the cancel holds if and only if it commits."""
        task = await self.store.cancel(key, session=session)
        if task.dependents:
            await self._follow_up([key], session)  # what runs after it is canceled too
        return task.bound(self)

    async def retry(self, key: str, *, session: Session | None = None) -> Task:
        """Make a FAIL or CANCELED task claimable again with a fresh failure budget. Tasks
        canceled because it failed wait for it again (re-armed); a task that runs after
        others waits for them again (WAITING). ``session`` as for ``publish``."""
        task = await tracing.retried(key, partial(self.store.retry, session=session))
        if (task.dependents or task.after) and not in_transaction(session):
            await self._follow_up([key])
            task = await self.store.get(key, session=session)
        return task.bound(self)

    async def purge(self, states: Iterable[TaskState], older_than: float, *, dry_run: bool = False) -> int:
        """Delete finished tasks in ``states`` older than ``older_than`` seconds; returns how many
        (with ``dry_run``, how many would be)."""
        chosen = list(states)
        if not chosen or any(not s.finished for s in chosen):
            raise InvalidTask("state", "purge takes finished states only: SUCCESS, FAIL, CANCELED")
        return await self.store.purge(chosen, older_than, dry_run=dry_run)

    async def list_tasks(
        self,
        *,
        state: TaskState | None = None,
        name: str | None = None,
        worker_id: str | None = None,
        limit: int = 100,
    ) -> list[Task]:
        """Tasks, oldest first, filtered by state, name and worker."""
        found = await self.store.find(state=state, name=name, worker_id=worker_id, limit=limit)
        return [task.bound(self) for task in found]

    async def failed(self, *, name: str | None = None, limit: int = 20, after: str | None = None) -> TaskPage:
        """The dead-letter view: FAIL tasks, the latest failure first (``finished_at``; one
        without a date there, written by hand, comes last, by key), ``limit`` to a page,
        of one ``name`` if given. Each task's ``last_error`` says why it failed; the page's
        ``after`` reads the next page. ``retry`` runs one again, ``purge`` deletes them."""
        from taskrunner.store.base import Listing, format_position, parse_position

        if limit < 1:
            raise InvalidTask("limit", f"must be at least 1, got {limit}")
        listing = Listing(
            state=TaskState.FAIL, name=name, sort=f.FINISHED_AT, after=parse_position(after), limit=limit
        )
        page = await self.store.browse(listing)
        position = format_position(page.after) if page.after is not None else None
        return TaskPage(tasks=[task.bound(self) for task in page.tasks], after=position)

    async def stats(self) -> TaskStats:
        """Counts by name and state, the last hour's runs, and what waits for a worker that
        is not live (from the worker registry): pending tasks of names no live worker
        serves, and unfinished tasks pinned to ids no live worker has."""
        numbers = await self.store.stats()
        workers = await self.workers()
        served = {name for worker in workers for name in worker.names}
        unserved = {
            name: counts[TaskState.PENDING]
            for name, counts in sorted(numbers.counts.items())
            if counts.get(TaskState.PENDING) and name not in served
        }
        pinned = await self.store.pinned_away([worker.worker_id for worker in workers])
        return numbers.model_copy(
            update={"unserved": unserved, "paused": await self.paused(), "pinned_away": pinned}
        )

    async def _check_live(self, *, names: Iterable[str] = (), worker_ids: Iterable[str] = ()) -> None:
        """A ``NoLiveWorkerWarning`` at the public method's caller for what no live worker covers."""
        names, worker_ids = list(names), list(worker_ids)
        if names or worker_ids:
            fleet.warn(fleet.not_live(await self.workers(), names=names, worker_ids=worker_ids), 3)

    async def pause(self, name: str, *, force: bool = False) -> list[LimitState]:
        """Stop claiming tasks of ``name`` (``"*"``: every name) on every worker within a
        second; running tasks finish and publishing goes on (docs/limits.md). Returns the
        limits documents written (one), as ``resume`` does.

        A name no live worker serves is paused all the same (ahead of a deploy that is
        right) with a ``NoLiveWorkerWarning`` (a typo otherwise); ``force`` skips the check."""
        _limit_name(name)
        if not force and name != ALL:
            await self._check_live(names=[name])
        return [await self.store.pause(name, True)]

    async def resume(self, name: str) -> list[LimitState]:
        """Claim ``name`` again; ``"*"`` lifts every pause (of any name, and the global one).
        Returns the limits documents written (one per pause lifted)."""
        names = await self.paused() if _limit_name(name) == ALL else [name]
        return [await self.store.pause(n, False) for n in names]

    async def set_limits(
        self,
        name: str,
        *,
        rate_limit: str | None = None,
        max_running: int | None = None,
        clear: bool = False,
        force: bool = False,
    ) -> LimitState:
        """Change ``name``'s fleet-wide limits live; workers apply it within a second.
        ``rate_limit="off"`` / ``max_running=0`` lift that limit whatever the code declares;
        ``clear`` drops what operators set, so the code's limits apply again.

        As ``pause``: a name no live worker serves gets a ``NoLiveWorkerWarning`` unless ``force``."""
        _limit_name(name)
        if name == ALL:
            raise InvalidTask("name", "limits apply to one task name, not '*'")
        if not force:
            await self._check_live(names=[name])
        changes: dict[str, Any] = {}
        if rate_limit is not None:
            changes[f.RATE_LIMIT] = None if rate_limit == "off" else str(parse_rate(rate_limit))
        if max_running is not None:
            changes[f.MAX_RUNNING] = None if max_running == 0 else check_max_running(max_running)
        return await self.store.set_limits(name, changes, clear=clear)

    async def limits(self, name: str) -> LimitView:
        """``name``'s limits: those in force (as a worker of this app applies them) and its
        stored limits document (None when there is none)."""
        _limit_name(name)
        code = self.handlers.get(name).limit if name in self.handlers.names() else Limit()
        state = (await self.store.limits([name])).get(name)
        if isinstance(state, Unreadable):
            raise InvalidTask(f"limits.{name}", f"the stored document is unreadable: {state}")
        if state is not None and not code and state.declared:
            declared = state.declared
            code = _limit(declared.get(f.RATE_LIMIT), declared.get(f.MAX_RUNNING), declared.get(f.LIMIT_BY))
        return LimitView(name, state.limit(code) if state is not None else code, state)

    async def paused(self) -> list[str]:
        """Names paused now (``"*"`` when every name is)."""
        stored = await self.store.limits()
        return [n for n, s in stored.items() if isinstance(s, LimitState) and s.paused]

    async def workers(self) -> list[WorkerInfo]:
        """Live workers from the worker registry (dead ones age out after their last beat)."""
        return await self.store.workers()

    async def stop_worker(self, worker_id: str) -> bool:
        """Ask a live worker to shut down gracefully (it notices at its next beat)."""
        return await self.store.request_stop(worker_id)

    async def init(
        self,
        *,
        validator: bool = False,
        retain_finished: float | timedelta | None = None,
        retain_failed: float | timedelta | None = None,
    ) -> ServerCheck:
        """Create the collection's indexes (idempotent), optionally the validator, and
        with ``retain_finished`` a TTL index so MongoDB deletes tasks that long after they
        finish (0 removes it). ``retain_failed`` gives FAIL and CANCELED tasks a retention
        of their own (the finished one then covers SUCCESS only); 0 removes it. None keeps
        what is installed.

        First it checks the server (docs/compatibility.md): one older than taskrunner
        supports raises ``ServerTooOld``; a standalone without change streams or a user
        missing a privilege ``init`` needs comes back as a line in the result's
        ``warnings`` (``taskrunner init`` prints them)."""
        finished, failed = _seconds(retain_finished), _seconds(retain_failed)
        retention = finished is not None or failed is not None
        needs = preflight.init_needs(self.collection, validator=validator, retention=retention)
        checked = await preflight.check(self.store, self.database, needs, polling=INIT_POLLING)
        await self.store.init(validator=validator, retain_finished=finished, retain_failed=failed)
        return checked

    async def close(self) -> None:
        """Close the store's connection, if one was opened."""
        if self._store is not None:
            await self._store.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def copy(
        self,
        *,
        mongo_uri: str | None = None,
        database: str | None = None,
        collection: str | None = None,
        timeout: float | None = None,
        store: Store | None = None,
    ) -> Self:
        """The same handlers on another connection (a fresh store unless one is given; the
        same shared ``client=`` unless a URI or store is given)."""
        shared = self._client if mongo_uri is None and store is None else None
        twin = type(self)(
            None if shared is not None else mongo_uri or self.mongo_uri,
            database=database or self.database,
            collection=collection or self.collection,
            store=store,
            client=shared,
            timeout=timeout or self.timeout,
        )
        twin.handlers, twin.schedules = self.handlers, self.schedules
        return twin

    def for_another_loop(self) -> Self:
        """This runner for another event loop or thread: the same handlers, the same tasks.

        A store any loop may share (the memory store) is shared; a MongoDB-backed runner
        gets its own client to the same database, since a PyMongo client belongs to the
        event loop that first used it.
        """
        if self._client is not None:
            raise ConfigurationError(
                "a runner on the application's AsyncMongoClient (client=) belongs to its event loop;"
                " in sync code use runner.sync(client=your MongoClient)"
            )
        shared = self._store is not None and not self._store.bound_to_loop
        return self.copy(store=self._store if shared else None)


def _shared(client: AsyncMongoClient[Any], database: str, collection: str) -> Store:
    """A store on the application's client, which the application closes."""
    from taskrunner.store.mongo import MongoStore

    return MongoStore(client, database, collection, owns_client=False)


def _seconds(duration: float | timedelta | None) -> float | None:
    return duration.total_seconds() if isinstance(duration, timedelta) else duration


def _build(
    name: str, params: dict[str, Any], spec: Mapping[str, Any], registration: Registration | None
) -> NewTask:
    """The task ``spec`` describes, recording what the call named: a keyword left out or
    None is not named (``update_pending`` leaves that part of a stored task alone)."""
    given = {k: v for k, v in spec.items() if k in OPTION_NAMES and v is not None}
    options = {**(registration.options if registration else {}), **given}
    values = {k: spec.get(k) for k in ("key", "priority", "run_at", "delay") if spec.get(k) is not None}
    values.setdefault("key", uuid.uuid4().hex)
    values |= _workflow_values(spec)
    try:
        task = NewTask.model_validate({**values, "name": name, "params": params, "options": options})
    except ValidationError as exc:
        raise invalid_task(exc) from None
    named = {
        "name",
        *values,
        *(["params"] if spec.get("params") is not None else []),
        *(["options"] if given else []),
    }
    return task.naming(named, TaskOptions.set_by(given))


def _workflow_values(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A publish call's workflow keywords, as ``NewTask`` takes them."""
    values = {k: spec[k] for k in WORKFLOW_FIELDS if spec.get(k) is not None}
    after = values.get(f.AFTER)
    if isinstance(after, str):
        raise InvalidTask(
            f.AFTER, f"must be a list of task keys, not the string {after!r}: after=[{after!r}]"
        )
    if after is not None and not isinstance(after, list):
        try:
            values[f.AFTER] = list(after)
        except TypeError:
            raise InvalidTask(f.AFTER, f"must be a list of task keys, not {after!r}") from None
    return values


def _at_index(index: int, build: Callable[[Mapping[str, Any]], NewTask], spec: Mapping[str, Any]) -> NewTask:
    if not isinstance(spec, Mapping):
        raise InvalidTask(f"tasks[{index}]", "must be a mapping of publish keywords")
    try:
        return build(spec)
    except InvalidTask as exc:
        exc.place(f"tasks[{index}]")  # the same error, placed in the batch
        raise


def _check_unique_keys(tasks: Sequence[NewTask]) -> None:
    seen: set[str] = set()
    for i, task in enumerate(tasks):
        if task.key in seen:
            raise InvalidTask(f"tasks[{i}].key", f"duplicate key {task.key!r} in one publish_many call")
        seen.add(task.key)


def _limit(rate_limit: str | None, max_running: int | None, limit_by: str | None) -> Limit:
    limit = Limit(
        parse_rate(rate_limit) if rate_limit is not None else None,
        check_max_running(max_running) if max_running is not None else None,
        limit_by,
    )
    if limit_by is not None and not limit:
        raise InvalidTask("limit_by", "limits nothing without rate_limit or max_running")
    if limit_by is not None and (not isinstance(limit_by, str) or not limit_by):
        raise InvalidTask("limit_by", f"must be a params field name, got {limit_by!r}")
    return limit


def _limit_name(name: str) -> str:
    if name != ALL:
        NewTask.build(key="-", name=name)  # the name rules of tasks; InvalidTask names the problem
    return name


def _check_option_names(names: Iterable[str]) -> None:
    """Refuse, naming every one, the names that are not task options."""
    unknown = sorted(set(names) - OPTION_NAMES)
    if unknown:
        known = ", ".join(sorted(OPTION_NAMES))
        (field, message), *more = [(f"options.{u}", f"unknown option {u!r}; known: {known}") for u in unknown]
        raise InvalidTask(field, message, more=more)


class _Following:
    """``wait``'s view of one task: its change stream (``Store.watch(key=...)``), and a read
    of the task at least every step. A stream the server ends is reopened at once, the task
    read again, and the end logged once (``taskrunner.engine.follow``); without a stream (none on
    the server, or it cannot be followed) the reads alone still honour the timeout."""

    def __init__(self, store: Store, key: str) -> None:
        self.store, self.key = store, key
        self.stream: ChangeStream | None = None
        self._ends = StreamEnds(log, "wait", key=key)

    async def open(self) -> None:
        try:
            self.stream = await self.store.watch(key=self.key)
        except StoreUnavailable:
            raise  # an unreachable server fails now, not after a second server timeout
        except StoreError:
            self.stream = None  # no change streams here: polling alone still honours the timeout

    async def next_version(self, wait: float) -> Task:
        """The task after its next state change, or as stored after ``wait`` seconds."""
        if self.stream is None:
            await asyncio.sleep(wait)
            return await self.store.get(self.key)
        try:
            event = await self.stream.next(wait)
        except ChangeStreamEnded as exc:
            await self.close()
            if self._ends.ended(exc):
                await self.open()  # a new stream, then the read below covers the gap
        except StoreError:
            await asyncio.sleep(wait)  # a failing getMore: this step polls (PyMongo resumes the stream)
        else:
            self._ends.worked()
            if event is not None and event.task is not None:
                return event.task
        return await self.store.get(self.key)

    async def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            with suppress(StoreError):
                await stream.close()
