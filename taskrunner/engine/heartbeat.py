"""One lease renewal write per worker per interval, covering every run it holds.

Leases stay per run: each entry has its own ``expires_at``, computed by the server
from the task's ``ping_timeout``. Only the write is shared: at each tick every
run's renewal goes out in one bulk write (``Store.write_runs``), so the cost does
not grow with the number of runs in flight. A renewal that lands fewer runs than
it carried tells exactly which claims were lost, canceled or no longer allowed,
and only those runs are stopped. A run whose lease could not be confirmed for its
``ping_timeout`` (server unreachable, connection stalled) is stopped too: another
worker may own it by now (self-fencing).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from taskrunner.engine.outage import Outage
from taskrunner.engine.writes import RunWrites
from taskrunner.errors import TaskRunnerError
from taskrunner.observability.logs import get_logger
from taskrunner.store.base import RunStatus, RunWrite


@dataclass(eq=False)
class RunLease:
    """What the heartbeat knows of one run: its key, token, timing and how to stop it."""

    key: str
    run_id: str
    ping_interval: float
    ping_timeout: float
    end: Callable[[RunStatus | None], None]
    """Stops the run: with the refusal's status, or None when unconfirmed for ping_timeout."""
    take_progress: Callable[[], Any] = lambda: None
    give_back: Callable[[Any], None] = lambda progress: None
    confirmed: float = 0.0
    """Monotonic time the last renewal known to have landed was sent (or the run began)."""

    def __post_init__(self) -> None:
        self.confirmed = self.confirmed or time.monotonic()

    @property
    def fence_at(self) -> float:
        return self.confirmed + self.ping_timeout


class Heartbeat:
    """Renews the leases of every run added, until each is removed or stopped."""

    def __init__(self, writes: RunWrites, worker_id: str) -> None:
        self.writes, self.worker_id = writes, worker_id
        self.log = get_logger("taskrunner.heartbeat").bind(worker_id=worker_id)
        self._leases: dict[str, RunLease] = {}
        self._next = 0.0
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._outage = Outage(self.log, "ping failed; retrying", "ping recovered")

    def add(self, lease: RunLease) -> None:
        first = not self._leases
        self._leases[lease.run_id] = lease
        tick = time.monotonic() + lease.ping_interval
        if first or tick < self._next:
            self._next = tick
            self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="heartbeat")

    def remove(self, run_id: str) -> None:
        self._leases.pop(run_id, None)

    def __len__(self) -> int:
        return len(self._leases)

    async def _run(self) -> None:
        # Ends when no run is left; ``add`` starts it again.
        while self._leases:
            try:
                await self._sleep()
                self._fence()
                if self._leases and time.monotonic() >= self._next:
                    await self._beat()
            except Exception:  # a bug here must not leave every lease to lapse
                self.log.exception("heartbeat crashed; continuing")
                await asyncio.sleep(0.1)

    async def _sleep(self) -> None:
        wake = min(self._next, *(lease.fence_at for lease in self._leases.values()))
        self._changed.clear()
        with suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), max(0.0, wake - time.monotonic()))

    def _fence(self) -> None:
        now = time.monotonic()
        for lease in [lease for lease in self._leases.values() if now >= lease.fence_at]:
            self.remove(lease.run_id)
            lease.end(None)

    async def _beat(self) -> None:
        leases = list(self._leases.values())
        progress = [lease.take_progress() for lease in leases]
        me = self.worker_id
        writes = [
            RunWrite("ping", lease.key, lease.run_id, me, p)
            for lease, p in zip(leases, progress, strict=True)
        ]
        interval = min(lease.ping_interval for lease in leases)
        sent = time.monotonic()
        try:
            # A renewal never outlives the earliest lease: over a stalled connection the
            # wait must end so that lease's run can fence itself.
            async with asyncio.timeout(min(lease.fence_at for lease in leases) - sent):
                results = await self.writes.submit_many(writes)
        except (TaskRunnerError, TimeoutError) as exc:
            for lease, p in zip(leases, progress, strict=True):
                if p is not None:
                    lease.give_back(p)
            self._outage.failed(exc)  # logged once per outage; retried often so a blip keeps the leases
            self._next = time.monotonic() + min(interval / 2, 1.0)
            return
        self._outage.ok()
        self._next = sent + interval
        for lease, p, result in zip(leases, progress, results, strict=True):
            if self._leases.get(lease.run_id) is not lease:
                continue  # the run ended while the renewal was on the wire
            if result is RunStatus.DONE:
                lease.confirmed = sent
            elif result is RunStatus.UNCONFIRMED:
                lease.give_back(p)
                self._next = min(self._next, time.monotonic() + min(interval / 2, 1.0))
            elif isinstance(result, RunStatus):
                self.remove(lease.run_id)
                lease.end(result)
            else:  # this renewal alone was refused (e.g. by a validator): the next one carries no progress
                self.log.warning("ping refused", key=lease.key, run_id=lease.run_id, error=str(result))
