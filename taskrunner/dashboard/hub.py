"""One change stream per dashboard process, fanned out to every open page.

Each browser's server-sent-event connection subscribes a bounded queue; a slow tab loses
its oldest events (it re-renders from the database anyway, so only freshness is lost).
Without change streams the hub polls the newest ``updated_at`` once a second instead.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import suppress
from datetime import datetime

from taskrunner import fields as f
from taskrunner.errors import ChangeStreamsUnsupported, StoreError
from taskrunner.store.base import ChangeEvent, Listing, Store

QUEUE_SIZE = 100
POLL_SECONDS = 1.0


class Hub:
    """Reads the task collection's changes once and hands each to every subscriber."""

    def __init__(self, store: Store, *, queue_size: int = QUEUE_SIZE) -> None:
        self.store = store
        self.queue_size = queue_size
        self.subscribers: set[asyncio.Queue[str]] = set()
        self.changes = 0
        """How many changes the hub has seen (pages' cached reads compare it)."""

    def subscribe(self) -> asyncio.Queue[str]:
        queue: asyncio.Queue[str] = asyncio.Queue(self.queue_size)
        self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[str]) -> None:
        self.subscribers.discard(queue)

    def publish(self, message: str) -> None:
        """A change of the task collection, to every subscriber."""
        self.changes += 1
        self.announce(message)

    def announce(self, message: str) -> None:
        """A message to every subscriber that is not a change (a page read anew)."""
        for queue in self.subscribers:
            if queue.full():
                queue.get_nowait()  # drop the oldest: the page re-reads the database anyway
            queue.put_nowait(message)

    async def run(self) -> None:
        """Follow the change stream until cancelled; poll where there is none."""
        while True:
            try:
                await self._follow()
            except ChangeStreamsUnsupported:
                await self._poll()
            except StoreError:
                await asyncio.sleep(POLL_SECONDS)  # server away: reopen (pages show the gap)

    async def _follow(self) -> None:
        stream = await self.store.watch()
        try:
            while True:
                event = await stream.next(POLL_SECONDS)
                if event is not None:
                    self.publish(event_message(event))
        finally:
            with suppress(StoreError):
                await stream.close()

    async def _poll(self) -> None:
        seen: tuple[datetime, str] | None = None
        while True:
            newest = (await self.store.browse(Listing(sort=f.UPDATED_AT, limit=1))).tasks
            now = (newest[0].updated_at, newest[0].key) if newest else None
            if now != seen:
                seen = now
                self.publish(json.dumps({"kind": "poll", "key": None}))
            await asyncio.sleep(POLL_SECONDS)


def fresh_message(page: str) -> str:
    """The SSE data line saying ``page`` was read anew (its tabs fetch it again)."""
    return json.dumps({"kind": "fresh", "page": page})


def event_message(event: ChangeEvent) -> str:
    """The SSE data line of one change: its kind and task key (JSON escapes anything)."""
    state = event.task.state.value if event.task is not None else None
    return json.dumps({"kind": str(event.kind), "key": event.key, "state": state})
