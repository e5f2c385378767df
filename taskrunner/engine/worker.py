"""The worker: a stop event, a semaphore of slots, and named side tasks under a monitor.

Side tasks: ``discovery`` (the change stream, which only wakes: new tasks and wakes),
``claimer`` (waits for a free slot and a due entry in the claim queue, then claims
atomically, or sweeps), ``clock`` (keeps the estimate of the server's clock, so
scheduling never trusts this machine's clock) and ``registry`` (beats, learns peers).
A side task that crashes is logged and restarted; nothing a document or a handler
does stops the worker. On stop, claiming ends, running handlers get
``shutdown_timeout`` seconds, then are cancelled and their claims released so another
worker takes over at once, without spending failure budget.

Who claims what does not depend on when events arrive: every worker that hears of a
task computes the same rendezvous-hash owner among the live peers handling its name;
only the owner queues it. A task its owner has not claimed ``ORPHAN_GRACE`` seconds
after it became claimable (owner busy, dead, or the task was never heard of) is found
by a sweep (``Store.due``) of any worker with a free slot, which also finds expired
leases: no worker follows anyone's renewals.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from taskrunner._version import __version__
from taskrunner.engine.claim_queue import ClaimQueue, Due, Kind, Place, Rank
from taskrunner.engine.clock import ServerClock
from taskrunner.engine.discovery import Discovery
from taskrunner.engine.execution import Execution, Stop
from taskrunner.engine.heartbeat import Heartbeat
from taskrunner.engine.observe import NullObserver, WorkerObserver
from taskrunner.engine.outage import Outage
from taskrunner.engine.writes import RunWrites
from taskrunner.errors import (
    ClaimUnconfirmed,
    ConfigurationError,
    MalformedTask,
    ServerTooOld,
    StoreError,
    TaskRunnerError,
)
from taskrunner.limits.gatekeeper import GateKeeper
from taskrunner.limits.gates import Limit, Permit, dealt_to
from taskrunner.limits.watch import LimitWatch
from taskrunner.models import Task, TaskState, WorkerInfo
from taskrunner.observability.logs import get_logger
from taskrunner.observability.redact import redact
from taskrunner.schedules.scheduler import Scheduler
from taskrunner.store import preflight, rules
from taskrunner.store.base import Claim, Claimed, Window
from taskrunner.store.fields import BUCKETS
from taskrunner.store.sizes import MAX_WORKER_ID_BYTES
from taskrunner.worker_options import WorkerOptions
from taskrunner.workflows.follower import Follower
from taskrunner.workflows.upstream import Upstreams

if TYPE_CHECKING:
    from taskrunner.client import TaskClient

MAX_MISSES = 2  # claim attempts on a due key the server refuses before it is left to sweeps
KEYLESS = "\0keyless"  # the queue key of the keyless claim's entry (Kind.KEYLESS, see Worker.keyless)
SWEEP = "\0sweep"  # the queue key of the next sweep's entry (Kind.SWEEP, see Worker.sweep_at)
REQUEST_RANK = Rank(Place.OWNED, 0, 0, 0.0)
"""The keyless claim's rank: among this worker's own tasks of priority 0."""
SWEEP_RANK = Rank(Place.TAKEN_ON, 0, 0, 0.0)
"""The sweep's rank (it goes first anyway once due: see ``_next_due``)."""
MIN_BATCH = 3  # a batched claim costs two round trips (update, read back): worth it from three tasks
CLAIM_AMONG = 8  # keys one claim of a limited name chooses among (the server takes the best still claimable)
ORPHAN_GRACE = 0.5  # seconds a task's owner has to claim it before any worker's sweep may
SWEEP_INTERVAL = 1.0  # seconds between sweeps while a slot is free (takeovers, orphans)
QUIET_SWEEP_INTERVAL = 2.0  # the same after a sweep that saw nothing, while nothing runs here
FLEET_SWEEPS = 4.0  # sweeps per second the live workers of a name make together, at most
SWEEP_LIMIT = 100  # tasks one sweep reads (of each state: RUNNING, PENDING)
BUSY_SWEEP_LIMIT = 10  # the same while the worker has due tasks of its own
DRAIN_RECHECK = 0.25  # seconds between a drain's checks while claimable tasks wait for their grace
DRAIN_SLACK = 1.0  # draining, tasks due within this many seconds count as claimable now
RECOVERED = "claims recovered after a lost reply"
RESTART_PAUSE = 1.0  # seconds before a crashed side task restarts; doubled per crash in a row
MAX_RESTART_PAUSE = 30.0
HEALTHY_RUN = 60.0  # seconds a side task ran before it crashed that make the crash a first one


def _hash(token: str, worker_id: str) -> bytes:
    return hashlib.blake2b(f"{token}\0{worker_id}".encode(), digest_size=8).digest()


def _token(task: Task) -> str:
    """What ownership is decided on: the task's bucket (so the worker whose stream hears
    the insert is the one that claims it), or its key when it has no usable bucket."""
    return _bucket_token(task.bucket) if task.bucket is not None else task.key


def _bucket_token(bucket: int) -> str:
    return f"\0bucket{bucket}"


def owned_buckets(worker_id: str, peers: Sequence[str]) -> list[int]:
    """The buckets ``worker_id`` owns among ``peers`` (rendezvous hashing: each bucket goes
    to the worker with the smallest hash; a worker joining or leaving moves only its share)."""
    candidates = [*peers, worker_id]
    return [
        b for b in range(BUCKETS) if min(candidates, key=lambda w: _hash(_bucket_token(b), w)) == worker_id
    ]


