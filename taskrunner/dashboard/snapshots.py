"""Each page's data, read once for every tab and re-read in the background.

A page's counts are a scan of the task collection: milliseconds on MongoDB with a few
thousand tasks, seconds on the embedded server with ten thousand. So a request renders
the page's latest *snapshot* at once and never waits on such a read, except when there
is none yet (first visit, after an action, or older than ``STALE_LIMIT``), and then only
for ``within`` seconds: past that the page renders as "being read" and fills in when the
read lands. When the task
collection changed since a snapshot was read, the request also starts one re-read in the
background, at most one per page at a time and spaced by the longer of ``fresh_for`` and
the last read's duration, so open tabs cost the server at most one read per second per
page type and never more than half its time. Without changes a page is re-read once it is
``max_age`` old, or ``AGE_FACTOR`` times its read's duration (the registry and the limits
change without a task changing; a slow read is not repeated for them more than a tenth of
the time). When the re-read lands, ``on_fresh(page)`` tells the open tabs (a ``fresh``
server-sent event), which fetch the page again. A read whose figures go out of date at a
known time without any write (a throttle ending) says when in ``EXPIRES_IN``; the page is
read again then, and the tabs told.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from taskrunner.observability.logs import get_logger

FRESH_SECONDS = 1.0
MAX_AGE = 5.0
AGE_FACTOR = 10.0
STALE_LIMIT = 60.0  # older than this (nobody kept it fresh), a snapshot is read again first
SIZE = 64  # snapshots kept (one per page and task-list filter), least recently used dropped
EXPIRES_IN = "expires_in"
"""A read's key: seconds after the read began past which its figures no longer hold (None: no such time)."""
EXPIRY_MARGIN = 0.05  # read a little after the end: the server must see it over

Read = Callable[[], Awaitable[dict[str, Any]]]
log = get_logger("taskrunner.dashboard")


@dataclass(frozen=True)
class Snapshot:
    data: dict[str, Any]
    seen: int
    """The change count when the read began: any later change makes it stale."""
    started: float
    took: float
    as_of: datetime
    """When the read began (the dashboard's clock; shown, never compared with the server's)."""


class Snapshots:
    """Pages' data by page key (``"overview"``, ``"tasks?state=FAIL"``...)."""

    def __init__(
        self,
        changes: Callable[[], int],
        on_fresh: Callable[[str], None] = lambda page: None,
        *,
        fresh_for: float = FRESH_SECONDS,
        max_age: float = MAX_AGE,
    ) -> None:
        self.changes, self.on_fresh = changes, on_fresh
        self.fresh_for, self.max_age = fresh_for, max_age
        self.recent: OrderedDict[str, Snapshot] = OrderedDict()
        self.reading: dict[str, asyncio.Task[Snapshot]] = {}
        self.expiring: dict[str, asyncio.TimerHandle] = {}

    async def get(self, page: str, read: Read, *, within: float | None = None) -> dict[str, Any] | None:
        """The page's data with ``as_of`` (when it was read) and ``refreshing``; or None when
        it must be read first and that takes longer than ``within`` seconds (the read goes
        on, and ``on_fresh`` follows)."""
        snapshot = self.recent.get(page)
        if snapshot is None or time.monotonic() - snapshot.started >= STALE_LIMIT:
            try:
                snapshot = await asyncio.wait_for(asyncio.shield(self._start(page, read, 0.0)), within)
            except TimeoutError:
                return None
        elif self._stale(snapshot):
            self._refresh(page, read, snapshot)
        self.recent.move_to_end(page)
        return snapshot.data | {"as_of": snapshot.as_of, "refreshing": page in self.reading}

    async def warm(self, reads: Mapping[str, Read], *, within: float) -> None:
        """Read the pages not read yet, waiting ``within`` seconds at most (the reads go on)."""
        started = [self._start(page, read, 0.0) for page, read in reads.items() if page not in self.recent]
        if started:
            await asyncio.wait(started, timeout=within)

    def drop(self, page: str) -> None:
        """Drop the page's snapshot: its next request reads it first."""
        self.recent.pop(page, None)

    def forget(self) -> None:
        """Drop every snapshot (after an action: the next page shows its effect)."""
        self.recent.clear()

    async def close(self) -> None:
        for timer in self.expiring.values():
            timer.cancel()
        for task in list(self.reading.values()):
            task.cancel()
            with suppress(BaseException):
                await task

    def _stale(self, snapshot: Snapshot) -> bool:
        age = time.monotonic() - snapshot.started
        expires = snapshot.data.get(EXPIRES_IN)
        if isinstance(expires, int | float) and age >= expires:
            return True
        return snapshot.seen != self.changes() or age >= max(self.max_age, AGE_FACTOR * snapshot.took)

    def _expire(self, page: str, read: Read, snapshot: Snapshot) -> None:
        """Read the page again once its figures go out of date (``EXPIRES_IN``)."""
        old = self.expiring.pop(page, None)
        if old is not None:
            old.cancel()
        expires = snapshot.data.get(EXPIRES_IN)
        if isinstance(expires, int | float):
            delay = max(0.0, snapshot.started + expires + EXPIRY_MARGIN - time.monotonic())
            self.expiring[page] = asyncio.get_running_loop().call_later(
                delay, lambda: self._start(page, read, 0.0)
            )

    def _refresh(self, page: str, read: Read, snapshot: Snapshot) -> None:
        gap = max(self.fresh_for, snapshot.took)
        self._start(page, read, max(0.0, snapshot.started + gap - time.monotonic()))

    def _start(self, page: str, read: Read, delay: float) -> asyncio.Task[Snapshot]:
        """The page's read in progress, or a new one (one at a time per page)."""
        task = self.reading.get(page)
        if task is None:
            task = asyncio.create_task(self._read(page, read, delay), name=f"dashboard read {page}")
            task.add_done_callback(lambda done: self._landed(page, done))
            self.reading[page] = task
        return task

    async def _read(self, page: str, read: Read, delay: float) -> Snapshot:
        try:
            await asyncio.sleep(delay)
            seen, started, as_of = self.changes(), time.monotonic(), datetime.now(UTC)
            data = await read()
            snapshot = Snapshot(data, seen, started, time.monotonic() - started, as_of)
            self.recent[page] = snapshot
            self._expire(page, read, snapshot)
            self.recent.move_to_end(page)
            while len(self.recent) > SIZE:
                self.recent.popitem(last=False)
            return snapshot
        finally:
            self.reading.pop(page, None)

    def _landed(self, page: str, task: asyncio.Task[Snapshot]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:  # the old snapshot stays; the next request tries again
            log.warning("dashboard read failed", page=page, error=str(error))
            return
        self.on_fresh(page)
