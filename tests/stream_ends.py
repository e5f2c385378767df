"""End the embedded server's open change streams the way MongoDB ends one after an
invalidate that the stream's ``$match`` hides: the next getMore answers ``ok: 1`` with an
empty batch and cursor id 0. Streams opened afterwards are unaffected.

The embedded server's test-only admin command ``{taskrunnerFault: "endStreams"}`` does
this where the server has it (``ChangeStreams.end``); on a server without it the bridge's
``ChangeStreams`` is patched in the test process (the ``embedded_uri`` server runs there),
answering the next getMore of every cursor open at ``end()`` that way.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from taskrunner.dev import streams


class StreamEnder:
    """``await ender.end()`` ends the server's open change streams (``ns``: only those on it)."""

    def __init__(self, uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.uri = uri
        self.by_command = hasattr(streams.ChangeStreams, "end")
        self._bridge: tuple[Any, asyncio.AbstractEventLoop] | None = None
        self._ending: set[int] = set()
        if not self.by_command:
            self._patch(monkeypatch)

    async def end(self, ns: str | None = None) -> int:
        """How many streams were ended."""
        if self.by_command:
            client: AsyncMongoClient[dict[str, Any]]
            async with AsyncMongoClient(self.uri) as client:
                reply = await client.admin.command(
                    {"taskrunnerFault": "endStreams", **({"ns": ns} if ns else {})}
                )
            return int(reply["ended"])
        if self._bridge is None:
            return 0  # no stream was opened since the patch
        bridge, loop = self._bridge

        async def mark() -> int:  # on the server's loop, where its cursors live
            ids = {i for i, cursor in bridge._cursors.items() if ns is None or cursor.ns == ns}
            self._ending |= ids
            return len(ids)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(mark(), loop))

    def _patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from mongoeco.core.bson_scalars import BsonInt64  # the bridge's cursor id type

        aggregate, get_more = streams.ChangeStreams.aggregate, streams.ChangeStreams.get_more

        async def watched_aggregate(bridge: Any, command: Any) -> dict[str, Any]:
            self._bridge = (bridge, asyncio.get_running_loop())
            reply: dict[str, Any] = await aggregate(bridge, command)
            return reply

        async def ending_get_more(bridge: Any, command: Any) -> dict[str, Any]:
            self._bridge = (bridge, asyncio.get_running_loop())
            cursor_id = command.body["getMore"]
            cursor = bridge._cursors.get(cursor_id)
            if cursor is None or cursor_id not in self._ending:
                reply: dict[str, Any] = await get_more(bridge, command)
                return reply
            self._ending.discard(cursor_id)
            token = streams._post_batch_token(cursor.stream)
            bridge.kill([cursor_id])
            batch = {
                "nextBatch": [],
                "id": BsonInt64(0),
                "ns": cursor.ns,
                "postBatchResumeToken": token,
            }
            return {"cursor": batch, "ok": 1.0}

        monkeypatch.setattr(streams.ChangeStreams, "aggregate", watched_aggregate)
        monkeypatch.setattr(streams.ChangeStreams, "get_more", ending_get_more)
