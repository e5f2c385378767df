"""End the embedded server's open change streams the way MongoDB ends one after an
invalidate that the stream's ``$match`` hides: the next getMore answers ``ok: 1`` with an
empty batch and cursor id 0. Streams opened afterwards are unaffected.

The embedded server's test-only admin command ``{taskrunnerFault: "endStreams"}`` does
this where the server has it; else the bridge's own ``ChangeStreams.end``, reached in the
test process (the ``embedded_uri`` server runs there); on a bridge without either, its
``get_more`` is patched to answer the pending or next getMore of every cursor open at
``end()`` that way.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import OperationFailure

from taskrunner.dev import streams


class StreamEnder:
    """``await ender.end()`` ends the server's open change streams (``ns``: only those on it)."""

    def __init__(self, uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.uri = uri
        self._bridge: tuple[Any, asyncio.AbstractEventLoop] | None = None
        self._ending: set[int] = set()
        self._woken: asyncio.Event | None = None
        self._patch(monkeypatch)

    async def end(self, ns: str | None = None) -> int:
        """How many streams were ended."""
        try:
            return await self._by_command(ns)
        except OperationFailure:
            pass  # a server without the test-only command: end them in the bridge
        if self._bridge is None:
            return 0  # no stream was opened since the patch
        bridge, loop = self._bridge
        if hasattr(bridge, "end"):
            ended: int = bridge.end(ns)  # safe from any thread
            return ended

        async def mark() -> int:  # on the server's loop, where its cursors live
            ids = {i for i, cursor in bridge._cursors.items() if ns is None or cursor.ns == ns}
            self._ending |= ids
            self._wake().set()  # pending getMores of those cursors answer now
            self._woken = None
            return len(ids)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(mark(), loop))

    async def _by_command(self, ns: str | None) -> int:
        client: AsyncMongoClient[dict[str, Any]]
        async with AsyncMongoClient(self.uri) as client:
            reply = await client.admin.command(
                {"taskrunnerFault": "endStreams", **({"ns": ns} if ns else {})}
            )
        return int(reply["ended"])

    def _wake(self) -> asyncio.Event:
        """Set (and replaced) whenever streams are ended; created on the server's loop."""
        if self._woken is None:
            self._woken = asyncio.Event()
        return self._woken

    def _patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Learn the bridge from the streams it opens; where it cannot end streams itself,
        answer the pending or next getMore of each ended cursor as MongoDB does."""
        aggregate, get_more = streams.ChangeStreams.aggregate, streams.ChangeStreams.get_more

        async def watched_aggregate(bridge: Any, command: Any) -> dict[str, Any]:
            self._bridge = (bridge, asyncio.get_running_loop())
            reply: dict[str, Any] = await aggregate(bridge, command)
            return reply

        monkeypatch.setattr(streams.ChangeStreams, "aggregate", watched_aggregate)
        if hasattr(streams.ChangeStreams, "end"):
            return
        from mongoeco.core.bson_scalars import BsonInt64  # the bridge's cursor id type

        async def ending_get_more(bridge: Any, command: Any) -> dict[str, Any]:
            self._bridge = (bridge, asyncio.get_running_loop())
            cursor_id = command.body["getMore"]
            answer = asyncio.ensure_future(get_more(bridge, command))
            while cursor_id not in self._ending:
                woken = asyncio.ensure_future(self._wake().wait())
                done, _ = await asyncio.wait([answer, woken], return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                if answer in done:
                    reply: dict[str, Any] = answer.result()
                    return reply
            answer.cancel()  # the cursor is ended: its getMore's wait is cut short
            await asyncio.wait([answer])
            if not answer.cancelled():
                answer.exception()
            self._ending.discard(cursor_id)
            cursor = bridge._cursors.get(cursor_id)
            if cursor is None:  # killed meanwhile: the bridge says so
                again: dict[str, Any] = await get_more(bridge, command)
                return again
            bridge.kill([cursor_id])
            # No postBatchResumeToken: a stream that ended is not resumed, whatever its token.
            return {"cursor": {"nextBatch": [], "id": BsonInt64(0), "ns": cursor.ns}, "ok": 1.0}

        monkeypatch.setattr(streams.ChangeStreams, "get_more", ending_get_more)
