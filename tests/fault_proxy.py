"""A fault-injecting TCP proxy in front of the embedded server, for worker *processes*.

The proxy runs its own asyncio loop in a daemon thread and listens on 127.0.0.1, so
worker processes connect to ``proxy.uri`` while the test talks to the server directly::

    with FaultProxy(embedded_uri) as proxy:
        pool = WorkerPool(proxy.uri, ...)
        proxy.blackhole()     # accept, forward nothing; open connections stall (a partition)
        proxy.drop()          # close every connection and refuse new ones (server down)
        proxy.latency(0.2)    # delay every forwarded chunk, both directions (slow network)
        proxy.swap(a, b)      # replies carry b where the server sent a, requests a for b
        proxy.heal()          # back to plain forwarding; stalled bytes flow again

``swap`` shows the client bytes the server cannot hold (a date out of Python's range, a
string that is not UTF-8, as other languages' drivers may write): ``a`` and ``b`` have
one length, so every message keeps its size. Messages are forwarded whole (by their
length prefix), so a swap never straddles two reads.

Modes are set from the test's thread and take effect before the call returns.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from types import TracebackType
from urllib.parse import urlsplit


class FaultProxy:
    def __init__(self, upstream_uri: str) -> None:
        parts = urlsplit(upstream_uri)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 27017)
        self.port = 0
        self.delay = 0.0
        self.dropped = False
        self.connections = 0  # accepted so far (refused ones included)
        self.swapped: tuple[bytes, bytes] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def uri(self) -> str:
        return f"mongodb://127.0.0.1:{self.port}/?directConnection=true"

    # -- control (from any thread) ---------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def close(self) -> None:
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def blackhole(self) -> None:
        """Accept connections but forward nothing; bytes in flight stay unread until ``heal``."""
        self._call(self._set(flowing=False))

    def drop(self) -> None:
        """Close every open connection; new ones are closed as soon as they are accepted."""
        self._call(self._set(dropped=True))

    def latency(self, seconds: float) -> None:
        """Delay every forwarded chunk by ``seconds`` (each direction, so a round trip pays twice)."""
        self._call(self._set(delay=seconds))

    def swap(self, server_bytes: bytes, client_bytes: bytes) -> None:
        """Replies carry ``client_bytes`` wherever the server sent ``server_bytes``, and
        requests ``server_bytes`` wherever the client sent ``client_bytes`` (one length)."""
        assert len(server_bytes) == len(client_bytes), "a swap must keep every message's size"
        self.swapped = (server_bytes, client_bytes)

    def heal(self) -> None:
        self._call(self._set(flowing=True, dropped=False, delay=0.0))

    def _call(self, coroutine: object) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)  # type: ignore[arg-type]

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- the loop's side -------------------------------------------------------------------------
    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._close_all()

    async def _set(
        self, *, flowing: bool | None = None, dropped: bool | None = None, delay: float | None = None
    ) -> None:
        assert self._flowing is not None
        if delay is not None:
            self.delay = delay
        if dropped is not None:
            self.dropped = dropped
            if dropped:
                self._close_all()
        if flowing is True:
            self._flowing.set()
        elif flowing is False:
            self._flowing.clear()

    def _close_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        assert self._flowing is not None
        if self.dropped:
            writer.transport.abort()
            return
        self._writers.add(writer)
        try:
            await self._flowing.wait()
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            self._writers.discard(writer)
            writer.transport.abort()
            return
        if self.dropped or writer.transport.is_closing():
            self._writers.discard(writer)
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._writers.add(up_writer)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, replies=False)),
            asyncio.create_task(self._pump(up_reader, writer, replies=True)),
        ]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.transport.abort()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, replies: bool
    ) -> None:
        assert self._flowing is not None
        try:
            while True:
                await self._flowing.wait()  # a blackhole stops reading: the sender's bytes stall
                data = await self._message(reader, replies)
                if not data:
                    return
                if self.delay:
                    await asyncio.sleep(self.delay)
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return

    async def _message(self, reader: asyncio.StreamReader, replies: bool) -> bytes:
        """One whole wire message (its int32 length first), swapped; b"" at the end."""
        try:
            head = await reader.readexactly(4)
            data = head + await reader.readexactly(struct.unpack("<i", head)[0] - 4)
        except asyncio.IncompleteReadError:
            return b""
        if self.swapped is None:
            return data
        server_bytes, client_bytes = self.swapped
        return (
            data.replace(server_bytes, client_bytes) if replies else data.replace(client_bytes, server_bytes)
        )
