"""One change stream per dashboard process, fanned out to every open page.

Each browser's server-sent-event connection subscribes a bounded queue; a slow tab loses
its oldest events (it re-renders from the database anyway, so only freshness is lost).

The stream is a summary one (``Store.watch(summary=True)``): a page needs to know that
something changed and, for a task page, whether it was its task, so the server looks no
document up. An insert or replacement carries its key; an update or delete carries only
the document's ``_id``, which the hub maps back to the key it learned from the insert.
An ``_id`` it never saw (a task older than the hub) is sent with no key, which every task
page takes as possibly its own.

A stream the server ends is reopened at once and the pages told to read anew (they may
have missed changes meanwhile); one that cannot be followed (no change streams on the
server, or failing) makes the hub poll the newest ``updated_at`` once a second while it
retries the stream with capped backoff (``taskrunner.engine.follow``).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import suppress
from datetime import datetime
from typing import Any

from taskrunner.engine.follow import StreamEnds
from taskrunner.engine.outage import Outage
from taskrunner.errors import ChangeStreamEnded, StoreError, StoreUnavailable
from taskrunner.observability.logs import get_logger
from taskrunner.store import fields as f
from taskrunner.store.base import ChangeEvent, Listing, Store

log = get_logger("taskrunner.dashboard")
QUEUE_SIZE = 100
POLL_SECONDS = 1.0
KEYS_KEPT = 100_000  # _id -> key entries remembered; the oldest are forgotten first
MAX_STREAM_RETRY = 60.0  # seconds between attempts to reopen a stream that keeps failing


class Hub:
    """Reads the task collection's changes once and hands each to every subscriber."""

    def __init__(self, store: Store, *, queue_size: int = QUEUE_SIZE) -> None:
        self.store = store
        self.queue_size = queue_size
        self.subscribers: set[asyncio.Queue[str]] = set()
        self.changes = 0
        """How many changes the hub has seen (pages' cached reads compare it)."""
        self._newest: tuple[datetime, str] | None = None  # what polling saw last
        self._missed = False  # changes may have gone unseen since the last stream: pages read anew
        self._keys: dict[Any, str] = {}  # task keys by document _id, learned from inserts and replacements
        self._ends = StreamEnds(log, "dashboard")
        self._failing = Outage(
            log,
            "dashboard change stream failing; polling instead while retrying it",
            "dashboard change stream recovered",
            base=1.0,
            cap=MAX_STREAM_RETRY,
        )
        self._server = Outage(
            log, "dashboard lost the server; retrying", "dashboard reached the server again"
        )

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
        """Follow the change stream until cancelled; poll while there is none to follow."""
        while True:
            try:
                await self._follow()
            except ChangeStreamEnded as exc:
                self._missed = True
                if not self._ends.ended(exc):
                    await self._poll(self._failing.failed(exc))
            except StoreUnavailable as exc:
                self._missed = True
                await asyncio.sleep(self._server.failed(exc))
            except StoreError as exc:  # no change streams here, not allowed, getMores failing
                self._missed = True
                await self._poll(self._failing.failed(exc))

    async def _follow(self) -> None:
        stream = await self.store.watch(summary=True)
        try:
            self._server.ok()
            if self._missed:  # open first, then tell the pages: no change falls in between
                self._missed = False
                self.publish(REREAD)
            while True:
                event = await stream.next(POLL_SECONDS)
                self._failing.ok()
                self._ends.worked()
                if event is not None:
                    self.publish(event_message(event, self._key(event)))
        finally:
            with suppress(StoreError):
                await stream.close()

    def _key(self, event: ChangeEvent) -> str | None:
        """The event's task key: its own, or the one learned for its ``_id``."""
        if event.doc_id is None:
            return event.key
        if event.kind == "delete":
            return self._keys.pop(event.doc_id, event.key)
        if event.key is not None:
            self._keys.pop(event.doc_id, None)  # re-inserted last: forgotten last
            self._keys[event.doc_id] = event.key
            if len(self._keys) > KEYS_KEPT:
                del self._keys[next(iter(self._keys))]
            return event.key
        return self._keys.get(event.doc_id)

    async def _poll(self, seconds: float) -> None:
        """Say a change whenever the newest ``updated_at`` moves, for ``seconds``."""
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            try:
                newest = (await self.store.browse(Listing(sort=f.UPDATED_AT, limit=1))).tasks
            except StoreError:
                newest = []  # the stream's retry says whether the server is away
            now = (newest[0].updated_at, newest[0].key) if newest else None
            if now != self._newest:
                self._newest = now
                self.publish(json.dumps({"kind": "poll", "key": None}))
            await asyncio.sleep(POLL_SECONDS)


REREAD = json.dumps({"kind": "poll", "key": None})
"""Every page may have missed a change: read anew."""


def fresh_message(page: str) -> str:
    """The SSE data line saying ``page`` was read anew (its tabs fetch it again)."""
    return json.dumps({"kind": "fresh", "page": page})


def event_message(event: ChangeEvent, key: str | None = None) -> str:
    """The SSE data line of one change: its kind, task key (None: unknown) and the state it
    wrote (None: unchanged or unknown); JSON escapes anything."""
    state = event.task.state.value if event.task is not None else event.state
    return json.dumps({"kind": str(event.kind), "key": key if key is not None else event.key, "state": state})
