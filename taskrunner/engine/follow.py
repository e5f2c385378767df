"""Following a change stream: what every consumer does when the server ends one.

MongoDB ends a stream after an invalidate (its collection or database dropped or renamed):
the getMore answers with cursor id 0, even when the stream's ``$match`` hides the
invalidate event, and the store's ``next`` raises ``ChangeStreamEnded``. Every consumer
(the worker's task stream in ``discovery``, the limits watch, ``TaskRunner.wait``, the
dashboard's hub) then does the same: it opens a new stream *without* the old resume token
(MongoDB refuses to resume after an invalidate, error 260), reads again what it follows to
cover the gap, and logs ``change stream ended`` once, with the reason. A new stream that
ends again within ``MIN_LIFE`` of being opened, before one of its getMores came back, is a
stream that cannot be followed: the consumer polls instead, as on a server without change
streams, and retries the stream with capped backoff (``taskrunner.engine.outage.Outage``: one
warning when that starts). A reopened stream that lived longer was following: its getMore
waits seconds for events, and the server may end it meanwhile (another drop, a rename),
which is one more end, logged and reopened like the first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from taskrunner.errors import ChangeStreamEnded

if TYPE_CHECKING:
    from taskrunner.store.base import ChangeEvent, ChangeStream

ENDED = "change stream ended"
MIN_LIFE = 1.0
"""Seconds a reopened stream must live for its end to be an end rather than a failure:
reopening at most once a second is no spin, and a server's end comes at any time."""


class StreamEnds:
    """One consumer's stream ends: ``ended`` logs one line per end and says whether to reopen
    at once; ``worked`` records that the stream answered (a getMore came back)."""

    def __init__(
        self, log: Any, stream: str, *, clock: Callable[[], float] = time.monotonic, **fields: Any
    ) -> None:
        self.log, self.fields, self._clock = log, {"stream": stream, **fields}, clock
        self._answered = True  # the first stream counts as having answered: its end is an end
        self._reopened: float | None = None  # when ``ended`` last said to reopen at once

    def worked(self) -> None:
        self._answered = True

    def ended(self, exc: ChangeStreamEnded) -> bool:
        """True: logged, reopen now. False: the stream reopened after the last end ended
        before answering once and within ``MIN_LIFE``, or was retried after such a failure
        and has not answered; treat it as failing (poll, retry with backoff) unlogged here."""
        now = self._clock()
        lived = self._reopened is not None and now - self._reopened >= MIN_LIFE
        if not (self._answered or lived):
            self._reopened = None  # a retry after polling is judged by its answers alone
            return False
        self._answered, self._reopened = False, now
        self.log.warning(ENDED, reason=exc.reason, **self.fields)
        return True


class Reading:
    """One ``stream.next(wait)`` in flight, awaited across several shorter waits.

    A MongoDB stream's ``next`` returns only when its getMore does (the server's await,
    seconds), whatever deadline it was given; cancelling it is no way to stop early, since
    PyMongo closes the connection of a cancelled getMore and the stream with it. So a
    consumer that must act at a moment of its own (a throttle's end) waits on the read
    with a timeout and leaves it running, and the next wait picks the same read up: no
    getMore is cancelled and none is added."""

    def __init__(self, stream: ChangeStream, wait: float) -> None:
        self.stream, self.wait = stream, wait
        self._read: asyncio.Task[ChangeEvent | None] | None = None

    async def until(self, seconds: float) -> tuple[bool, ChangeEvent | None]:
        """``(True, event or None)`` when the read finished within ``seconds`` (its errors
        raised here), else ``(False, None)`` with the read still under way."""
        if self._read is None:
            self._read = asyncio.ensure_future(self.stream.next(self.wait))
        done, _ = await asyncio.wait([self._read], timeout=max(0.0, seconds))
        if not done:
            return False, None
        read, self._read = self._read, None
        return True, read.result()

    async def close(self) -> None:
        """Stop the read (only when the stream is given up: this closes its connection)."""
        if self._read is None:
            return
        read, self._read = self._read, None
        read.cancel()
        await asyncio.wait([read])
        if not read.cancelled():
            read.exception()  # retrieved: how a read given up ended says nothing more