def default_worker_id() -> str:
    """Fresh per process start, so a restarted worker is never mistaken for its old self."""
    suffix = f"-{os.getpid()}-{secrets.token_hex(3)}"
    host = socket.gethostname().encode()[: MAX_WORKER_ID_BYTES - len(suffix)].decode(errors="ignore")
    return host + suffix  # a long host name is cut: every run's entry names its worker


class Worker:
    """One worker process's engine: claims and runs the tasks of ``runner``'s handlers.

    Configure it with ``options`` (a ``WorkerOptions``) or with its fields as keywords
    (``Worker(runner, concurrency=4)``), which override ``options``. ``observer`` receives
    the worker's events (``taskrunner.observability.metrics.PrometheusObserver``). ``await run()``
    until ``stop()``; ``TaskRunner.run_worker`` does both for you.
    """

    def __init__(
        self,
        runner: TaskClient,
        options: WorkerOptions | None = None,
        *,
        observer: WorkerObserver | None = None,
        **overrides: Any,
    ) -> None:
        self.options = options = (options or WorkerOptions()).merged(**overrides)
        self.runner, self.store, self.handlers = runner, runner.store, runner.handlers
        self.worker_id = options.worker_id or default_worker_id()
        self.concurrency, self.shutdown_timeout = options.concurrency, options.shutdown_timeout
        self.poll_interval, self.beat_interval = options.poll_interval, options.beat_interval
        self.batch, self.drain = options.batch, options.drain
        self.names = frozenset(runner.handlers.names())
        self.queue = ClaimQueue(options.queue_capacity)
        self.observer: WorkerObserver = observer or NullObserver()
        self.clock = ServerClock()
        self.started_at = datetime.now(UTC)
        self.peers: list[WorkerInfo] = []
        self._peers_known = asyncio.Event()
        self._owned_cache: dict[tuple[str, ...], list[int]] = {}
        self._sweep_due: float | None = None
        self.runs: dict[str, tuple[Execution, asyncio.Task[None]]] = {}
        self.writes = RunWrites(self.store)  # every run's renewals and outcomes, grouped
        self.heartbeat = Heartbeat(self.writes, self.worker_id)
        self.log = get_logger("taskrunner.worker").bind(worker_id=self.worker_id)
        self.declared = {name: runner.handlers.get(name).limit for name in self.names}
        self._stop = asyncio.Event()
        self._slots = asyncio.Semaphore(self.concurrency)
        self._misses: dict[str, int] = {}
        self._unconfirmed: list[ClaimUnconfirmed] = []  # claims whose reply was lost, to recover
        self._executor = ThreadPoolExecutor(self.concurrency, thread_name_prefix="taskrunner-handler")
        self._drain_seen: set[str] = set()
        self._elsewhere: set[str] = set()  # gates the last sweep saw other workers' tasks of
        self._parts(options.discovery == "poll")

    def _parts(self, polling: bool) -> None:
        """Discovery, limits, gates and the outage loggers, which call back into the worker."""
        self.discovery = Discovery(
            self.store,
            sorted(self.names),
            consider=self.consider,
            sweep_at=self.sweep_at,
            keyless=self.keyless,
            polling=polling,
        )
        self.limits = LimitWatch(
            self.store,
            sorted(self.names),
            self._paused_changed,
            self._server_now,
            declared=self.declared,
            on_limits=self._limits_changed,
        )
        self.gates = GateKeeper(
            self.store,
            self.worker_id,
            self.clock.now,
            self.limits.limits,
            capacity=self.concurrency,
            peers=self._serving,
            throttled=lambda gate: self.limits.gate_throttles.get(gate),
            stop_run=self._slot_lost,
            opened=self._gate_opened,
            clock_error=lambda: self.clock.error,
        )
        self.upstreams = Upstreams(self.store)
        self.follower = Follower(self.store, self._publish_compensations, self._sweep_intervals, self.log)
        # While the server is away each of these logs once when failing starts and once when it ends.
        self._claims = Outage(self.log, "claim failed", "claiming recovered", cap=3.0)
        self._clock_outage = Outage(
            self.log, "cannot read the server's clock; retrying", "server clock recovered", base=0.2
        )
        self._beats = Outage(self.log, "registry heartbeat failed", "registry heartbeat recovered")

    def stop(self) -> None:
        """Stop claiming and shut down gracefully (safe to call from a signal handler)."""
        self._stop.set()
        self.queue.changed.set()

    def keyless(self) -> None:
        """Queue one claim without a key: the server picks the best claimable task, which
        reaches documents no model reads (they are recorded as failed runs, never run)."""
        self.queue.put(KEYLESS, self.clock.now(), REQUEST_RANK, kind=Kind.KEYLESS)

    def sweep_at(self, when: datetime | float | None) -> None:
        """Sweep at ``when`` (server time; None: now) unless a sweep comes sooner."""
        at = when.timestamp() if isinstance(when, datetime) else self.clock.now() if when is None else when
        if self._sweep_due is None or at < self._sweep_due:
            self._sweep_due = at  # kept apart from the queue, which may evict when it overflows
            self.queue.changed.set()

    def consider(self, task: Task, *, steal: bool = False) -> bool:
        """Queue ``task`` at the time this worker may claim it, if this worker should:
        ``worker_ids`` name it or it owns the task; a task of a limited name that another
        worker owns, when this one has permits of its gate to take it on with (after its
        own: ``Place.TAKEN_ON``); with ``steal``, also when its owner let the grace pass. Returns
        whether it was queued."""
        claimable = task.name in self.names and task.name not in self.limits.paused
        # A sweep lists a task whose own lease expires soon; one of this worker's live runs renews it.
        running_here = any(entry.run_id in self.runs for entry in task.workers)
        at = rules.next_claim(task, self.worker_id) if claimable and not running_here else None
        if at is None:
            self.queue.discard(task.key)
            return False
        mine = self.worker_id in task.options.worker_ids
        when = at.timestamp()
        gate = self.gates.gate_of(task.name, task.params)
        pending = task.state is TaskState.PENDING
        place = Place.NAMED if mine else Place.OWNED if self.owns(task, gate) else None
        if place is None and gate and pending and self.gates.can_start(gate):
            # A gate's permits are this worker's own and any of them may start any task of
            # the gate: taken on after its own tasks of the gate, a permit of it never idles
            # while the gate's tasks wait on other workers (each claim of a limited name
            # chooses among several keys, so a task another worker started is skipped).
            place = Place.TAKEN_ON
        elif (
            place is None and steal and (not pending or not gate) and when + ORPHAN_GRACE <= self.clock.now()
        ):
            place = Place.OWNED  # an orphan; a limited name's takeover needs a permit like any start
        if place is None:
            return False
        takeover = 0 if task.state is TaskState.RUNNING else 1
        rank = Rank(place, -task.priority, takeover, task.created_at.timestamp())
        fresh = pending and not task.workers and not task.fatal
        queued = self.queue.get(task.key)
        if gate and queued is not None and (queued.since, queued.rank, queued.gate) == (when, rank, gate):
            return True  # waiting for a permit of its gate (or due already): left so
        self.queue.put(task.key, when, rank, fresh=fresh, name=task.name, gate=gate)
        return True

    def active_names(self) -> list[str]:
        """The names this worker claims now: its handlers' names less the paused ones."""
        return sorted(self.names - self.limits.paused)

    def free_names(self) -> list[str]:
        """The active names without fleet-wide limits: claimed without a gate's permit."""
        return [name for name in self.active_names() if name not in self.gates.limits]

    def _gated(self, names: list[str]) -> list[str]:
        """The names with fleet-wide limits: sweeps read each one's tasks on its own."""
        return [name for name in names if name in self.gates.limits]

    def _paused_changed(self, paused: frozenset[str]) -> None:
        """Drop queued tasks of newly paused names; sweep at once for resumed ones' backlog."""
        self.log.info("paused names changed", paused=sorted(paused))
        self.queue.drop_names(paused)
        self.sweep_at(None)

    def _limits_changed(self, limits: dict[str, Limit]) -> None:
        """Operators changed fleet-wide limits: queued tasks of those names are read again
        (their gates may differ) and their permits given back."""
        changed = self.gates.set_limits(limits)
        self.log.info("limits changed", limits={n: limits[n].describe() for n in sorted(limits)})
        self.queue.drop_names(frozenset(changed))
        self.sweep_at(None)

    def _server_now(self) -> datetime:
        return datetime.fromtimestamp(self.clock.now(), UTC)

    async def _throttle(self, task: Task, seconds: float) -> None:
        """A handler raised ``RateLimited``: no worker starts a task of its name for
        ``seconds`` (the name's limits document holds ``throttled_until``)."""
        self.log.warning("rate limited by a handler", name=task.name, seconds=seconds)
        try:
            limit = self.gates.limits.get(task.name)
            if limit is not None and limit.limit_by is not None:  # that value only
                await self.gates.throttle(self.gates.gate_of(task.name, task.params), task.name, seconds)
                return
            await self.store.throttle(task.name, seconds)
            await self.limits.refresh()  # this worker, the likeliest to call again, stops at once
        except StoreError as exc:
            self.log.warning("could not store the rate limit", error=str(exc))

    def rank(self, task: Task) -> int:
        """This worker's place in the rendezvous-hash order of the live peers (from the
        registry) that handle the task's name; 0 is the task's owner. Every worker computes
        the same order, so one claims and the others never try, whatever events reach them."""
        return self._place(_token(task), [p.worker_id for p in self.peers if task.name in p.names])

    def _serving(self, name: str) -> list[str]:
        """Ids of the live workers that handle ``name``, this one included, sorted."""
        return sorted([self.worker_id, *(p.worker_id for p in self.peers if name in p.names)])

    def owns(self, task: Task, gate: str | None = None) -> bool:
        """Rank 0 among the live peers; for a limited name whose limit is smaller than the
        fleet, among the workers dealt a lane and a slot of the task's gate (the others
        could never start it). ``gate``: the task's, when the caller has it already."""
        gate = self.gates.gate_of(task.name, task.params) if gate is None else gate
        few = self.gates.owners(gate, task.name) if gate else None
        if few is None:
            return self.rank(task) == 0
        return (
            self.worker_id in few and self._place(_token(task), [w for w in few if w != self.worker_id]) == 0
        )

    async def run(self) -> None:
        """Claim and run tasks until ``stop()`` (or, draining, until nothing is left to run
        now), then shut down gracefully; raises ``ConfigurationError`` without handlers."""
        if not self.names:
            raise ConfigurationError("the app registers no handlers: nothing to run")
        self.log.info("worker started", concurrency=self.concurrency, tasks=sorted(self.names))
        await self._check_server()
        side: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
            "discovery": lambda: self.discovery.run(self._stop),
            "claimer": self._claim_loop,
            "clock": self._clock_loop,
            "registry": self._registry_loop,
            "limits": self._limits_loop,
            "gates": lambda: self.gates.run(self._stop, self.declared),
            "workflows": lambda: self.follower.run(self._stop),
        }
        if self.runner.schedules:
            side["scheduler"] = self._schedule_loop
        tasks = {
            name: asyncio.create_task(self._supervise(name, make), name=name) for name, make in side.items()
        }
        try:
            await self._stop.wait()
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await self._shutdown()
            with suppress(StoreError):
                await self.store.unregister(self.worker_id)
            self._executor.shutdown(wait=False, cancel_futures=True)
            self.log.info("worker stopped")

    async def _check_server(self) -> None:
        """The start-up check (taskrunner.store.preflight): a server too old raises ``ServerTooOld``;
        each problem is one warning; without change streams the worker polls from the start.
        A server away or refusing the check's commands leaves the worker as it was."""
        needs = preflight.worker_needs(
            self.runner.collection,
            task_stream=not self.discovery.by_choice,
            schedules=bool(self.runner.schedules),
        )
        polling = f"polling for tasks every {self.poll_interval:g} s instead"
        try:
            checked = await preflight.check(self.store, self.runner.database, needs, polling=polling)
        except ServerTooOld:
            raise
        except TaskRunnerError as exc:
            self.log.warning("start-up check skipped", error=redact(str(exc)))
            return
        for line in checked.warnings:
            self.log.warning(line)
        if checked.server is not None:
            server = checked.server
            self.log.info("server checked", version=server.version_text, topology=server.topology.value)
        if not checked.streams:
            self.discovery.poll_only()
            self.limits.follow = False

    async def _supervise(self, name: str, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """The monitor: a side task that dies is restarted after a pause, which doubles
        while it keeps dying (up to ``MAX_RESTART_PAUSE``). Only the first crash of such a
        run of crashes is logged, and a server that does not answer without a traceback:
        a side task waits out outages itself (one line each way), so reaching this is a
        defect to report, not a reason to flood the log."""
        crashes = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                await make()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                crashes = 1 if time.monotonic() - started >= HEALTHY_RUN else crashes + 1
                self._crashed(name, exc, crashes)
                await asyncio.sleep(min(MAX_RESTART_PAUSE, RESTART_PAUSE * 2 ** (crashes - 1)))

    def _crashed(self, name: str, exc: Exception, crashes: int) -> None:
        if crashes > 1:
            self.log.debug("side task crashed; restarting", side_task=name, crashes=crashes, error=repr(exc))
        elif isinstance(exc, StoreError):
            self.log.warning("side task crashed; restarting", side_task=name, error=redact(str(exc)))
        else:
            self.log.error("side task crashed; restarting", side_task=name, exc_info=exc)

    # -- claiming ------------------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        await self._sync_clock()
        with suppress(TimeoutError):  # ownership needs the peers; a silent registry must not block
            await asyncio.wait_for(self._peers_known.wait(), 2 * self.beat_interval)
        self.sweep_at(None)
        while not self._stop.is_set():
            await self._slots.acquire()
            held, claims = 1, []
            try:
                due = await self._wait_due()
                if due and due[0].kind is Kind.SWEEP:
                    self._sweep_due = None
                    await self._sweep()
                    continue
                gated = [d for d in due if d.gate]
                due = [d for d in due if not d.gate]
                if gated and (not due or gated[0].rank <= due[0].rank):
                    # A limited name goes first: claimed with its gate's permits.
                    held += await self._take_free_slots(min(len(gated), self.batch) - 1)
                    claims = await self._claim_gated(gated, held)
                elif due and due[0].kind is Kind.KEYLESS:
                    self.queue.discard(KEYLESS)  # one claim per request, whatever it finds
                    claims = await self._claim(due)
                else:
                    if len(due) >= MIN_BATCH and self.batch >= MIN_BATCH:
                        await asyncio.sleep(0)  # runs that ended together free their slots first
                        held += await self._take_free_slots(min(len(due), self.batch) - 1)
                    if held >= MIN_BATCH:
                        claims = await self._claim_batch([d for d in due if d.kind is Kind.TASK][:held])
                    elif due:
                        claims = await self._claim(due)
            finally:
                for _ in range(held - len(claims)):
                    self._slots.release()
            for claim in claims:
                self._start(claim)

    async def _take_free_slots(self, wanted: int) -> int:
        """Take up to ``wanted`` more slots that are free right now (never waits)."""
        taken = 0
        while taken < wanted and not self._slots.locked():
            await self._slots.acquire()  # returns at once: a slot is free
            taken += 1
        return taken

    async def _wait_due(self) -> list[Due]:
        """The sweep marker when the sweep is due; else due claim-queue entries, best first."""
        while not self._stop.is_set():
            self.queue.changed.clear()
            now = self.clock.now()
            # The sweep goes first when it is due, even with keys of its own due: it is what
            # finds expired leases, which must not wait until this worker's backlog drains.
            if self._sweep_due is not None and self._sweep_due <= now:
                return [Due(self._sweep_due, SWEEP_RANK, SWEEP, kind=Kind.SWEEP)]
            due = self.queue.due(now, limit=max(self.batch, MIN_BATCH))
            if due:
                return due
            recheck = await self._check_drained() if self.drain and not self.runs else None
            if self._stop.is_set():
                return []
            now = self.clock.now()
            times = [t for t in (self.queue.next_at(), self._sweep_due, recheck) if t is not None]
            wait = max(0.0, min(times) - now) if times else None
            with suppress(TimeoutError):
                await asyncio.wait_for(self.queue.changed.wait(), wait)
        return []

    async def _check_drained(self) -> float:
        """Drain mode with nothing running: stop once nothing is claimable now; returns
        when to check again (tasks claimable now may wait for their grace or permit)."""
        if await self._drained():
            self.log.info("drained: nothing runs here and nothing is claimable now")
            self.stop()
        return self.clock.now() + DRAIN_RECHECK

    async def _drained(self) -> bool:
        """Drain mode, nothing running here: whether no task is claimable by this worker now.
        Tasks that are get queued (taken from their owners once the orphan grace passes);
        unreadable documents keep the drain going only until one keyless claim met them."""
        names = self.active_names()
        if not names:
            return True
        try:
            if not await self.follower.idle():
                return False  # a follow-up may release tasks that run after others
        except StoreError as exc:
            await asyncio.sleep(self._claims.failed(exc))
            return False
        # A task published a moment ago (a handler's follow-up) has claimable_at = the server's
        # time then, which this worker's estimate of the server clock may not have reached yet.
        horizon = self._server_now() + timedelta(seconds=DRAIN_SLACK)
        try:
            page = await self.store.due(
                self.worker_id, names, horizon=horizon, limit=BUSY_SWEEP_LIMIT, apart=self._gated(names)
            )
        except StoreError as exc:
            await asyncio.sleep(self._claims.failed(exc))
            return False
        self._claims.ok()
        ready = [task for task in page.tasks if self._claimable_by(task, horizon)]
        for task in ready:
            # Queued already (e.g. waiting for its gate's permit): left where it waits.
            if task.key not in self.queue and not self.consider(task):
                self.consider(task, steal=True)
        unseen = {bad.key or bad.problem for bad in page.unreadable} - self._drain_seen
        if unseen:
            self._drain_seen |= unseen
            self.keyless()
        return not ready and not unseen

    def _claimable_by(self, task: Task, now: datetime) -> bool:
        """Whether this worker may claim ``task`` by ``now``, by its own constraints too."""
        at = rules.next_claim(task, self.worker_id)
        return at is not None and at <= now

    async def _claim(self, due: list[Due]) -> list[Claim]:
        # By key, the best due entry: the server then touches one document through the
        # unique key index instead of sorting every claimable task on each claim, and
        # rendezvous ranks already spread a burst of events over the workers.
        if self._unconfirmed:
            return await self._confirm(1)
        key = None if due[0].kind is Kind.KEYLESS else due[0].key
        try:
            claim = await self.store.claim(
                self.worker_id, key=key, names=self.free_names(), fresh=due[0].fresh
            )
        except MalformedTask as exc:
            self.log.warning("claimed an unreadable task; recorded as its failure", error=str(exc))
            return []
        except StoreError as exc:
            self._lost(exc)
            await asyncio.sleep(self._claims.failed(exc))
            return []
        self._claims.ok()
        if claim is None:
            if key is not None:
                self._claimed_none(due[:1])
            return []
        self._claimed([claim])
        self._read_back([claim])
        return [claim]

    async def _claim_batch(self, due: list[Due]) -> list[Claim]:
        """Several slots are free and several tasks due: claim them in one update."""
        claimed = await self._claim_keys(due, self.free_names())
        return claimed.claims if claimed is not None else []

    async def _claim_keys(
        self,
        due: list[Due],
        names: list[str],
        window: Window | None = None,
        *,
        one: bool = False,
        early: bool = False,
    ) -> Claimed | None:
        """Claim these keys, each on its own, in one update (one command for a single key),
        or with ``one`` the best one still claimable; None when the server failed, and
        then the claims may have landed. ``early``: the window opens at a throttle's end,
        which the server's clock may not have reached. Claims of an earlier call whose
        reply was lost are recovered first, instead."""
        if self._unconfirmed:
            return Claimed(await self._confirm(len(due)), [])
        keys, fresh = [d.key for d in due], all(d.fresh for d in due)
        try:
            if len(keys) == 1 or one:
                claimed = await self._claim_one(keys, names, fresh, window)
            else:
                claimed = await self.store.claim_many(
                    self.worker_id, keys, names=names, fresh=fresh, window=window
                )
        except StoreError as exc:
            self._lost(exc)
            await asyncio.sleep(self._claims.failed(exc))
            return None
        self._claims.ok()
        self._read_back(claimed.claims)
        for problem in claimed.rejected:
            self.log.warning("claimed an unreadable task; recorded as its failure", error=str(problem))
        won = {c.task.key for c in claimed.claims}
        missed = [] if one and (claimed.claims or claimed.rejected) else [d for d in due if d.key not in won]
        if missed:
            self._claimed_none(missed, early=early)
        self._claimed(claimed.claims)
        return claimed

    def _read_back(self, claims: list[Claim]) -> None:
        """One line for a claim whose reply was lost and whose landed claims were read back
        at once by their run ids (``Claim.recovered``): they run like any other."""
        keys = [claim.task.key for claim in claims if claim.recovered]
        if keys:
            self.log.warning(RECOVERED, running=keys, released=[], unreadable=0)

    def _lost(self, exc: StoreError) -> None:
        """A claim failed: if it may have landed, its run ids are kept to recover it."""
        if isinstance(exc, ClaimUnconfirmed):
            self._unconfirmed.append(exc)

    async def _confirm(self, slots: int) -> list[Claim]:
        """Find the claims whose reply was lost (``Store.recover``) and run up to ``slots``
        of them; give the others back without spending budget (as a limited name's, whose
        permit was already counted as a start). Whatever the fault, the task's failure
        budget is untouched: no lease of this worker is left to expire unowned."""
        lost = self._unconfirmed
        run_ids = [run_id for exc in lost for run_id in exc.run_ids]
        keyed = all(exc.keys is not None for exc in lost)
        keys = [key for exc in lost for key in exc.keys or []] if keyed else None
        try:
            claimed = await self.store.recover(self.worker_id, run_ids, keys=keys)
        except StoreError as exc:
            await asyncio.sleep(self._claims.failed(exc))
            return []
        self._claims.ok()
        self._unconfirmed = []
        runs: list[Claim] = []
        back: list[Claim] = []
        for claim in claimed.claims:
            gated = self.gates.gate_of(claim.task.name, claim.task.params)
            (back if gated or len(runs) >= slots or self._stop.is_set() else runs).append(claim)
        for claim in back:
            try:
                await self.store.release(claim.task.key, claim.run_id)
            except StoreError as exc:
                self.log.warning("could not give back a recovered claim", key=claim.task.key, error=str(exc))
        self.log.warning(
            RECOVERED,
            running=[c.task.key for c in runs],
            released=[c.task.key for c in back],
            unreadable=len(claimed.rejected),
        )
        self._claimed(runs + back)
        return runs

    async def _claim_one(
        self, keys: list[str], names: list[str], fresh: bool, window: Window | None
    ) -> Claimed:
        """One claim of the best of ``keys``, as the single findAndModify ``claim`` is."""
        key, among = (keys[0], None) if len(keys) == 1 else (None, keys)
        try:
            claim = await self.store.claim(
                self.worker_id, key=key, keys=among, names=names, fresh=fresh, window=window
            )
        except MalformedTask as exc:
            return Claimed([], [exc])
        return Claimed([claim] if claim is not None else [], [])

    async def _claim_gated(self, due: list[Due], slots: int) -> list[Claim]:
        """Claim due tasks of limited names whose permits allow it now, at most ``slots``;
        park the others until their permit starts or their gate may give one."""
        try:
            ready, later = await self.gates.admit(due, slots)
        except StoreError as exc:
            retry = self.clock.now() + self._claims.failed(exc)
            later, ready = [(entry, retry) for entry in due], []
        for entry, at in later:
            self.queue.park(entry, at)
        for gate in {entry.gate for entry, _ in later}:
            if self.gates.startable(gate):  # a permit opened while the gate was asked
                self._gate_opened(gate)
        if later:
            self.observer.throttled(sorted(entry.name for entry, _ in later))
        if len(ready) >= MIN_BATCH:
            return await self._claim_with_permits(ready)
        claims: list[Claim] = []
        for entry, permit in ready:
            # The permit may start any task of its gate: the claim chooses among the best
            # waiting ones of the same standing (this worker's own, or taken on), so a
            # task another worker started meanwhile costs no round trip.
            among = [entry] + [
                e
                for e, _ in later
                if e.gate == entry.gate
                and (e.rank.place is Place.TAKEN_ON) == (entry.rank.place is Place.TAKEN_ON)
            ]
            claims += await self._claim_among(among[:CLAIM_AMONG], permit)
        for gate in {entry.gate for entry, _ in ready}:
            self._take_more(gate)
        return claims

    def _gate_opened(self, gate: str) -> None:
        """A permit of ``gate`` opened sooner than the tasks waiting for it were told (a
        running slot freed, a claim took nothing): the best of them look again now (as
        many as one claim chooses among)."""
        if not self.queue.wake(gate, CLAIM_AMONG, self.clock.now()):
            self._take_more(gate)

    def _take_more(self, gate: str) -> None:
        """Nothing of ``gate`` is queued here any more, while the last sweep saw other
        workers' tasks of it waiting: sweep now for more, so its permits do not idle
        until the next sweep (once per sweep that saw some)."""
        if gate in self._elsewhere and not self.queue.count(gate):
            self._elsewhere.discard(gate)
            self.sweep_at(None)

    async def _claim_among(self, entries: list[Due], permit: Permit) -> list[Claim]:
        """One claim of the best task still claimable among ``entries`` (one gate's), with
        ``permit``'s window; the permit is then settled with its claim time."""
        claimed: Claimed | None = None
        try:
            claimed = await self._claim_keys(
                entries, [entries[0].name], (permit.start, permit.until), one=True, early=permit.throttled
            )
        finally:  # whatever happened (an error, a cancellation), the permit is settled
            self._settle([(entry, permit) for entry in entries], claimed, one=True)
        return claimed.claims if claimed is not None else []

    async def _claim_with_permits(self, ready: list[tuple[Due, Permit]]) -> list[Claim]:
        """One claim for tasks whose permits are open now: the server takes them only
        within every permit's window; each permit is then settled with its claim time."""
        window = (max(p.start for _, p in ready), min(p.until for _, p in ready))
        claimed: Claimed | None = None
        try:
            claimed = await self._claim_keys(
                [entry for entry, _ in ready],
                sorted({e.name for e, _ in ready}),
                window,
                early=any(p.throttled for _, p in ready),
            )
        finally:  # whatever happened (an error, a cancellation), every permit is settled
            self._settle(ready, claimed)
        return claimed.claims if claimed is not None else []

    def _settle(self, ready: list[tuple[Due, Permit]], claimed: Claimed | None, *, one: bool = False) -> None:
        """Give each permit its claim's start and run; without an answer the claim may
        have landed, so each counts as a start at the latest its window allows. ``one``:
        the entries share one permit (a claim among them), settled once."""
        if one:
            permit = ready[0][1]
            if claimed is None or claimed.rejected:
                self.gates.used(permit, permit.until)
            elif claimed.claims:
                [only] = claimed.claims
                self.gates.used(permit, only.entry.claimed_at, only.run_id)
            else:
                self.gates.used(permit, None)
            return
        if claimed is None:
            for _, permit in ready:
                self.gates.used(permit, permit.until)
            return
        rejected = {str(problem.key) for problem in claimed.rejected}
        won = {claim.task.key: claim for claim in claimed.claims}
        for entry, permit in ready:
            claim = won.get(entry.key)
            started = claim.entry.claimed_at if claim else permit.until if entry.key in rejected else None
            self.gates.used(permit, started, claim.run_id if claim else None)

    def _sweep_intervals(self) -> tuple[float, float]:
        """Seconds to the next sweep after one that saw work, and after one that saw nothing.
        Any worker's sweep finds an expired lease or an orphan for the fleet, so the fleet
        shares a sweep rate: 16 workers sweeping every second swamped a small server."""
        if self.discovery.polling:
            return self.poll_interval, self.poll_interval
        busy = max(SWEEP_INTERVAL, (len(self.peers) + 1) / FLEET_SWEEPS) * random.uniform(0.9, 1.1)
        return busy, max(QUIET_SWEEP_INTERVAL, busy)

    async def _sweep(self) -> None:
        """Read what is claimable soon (``Store.due``) and queue what this worker should
        claim; then sweep again after the interval (the poll interval when polling)."""
        now = self.clock.now()
        busy, quiet = self._sweep_intervals()
        # With due tasks of its own a worker reads few and steals only takeovers: taking
        # another owner's backlog then only makes claims collide, and reads cost the server.
        own_work = bool(self.queue.due(now, limit=1)) and not self.discovery.polling
        # Looks as far ahead as the longest wait before the next sweep, so a lease expiring
        # meanwhile is seen (and the owner queues it for the moment it expires).
        horizon = datetime.fromtimestamp(now + quiet, UTC)
        limit = BUSY_SWEEP_LIMIT if own_work else SWEEP_LIMIT
        names = self.active_names()
        if not names:  # everything paused: resuming asks for a sweep
            return
        try:
            page = await self.store.due(
                self.worker_id, names, horizon=horizon, limit=limit, apart=self._gated(names)
            )
        except StoreError as exc:
            self.sweep_at(now + self._claims.failed(exc))
            return
        self._claims.ok()
        before = len(self.queue)
        others = [t for t in page.tasks if not self.consider(t)]
        self._forget_started({t.key for t in page.tasks}, set(self._gated(names)), now - self.clock.error)
        taken_on = [self.queue.get(t.key) for t in page.tasks]
        self._elsewhere = {e.gate for e in taken_on if e is not None and e.rank.place is Place.TAKEN_ON}
        self._steal([t for t in others if t.state is TaskState.RUNNING] if own_work else others)
        await self.discovery.settle(page.unreadable)
        more = page.after is not None and len(self.queue) > before
        # An idle fleet sweeps half as often: nothing was claimable within the horizon and
        # new tasks reach their owners' streams; a sweep that sees anything keeps the pace.
        saw_nothing = not page.tasks and not page.unreadable and not self.runs
        self.sweep_at(now if more else now + (quiet if saw_nothing else busy))

    def _forget_started(self, listed: set[str], names: set[str], before: float) -> None:
        """Other workers' tasks of these limited names, queued here and claimable before
        ``before``, that a sweep read then did not list: started meanwhile (or behind
        what it listed): forgotten, so that no claim is spent on them."""
        for gate, entries in self.queue.gates().items():
            if self.gates.name_of(gate) not in names:
                continue
            for entry in entries:
                pending = entry.rank.takeover == 1
                if (
                    entry.rank.place is Place.TAKEN_ON
                    and pending
                    and entry.since < before
                    and entry.key not in listed
                ):
                    self.queue.discard(entry.key)

    def _steal(self, others: list[Task]) -> None:
        """Queue orphans: at most as many as there are free slots; takeovers first, then
        those this worker ranks highest for, so idle sweepers spread instead of colliding."""
        budget = max(1, self.concurrency - len(self.runs))
        order = sorted(others, key=lambda t: (t.state is not TaskState.RUNNING, self.rank(t)))
        stolen: list[str] = []
        for task in order:  # a live lease listed because it expires within the horizon is no orphan yet
            if len(stolen) >= budget:
                break
            if self.consider(task, steal=True):
                stolen.append(task.key)
        self.log.debug("swept", orphans=len(others), stolen=stolen)

    def _claimed(self, claims: list[Claim]) -> None:
        for claim in claims:
            self.queue.discard(claim.task.key)
            self._misses.pop(claim.task.key, None)

    def _claimed_none(self, due: list[Due], *, early: bool = False) -> None:
        """These keys were not claimable: not quite due by the server's clock (retry
        shortly), or, once past the grace in which nobody else may take them, claimed or
        changed by someone else (leave them to events and sweeps: retrying a taken task
        would cost a command per try for nothing). ``early``: the claim's window may not
        have opened yet by the server's clock, so they are retried shortly all the same."""
        now = self.clock.now()
        self.log.debug("claim missed", keys=[entry.key for entry in due])
        for entry in due:
            misses = self._misses.get(entry.key, 0) + 1
            if misses > MAX_MISSES or (entry.since + ORPHAN_GRACE <= now and not early):
                self._misses.pop(entry.key, None)
                self.queue.discard(entry.key)
            else:
                self._misses[entry.key] = misses
                later = now + min(0.05 * 2**misses, 5.0)
                self.queue.again(entry, later)

    def _start(self, claim: Claim) -> None:
        execution = Execution(
            claim,
            store=self.store,
            handlers=self.handlers,
            worker_id=self.worker_id,
            executor=self._executor,
            observer=self.observer,
            writes=self.writes,
            heartbeat=self.heartbeat,
            throttle=self._throttle,
            holds_slot=self.gates.holds_slot,
            runner=self.runner,
            ended=self.follower.owed,
            upstreams=self.upstreams,
            clock_offset=self.clock.offset,
        )
        task = asyncio.create_task(execution.run(), name=f"run:{claim.task.key}")
        self.runs[claim.run_id] = (execution, task)
        task.add_done_callback(lambda t: self._finished(claim.run_id, t))
        self.observer.claimed(claim.task, claim.entry)
        self.observer.in_flight(len(self.runs))
        self.log.info("claimed", key=claim.task.key, run_id=claim.run_id)
        if claim.entry.took_over:
            self.log.warning(
                "taken over", key=claim.task.key, run_id=claim.run_id, from_workers=claim.entry.took_over
            )

    async def _publish_compensations(self, items: Sequence[Mapping[str, Any]]) -> None:
        """A failed flow's compensations, for whichever workers serve their names."""
        await self.runner.publish_specs(items, allow_unknown=True)

    def _slot_lost(self, run_id: str) -> None:
        """A run's fleet-wide running slot is lost or lapsing: it stops and releases its
        claim, as a run whose claim is lost stops (another run may take the slot)."""
        if (run := self.runs.get(run_id)) is not None:
            run[0].stop(Stop.SLOT_LOST)

    def _finished(self, run_id: str, task: asyncio.Task[None]) -> None:
        self.runs.pop(run_id, None)
        self.gates.finished(run_id)  # its outcome is written: its running slot is free
        self._slots.release()
        self.observer.in_flight(len(self.runs))
        if self.drain and not self.runs:
            self.queue.changed.set()  # the claimer checks whether the drain is over
        if not task.cancelled() and task.exception() is not None:
            self.log.error("run crashed", run_id=run_id, error=repr(task.exception()))

    # -- clock and shutdown ------------------------------------------------------------------
    async def _sync_clock(self) -> None:
        while not self._stop.is_set():
            try:
                await self.clock.sync(self.store)
                self._clock_outage.ok()
                return
            except StoreError as exc:
                await asyncio.sleep(self._clock_outage.failed(exc))

    async def _clock_loop(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(60)
            try:
                await self.clock.sync(self.store)
                self._clock_outage.ok()
            except StoreError as exc:
                self._clock_outage.failed(exc)  # the next sync is a minute away anyway

    async def _limits_loop(self) -> None:
        """Follow the limit documents of this worker's names (taskrunner.limits.state)."""
        outage = Outage(self.log, "cannot read the limits; retrying", "limits readable again", cap=3.0)
        await self.limits.run(self._stop, outage)

    async def _schedule_loop(self) -> None:
        """Fire the app's schedules (taskrunner.schedules.model), once the peers are known."""
        await self._peers_known.wait()
        scheduler = Scheduler(
            self.store,
            list(self.runner.schedules.values()),
            now=self._server_now,
            rank=self.schedule_rank,
            fired=self.observer.fired,
        )
        outage = Outage(
            self.log, "scheduler cannot reach the server; retrying", "scheduler recovered", cap=3.0
        )
        await scheduler.run(self._stop, outage)

    def schedule_rank(self, schedule_id: str) -> int:
        """This worker's place among the live workers declaring the schedule (0 fires first)."""
        return self._place(
            f"schedule:{schedule_id}", [p.worker_id for p in self.peers if schedule_id in p.schedules]
        )

    def _place(self, token: str, peers: list[str]) -> int:
        """This worker's place in the rendezvous-hash order of ``peers`` and itself for ``token``."""
        return sorted([*peers, self.worker_id], key=lambda w: _hash(token, w)).index(self.worker_id)

    def info(self) -> WorkerInfo:
        """This worker as its beats describe it in the worker registry."""
        running = sorted(execution.key for execution, _ in self.runs.values())
        return WorkerInfo(
            worker_id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            names=sorted(self.names),
            concurrency=self.concurrency,
            running=running,
            version=__version__,
            schedules=sorted(self.runner.schedules),
            paused=sorted(self.limits.paused),
        )

    async def _registry_loop(self) -> None:
        """Beat into the registry and learn the live peers (for task ownership and schedule firing)."""
        while not self._stop.is_set():
            try:
                if await self.store.beat(self.info(), ttl=5 * self.beat_interval):
                    self.log.warning("stop requested by an operator; shutting down")
                    self.stop()
                    return
                self.peers = [p for p in await self.store.workers() if p.worker_id != self.worker_id]
                self.discovery.listen(self._owned())
                self._beats.ok()
            except StoreError as exc:
                self._beats.failed(exc)
            self._peers_known.set()
            await asyncio.sleep(self.beat_interval * random.uniform(0.9, 1.1))

    def _few_own(self, name: str) -> bool:
        """Whether ``name``'s limit is smaller than the fleet, so that only some workers own
        its tasks (``owns``): every worker then hears all its new tasks."""
        limit = self.gates.limits.get(name)
        return limit is not None and dealt_to(name, limit, self._serving(name)) is not None

    def _owned(self) -> dict[str, list[int]] | None:
        """Per name, the buckets this worker owns among the live peers that handle it;
        names it handles alone are left out (all buckets), and None when that is every name."""
        owned: dict[str, list[int]] = {}
        for name in sorted(self.names):
            peers = tuple(sorted(p.worker_id for p in self.peers if name in p.names))
            if not peers or self._few_own(name):
                continue
            if peers not in self._owned_cache:
                if len(self._owned_cache) >= 64:  # peers churned: keep only what is current
                    self._owned_cache = {}
                self._owned_cache[peers] = owned_buckets(self.worker_id, peers)
            owned[name] = self._owned_cache[peers]
        return owned or None

    async def _shutdown(self) -> None:
        running = [task for _, task in self.runs.values()]
        if running:
            self.log.info("waiting for running tasks", count=len(running), grace=self.shutdown_timeout)
            _, pending = await asyncio.wait(running, timeout=self.shutdown_timeout)
            for task in pending:
                task.cancel()  # each run then releases its claim
            await asyncio.gather(*pending, return_exceptions=True)
        await self._give_back_unconfirmed()
        with suppress(StoreError):
            await self.gates.close()  # permits and running slots back to the fleet

    async def _give_back_unconfirmed(self) -> None:
        """Claims whose reply was lost and not yet recovered are found and given back
        (``_confirm`` runs none once stopping), retried for at most ``shutdown_timeout``:
        left alone, their leases would expire and each takeover spend a failure."""
        deadline = time.monotonic() + self.shutdown_timeout
        while self._unconfirmed and time.monotonic() < deadline:
            await self._confirm(0)
