"""The worker: a stop event, a semaphore of slots, and named side tasks under a monitor.

Side tasks: ``discovery`` (change stream + scans feeding the claim queue),
``claimer`` (waits for a free slot and a due task, then claims atomically) and
``clock`` (keeps the estimate of the server's clock, so scheduling never trusts
this machine's clock). A side task that crashes is logged and restarted; nothing
a document or a handler does stops the worker. On stop, claiming ends, running
handlers get ``shutdown_timeout`` seconds, then are cancelled and their claims
released so another worker takes over at once, without spending failure budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import structlog

from taskrunner import __version__, rules
from taskrunner.discovery import Discovery
from taskrunner.errors import ConfigurationError, MalformedTask, StoreError
from taskrunner.execution import Execution
from taskrunner.heartbeat import Heartbeat
from taskrunner.models import Task, WorkerInfo
from taskrunner.observe import NullObserver, WorkerObserver
from taskrunner.outage import Outage
from taskrunner.schedule import ClaimQueue, Due, Rank
from taskrunner.store.base import Claim, Store
from taskrunner.writes import RunWrites

if TYPE_CHECKING:
    from taskrunner.runner import TaskRunner

MAX_MISSES = 8  # claim attempts on a due key the server keeps refusing before it is dropped
# Seconds each rendezvous rank waits before claiming a newly due task. It adapts: a claim
# that finds nothing (another worker won) widens it, a won claim narrows it again.
MIN_CLAIM_STEP, MAX_CLAIM_STEP = 0.1, 0.25
MAX_RANKS = 8
SWEEP = "\0sweep"  # claim-queue entry for one claim without a key (see Worker.sweep)
MIN_BATCH = 3  # a batched claim costs two round trips (update, read back): worth it from three tasks


def default_worker_id() -> str:
    """Fresh per process start, so a restarted worker is never mistaken for its old self."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class ServerClock:
    """This machine's estimate of the server's clock (offset measured with ``hello``)."""

    def __init__(self) -> None:
        self.offset = 0.0

    async def sync(self, store: Store) -> None:
        before = time.time()
        server = (await store.server_time()).timestamp()
        after = time.time()
        self.offset = server - (before + after) / 2

    def now(self) -> float:
        return time.time() + self.offset


class Worker:
    def __init__(
        self,
        runner: TaskRunner,
        *,
        concurrency: int = 10,
        worker_id: str | None = None,
        shutdown_timeout: float = 0.5,
        poll_interval: float = 5.0,
        queue_capacity: int = 10_000,
        beat_interval: float = 2.0,
        observer: WorkerObserver | None = None,
        batch: int = 32,
        discovery: Literal["stream", "poll"] = "stream",
    ) -> None:
        """``batch``: most tasks one claim round trip may take when slots are free
        (1 claims one at a time). ``discovery="poll"`` scans every ``poll_interval``
        instead of following a change stream (which it also does when the server has none)."""
        if concurrency < 1:
            raise ConfigurationError(f"concurrency must be at least 1, got {concurrency}")
        self.runner, self.store, self.registry = runner, runner.store, runner.registry
        self.worker_id = worker_id or default_worker_id()
        self.concurrency, self.shutdown_timeout = concurrency, shutdown_timeout
        self.names = frozenset(runner.registry.names())
        self.queue = ClaimQueue(queue_capacity)
        self.discovery = Discovery(
            self.store, self.queue, self.claim_time, poll_interval=poll_interval, sweep=self.sweep
        )
        self.discovery.polling = discovery == "poll"
        self.clock = ServerClock()
        self.observer: WorkerObserver = observer or NullObserver()
        self.beat_interval = beat_interval
        self.started_at = datetime.now(UTC)
        self.peers: list[WorkerInfo] = []
        self.claim_step = MIN_CLAIM_STEP
        self.runs: dict[str, tuple[Execution, asyncio.Task[None]]] = {}
        self.batch = max(1, batch)
        self.writes = RunWrites(self.store)  # every run's renewals and outcomes, grouped
        self.heartbeat = Heartbeat(self.writes, self.worker_id)
        self.log = structlog.get_logger("taskrunner.worker").bind(worker_id=self.worker_id)
        self._stop = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)
        self._misses: dict[str, int] = {}
        self._executor = ThreadPoolExecutor(concurrency, thread_name_prefix="taskrunner-handler")
        # While the server is away each of these logs once when failing starts and once when it ends.
        self._claims = Outage(self.log, "claim failed", "claiming recovered", cap=3.0)
        self._clock_outage = Outage(self.log, "cannot read the server's clock; retrying", "server clock recovered",
                                    base=0.2)  # fmt: skip
        self._beats = Outage(self.log, "registry heartbeat failed", "registry heartbeat recovered")

    def stop(self) -> None:
        """Stop claiming and shut down gracefully (safe to call from a signal handler)."""
        self._stop.set()
        self.queue.changed.set()

    def sweep(self) -> None:
        """Queue one claim without a key: the server picks the best claimable task, which
        reaches documents no model reads (they are recorded as failed runs, never run)."""
        self.queue.put(SWEEP, self.clock.now(), (1, 0, 0.0))

    def claim_time(self, task: Task) -> tuple[float, Rank] | None:
        """When this worker may next claim ``task``, with its preference rank."""
        if task.name not in self.names:
            return None
        at = rules.next_claim(task, self.worker_id)
        if at is None:
            return None
        mine = 0 if self.worker_id in task.options.worker_ids else 1
        delay = 0.0 if mine == 0 else min(self.rank(task), MAX_RANKS) * self.claim_step
        return at.timestamp() + delay, (mine, -task.priority, task.created_at.timestamp())

    def rank(self, task: Task) -> int:
        """This worker's place among the live peers that could claim ``task`` now.

        Every worker computes the same rendezvous-hash order for a key, so when an
        event makes a task due, rank 0 claims at once and rank r only after r steps;
        by then the winner's claim event has usually arrived and the task is no longer
        due. This keeps claim attempts near one per task without a coordinator.
        """
        free = {p.worker_id for p in self.peers if task.name in p.names and len(p.running) < p.concurrency}
        candidates = free | {self.worker_id}
        order = sorted(
            candidates, key=lambda w: hashlib.blake2b(f"{task.key}\0{w}".encode(), digest_size=8).digest()
        )
        return order.index(self.worker_id)

    async def run(self) -> None:
        if not self.names:
            raise ConfigurationError("the app registers no handlers: nothing to run")
        self.log.info("worker started", concurrency=self.concurrency, tasks=sorted(self.names))
        side = {"discovery": lambda: self.discovery.run(self._stop), "claimer": self._claim_loop,
                "clock": self._clock_loop, "registry": self._registry_loop}  # fmt: skip
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

    async def _supervise(self, name: str, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """The monitor: a side task that dies is logged and restarted after a pause."""
        while not self._stop.is_set():
            try:
                await make()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("side task crashed; restarting", side_task=name)
                await asyncio.sleep(1.0)

    # -- claiming ------------------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        await self._sync_clock()
        while not self._stop.is_set():
            await self._slots.acquire()
            held, claims = 1, []
            try:
                due = await self._wait_due()
                if due and due[0].key == SWEEP:
                    self.queue.discard(SWEEP)  # one claim per sweep, whatever it finds
                elif len(due) >= MIN_BATCH and self.batch >= MIN_BATCH:
                    await asyncio.sleep(0)  # runs that ended together free their slots first
                    held += await self._take_free_slots(min(len(due), self.batch) - 1)
                if held >= MIN_BATCH:
                    claims = await self._claim_batch([d for d in due if d.key != SWEEP][:held])
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
        while not self._stop.is_set():
            self.queue.changed.clear()
            now = self.clock.now()
            due = self.queue.due(now, limit=max(self.batch, MIN_BATCH))
            if due:
                return due
            next_at = self.queue.next_at()
            wait = None if next_at is None else max(0.0, next_at - now)
            with suppress(TimeoutError):
                await asyncio.wait_for(self.queue.changed.wait(), wait)
        return []

    async def _claim(self, due: list[Due]) -> list[Claim]:
        # By key, the best due entry: the server then touches one document through the
        # unique key index instead of sorting every claimable task on each claim, and
        # rendezvous ranks already spread a burst of events over the workers.
        key = None if due[0].key == SWEEP else due[0].key
        try:
            claim = await self.store.claim(self.worker_id, key=key, names=sorted(self.names))
        except MalformedTask as exc:
            self.log.warning("claimed an unreadable task; recorded as its failure", error=str(exc))
            return []
        except StoreError as exc:
            await asyncio.sleep(self._claims.failed(exc))
            return []
        self._claims.ok()
        if claim is None:
            if key is not None:
                self._claimed_none(due[:1])
            return []
        self._claimed([claim])
        return [claim]

    async def _claim_batch(self, due: list[Due]) -> list[Claim]:
        """Several slots are free and several tasks due: claim them in one update."""
        try:
            claimed = await self.store.claim_many(
                self.worker_id, [d.key for d in due], names=sorted(self.names)
            )
        except StoreError as exc:
            await asyncio.sleep(self._claims.failed(exc))
            return []
        self._claims.ok()
        for problem in claimed.rejected:
            self.log.warning("claimed an unreadable task; recorded as its failure", error=str(problem))
        won = {c.task.key for c in claimed.claims}
        missed = [d for d in due if d.key not in won]
        if missed:
            self._claimed_none(missed)
        self._claimed(claimed.claims)
        return claimed.claims

    def _claimed(self, claims: list[Claim]) -> None:
        if claims:
            self.claim_step = max(self.claim_step * 0.9, MIN_CLAIM_STEP)
        for claim in claims:
            self.queue.discard(claim.task.key)
            self._misses.pop(claim.task.key, None)

    def _claimed_none(self, due: list[Due]) -> None:
        """Another worker won (or the queue was stale): wait longer before racing, retry later."""
        self.claim_step = min(self.claim_step * 1.5, MAX_CLAIM_STEP)
        self._missed(due)

    def _missed(self, due: list[Due]) -> None:
        """These keys were not claimable: retry them later; events usually correct them first."""
        for entry in due:
            misses = self._misses.get(entry.key, 0) + 1
            if misses > MAX_MISSES:
                self._misses.pop(entry.key, None)
                self.queue.discard(entry.key)
            else:
                self._misses[entry.key] = misses
                self.queue.put(entry.key, self.clock.now() + min(0.05 * 2**misses, 5.0), entry.rank)

    def _start(self, claim: Claim) -> None:
        execution = Execution(
            claim, store=self.store, registry=self.registry, worker_id=self.worker_id, executor=self._executor,
            observer=self.observer, writes=self.writes, heartbeat=self.heartbeat,
        )  # fmt: skip
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

    def _finished(self, run_id: str, task: asyncio.Task[None]) -> None:
        self.runs.pop(run_id, None)
        self._slots.release()
        self.observer.in_flight(len(self.runs))
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

    def info(self) -> WorkerInfo:
        running = sorted(execution.key for execution, _ in self.runs.values())
        return WorkerInfo(worker_id=self.worker_id, host=socket.gethostname(), pid=os.getpid(),
                          started_at=self.started_at, names=sorted(self.names), concurrency=self.concurrency,
                          running=running, version=__version__)  # fmt: skip

    async def _registry_loop(self) -> None:
        """Heartbeat into the registry and learn the live peers (for claim ranks)."""
        while not self._stop.is_set():
            try:
                if await self.store.beat(self.info(), ttl=5 * self.beat_interval):
                    self.log.warning("stop requested by an operator; shutting down")
                    self.stop()
                    return
                self.peers = [p for p in await self.store.workers() if p.worker_id != self.worker_id]
                self._beats.ok()
            except StoreError as exc:
                self._beats.failed(exc)
            await asyncio.sleep(self.beat_interval * random.uniform(0.9, 1.1))

    async def _shutdown(self) -> None:
        running = [task for _, task in self.runs.values()]
        if running:
            self.log.info("waiting for running tasks", count=len(running), grace=self.shutdown_timeout)
            _, pending = await asyncio.wait(running, timeout=self.shutdown_timeout)
            for task in pending:
                task.cancel()  # each run then releases its claim
            await asyncio.gather(*pending, return_exceptions=True)
