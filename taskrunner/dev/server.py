"""Embedded MongoDB-compatible server: mongoeco's wire proxy plus a bridge for what it lacks.

mongoeco (pinned ``==4.11.0``) ships an in-process MongoDB engine and
``AsyncMongoEcoProxyServer``, which speaks the real wire protocol so PyMongo, the
Node driver and ``mongosh`` can connect.  Out of the box it falls short of what
taskrunner needs, so :class:`_BridgeExecutor` is installed in place of the
proxy's command executor and fixes what taskrunner depends on:

* Change streams (``taskrunner.dev.streams``): served from the bridge's own oplog
  (``taskrunner.dev.oplog``), fed by mongoeco's change hub, as MongoDB serves them: event
  shapes, drops, renames and invalidates, resume tokens and errors, update descriptions.
* Cluster time.  Every reply carries ``operationTime`` and ``$clusterTime`` from the oplog's
  clock, as a replica-set member's do (drivers use them for causal consistency).
* Renames.  MongoDB runs ``renameCollection`` on admin; mongoeco renames only within the
  database it runs in, so the bridge runs it there.
* Type bracketing (``taskrunner.dev.bracketing``): query-language range comparisons match
  only values of the bound's BSON type, as MongoDB's do.
* ``collMod``.  mongoeco has no ``collMod``; the bridge applies its validator
  settings (``validator``, ``validationLevel``, ``validationAction``) to the
  engine's stored collection options, so ``taskrunner init --validator`` works
  on an existing collection as it does on MongoDB.
* Cursor id width.  mongoeco replies with 32-bit cursor ids, which the Node
  driver and ``mongosh`` reject, and it chokes on the 64-bit ids that clients
  then send back.  Replies get Int64 ids and requests get plain ints.
* A replica-set primary (``taskrunner.dev.replset``): ``hello`` names a one-member
  replica set, so drivers send retryable writes' ``txnNumber``; a test can step it down.
* Retryable writes (``taskrunner.dev.retryable``): a write runs once per ``lsid`` +
  ``txnNumber``; a retry gets the first reply.
* Transactions (``taskrunner.dev.transactions``): mongoeco's snapshots, run as a replica-set
  primary runs transactions: per-document write conflicts (112, TransientTransactionError),
  commits beside other writes, events at commit with ``lsid``/``txnNumber``, writes outside
  waiting for the transaction holding their document, ``transactionLifetimeLimitSeconds``
  (``setParameter``), MongoDB's codes for what a transaction refuses.
* The engine (``taskrunner.dev.engine``): the 16 MiB document limit, and inserts that do
  not read every stored document.
* Test faults (``taskrunner.dev.faults``): the ``taskrunnerFault`` admin command, and
  mongoeco's ``failCommand`` fail point on what the bridge answers itself.

Every change to mongoeco's own objects is made in ``taskrunner.dev.patches``, pinned to
the mongoeco release it was written for; the server refuses to start on another, and
``tests/contract/test_embedded.py`` fails loudly when an upgrade moves what it reaches.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from taskrunner.dev import patches
from taskrunner.dev.engine import current_command
from taskrunner.dev.faults import (
    FAIL_POINT_COMMANDS,
    FAULT_COMMAND,
    DropConnection,
    Faults,
    apply_fail_point,
)
from taskrunner.dev.replset import ReplicaSet, interrupted, is_hello
from taskrunner.dev.retryable import RetryableWrites, retryable_write
from taskrunner.dev.streams import ChangeStreams, command_database, is_change_stream
from taskrunner.dev.transactions import LIFETIME_PARAMETER, Transactions
from taskrunner.dev.wire import MONGOECO_AVAILABLE, BridgedCommand, failure, plain_int

if MONGOECO_AVAILABLE:
    from mongoeco.api import AsyncMongoClient as _EcoClient
    from mongoeco.core.bson_scalars import BsonInt64
    from mongoeco.errors import ConnectionFailure as EcoConnectionFailure
    from mongoeco.errors import OperationFailure
    from mongoeco.wire import AsyncMongoEcoProxyServer
    from mongoeco.wire._session_identity import wire_session_key

__all__ = ["EmbeddedServer", "ServerThread", "serve"]

_MISSING_EXTRA = (
    "the embedded server needs the 'embedded' extra: pip install 'taskrunner[embedded]' (Python >= 3.13)"
)


def _require_mongoeco() -> None:
    if not MONGOECO_AVAILABLE:
        raise RuntimeError(_MISSING_EXTRA)
    if (mismatch := patches.mongoeco_mismatch()) is not None:
        raise RuntimeError(mismatch)


def _with_int64_cursor_id(reply: dict[str, Any]) -> dict[str, Any]:
    cursor = reply.get("cursor")
    if isinstance(cursor, dict) and type(cursor.get("id")) is int:
        cursor["id"] = BsonInt64(cursor["id"])
    return reply


def _unwrap_cursor_ids(command: str, body: dict[str, Any]) -> None:
    """Turn the Int64 ids clients echo back into ints, which mongoeco's handlers require."""
    if command == "getMore":
        body["getMore"] = plain_int(body["getMore"])
    elif command == "killCursors" and isinstance(body.get("cursors"), list):
        body["cursors"] = [plain_int(cursor_id) for cursor_id in body["cursors"]]


_VALIDATION_OPTIONS = ("validator", "validationLevel", "validationAction")
_GENERIC_FIELDS = {"collMod", "lsid", "comment", "txnNumber", "writeConcern"}


def _is_validation_coll_mod(body: dict[str, Any]) -> bool:
    """A collMod that only changes validation settings, which the bridge can apply."""
    fields = {k for k in body if not k.startswith("$")} - _GENERIC_FIELDS
    return bool(fields) and fields <= set(_VALIDATION_OPTIONS) and isinstance(body["collMod"], str)


async def _coll_mod(client: Any, command: BridgedCommand) -> dict[str, Any]:
    engine, name = client._engine, command.body["collMod"]
    async with engine._get_lock(command.db, name):
        options = engine._collection_options.get(command.db, {}).get(name)
        if options is None:
            raise failure(f"ns does not exist: {command.db}.{name}", 26, "NamespaceNotFound")
        options.update({k: copy.deepcopy(command.body[k]) for k in _VALIDATION_OPTIONS if k in command.body})
    return {"ok": 1.0}


class _BridgeExecutor:
    """Stands in for the proxy's WireCommandExecutor, diverting what mongoeco cannot serve."""

    def __init__(self, inner: Any, streams: ChangeStreams, replica_set: ReplicaSet) -> None:
        self._inner = inner
        self._streams = streams
        self._engine = streams.client._engine
        self._replica_set = replica_set
        self._faults = Faults(replica_set, streams.end)
        self._retryable = RetryableWrites()
        self.transactions = Transactions(streams.client, patches.session_store(inner), streams.oplog)

    def error_document(self, error: Exception) -> dict[str, Any]:
        document: dict[str, Any] = self._inner.error_document(error)
        return self._streams.stamp(document)

    def _build_request_context(
        self,
        body: dict[str, Any],
        *,
        connection: Any,
        db_name: str | None = None,
        on_normalized: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> Any:
        command = next(iter(body), "")
        _unwrap_cursor_ids(command, body)
        db_name = command_database(command, body, db_name)
        bridged = self._divert(command, body, db_name or body.get("$db"))
        if bridged is None:
            self.transactions.before_build(body)
            try:
                return self._inner._build_request_context(
                    body, connection=connection, db_name=db_name, on_normalized=on_normalized
                )
            except BaseException:
                self.transactions.settled(body)
                raise
        if on_normalized is not None:  # keeps the proxy's diagnostics naming the command
            on_normalized(command, body)
        return bridged

    def _divert(self, command: str, body: dict[str, Any], db: object) -> BridgedCommand | None:
        if not isinstance(db, str):
            return None  # let mongoeco produce its own error
        if command == FAULT_COMMAND:
            return BridgedCommand(command, db, body)
        if command == "aggregate" and is_change_stream(body):
            return BridgedCommand(command, db, body)
        if command == "collMod" and _is_validation_coll_mod(body):
            return BridgedCommand(command, db, body)
        if command in ("setParameter", "getParameter") and LIFETIME_PARAMETER in body:
            return BridgedCommand(command, db, body)
        if command == "getMore" and self._streams.owns(body["getMore"]):
            return BridgedCommand(command, db, body)
        if command == "killCursors" and isinstance(body.get("cursors"), list):
            return self._split_kill(body, db)
        return None

    def _split_kill(self, body: dict[str, Any], db: str) -> BridgedCommand | None:
        ours = [cursor_id for cursor_id in body["cursors"] if self._streams.owns(cursor_id)]
        if not ours:
            return None
        rest = [cursor_id for cursor_id in body["cursors"] if cursor_id not in ours]
        if rest:  # mixed lists never come from drivers; mongoeco kills the rest
            self._streams.kill(ours)
            body["cursors"] = rest
            return None
        return BridgedCommand("killCursors", db, body)

    async def execute_prepared(self, context: Any) -> dict[str, Any]:
        try:
            return await self._answer(context)
        finally:
            if not isinstance(context, BridgedCommand):
                self.transactions.settled(context.raw_body)

    async def _answer(self, context: Any) -> dict[str, Any]:
        bridged = isinstance(context, BridgedCommand)
        name, db, body = (
            (context.name, context.db, context.body)
            if bridged
            else (context.command_name, context.db_name, context.raw_body)
        )
        if name == FAULT_COMMAND:
            return self._streams.stamp(self._faults.command(db, body))
        refusal = self._replica_set.refusal(name, body, change_stream=bridged)
        if refusal is not None:
            raise refusal
        if bridged or name in FAIL_POINT_COMMANDS:
            await apply_fail_point(self._engine, name, _namespace(name, db, body))
        command = current_command.set(name)
        try:
            reply = await self._execute(context, name, body)
        except Exception:
            if self._faults.loses_reply(name):
                raise DropConnection from None
            raise
        finally:
            current_command.reset(command)
        if self._faults.loses_reply(name):
            raise DropConnection
        return self._streams.stamp(reply)

    async def _execute(self, context: Any, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if isinstance(context, BridgedCommand):
            return await self._bridged(context)
        if is_hello(name):
            return self._replica_set.hello(await self._mongoeco(context))
        return await self.transactions.execute(
            name, context.db_name, body, lambda: self._statement(context, name, body)
        )

    async def _statement(self, context: Any, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run a command in mongoeco, once per lsid + txnNumber when it is a retryable write."""
        session = wire_session_key(body["lsid"]) if "lsid" in body else None
        write = retryable_write(name, body, session)
        if write is None:
            return await self._mongoeco(context)

        async def run(statements: dict[str, Any]) -> dict[str, Any]:
            if statements is not body:  # the statements a first attempt did not run
                build = self._inner._build_request_context
                return await self._mongoeco(
                    build(statements, connection=context.connection, db_name=context.db_name)
                )
            return await self._mongoeco(context)

        return await self._retryable.execute(write, run)

    async def _mongoeco(self, context: Any) -> dict[str, Any]:
        name, db, body = context.command_name, context.db_name, context.command_document
        try:
            reply = await self._streams.apply(name, db, body, lambda: self._inner.execute_prepared(context))
        except EcoConnectionFailure as error:  # mongoeco's failCommand with closeConnection
            raise DropConnection from error
        return _with_int64_cursor_id(reply)

    async def _bridged(self, context: BridgedCommand) -> dict[str, Any]:
        if context.name == "aggregate":
            return await self._streams.aggregate(context)
        if context.name == "getMore":
            return await self._get_more(context)
        if context.name == "collMod":
            return await _coll_mod(self._streams.client, context)
        if context.name in ("setParameter", "getParameter"):
            return await self.transactions.execute(context.name, context.db, context.body, _never)
        killed, unknown = self._streams.kill(context.body["cursors"])
        return {
            "cursorsKilled": killed,
            "cursorsNotFound": unknown,
            "cursorsAlive": [],
            "cursorsUnknown": [],
            "ok": 1.0,
        }

    async def _get_more(self, context: BridgedCommand) -> dict[str, Any]:
        error = interrupted("getMore", change_stream=True)
        try:
            return await self._replica_set.interruptible(self._streams.get_more(context), error)
        except OperationFailure as raised:
            if raised is error:  # MongoDB kills a cursor whose getMore was interrupted
                self._streams.kill([context.body["getMore"]])
            raise


async def _never() -> dict[str, Any]:
    raise AssertionError("the bridge answers this command itself")


def _namespace(command: str, db: str, body: dict[str, Any]) -> str | None:
    """The namespace a fail point's ``namespace`` filter compares (a getMore's collection)."""
    target = body.get(command)
    if not isinstance(target, str):
        target = body.get("collection")
    return f"{db}.{target}" if isinstance(target, str) else None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname may resolve to anything


def _warn_if_exposed(host: str) -> None:
    if not _is_loopback(host):
        print(
            f"WARNING: the embedded MongoDB server listens on {host!r} WITHOUT "
            "authentication; anyone who can reach it over the network can read and "
            "change all data.",
            file=sys.stderr,
            flush=True,
        )


def _format_uri(host: str, port: int) -> str:
    if ":" in host:
        host = f"[{host}]"
    return f"mongodb://{host}:{port}/?directConnection=true"


class EmbeddedServer:
    """A mongoeco wire server on host:port with taskrunner's bridge installed; no auth."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, history_size: int = 10_000) -> None:
        _require_mongoeco()
        self._host = host
        self._port = port
        self._history_size = history_size
        self._client: Any = None
        self._proxy: Any = None
        self._streams: ChangeStreams | None = None
        self._uri: str | None = None

    @property
    def uri(self) -> str:
        if self._uri is None:
            raise RuntimeError("the embedded server is not running")
        return self._uri

    @property
    def streams(self) -> ChangeStreams:
        """The running server's change streams (``streams.end(ns)`` ends them, for tests)."""
        if self._streams is None:
            raise RuntimeError("the embedded server is not running")
        return self._streams

    async def start(self) -> str:
        if self._uri is not None:
            return self._uri
        _warn_if_exposed(self._host)
        self._client = _EcoClient(change_stream_history_size=self._history_size)
        await self._client.__aenter__()  # connects the engine the proxy will share
        try:
            self._uri = await self._start_proxy()
        except BaseException:
            await self.stop()
            raise
        return self._uri

    async def _start_proxy(self) -> str:
        proxy = AsyncMongoEcoProxyServer(client=self._client, host=self._host, port=self._port)
        self._proxy = proxy
        patches.patch_query_language()
        self._streams = ChangeStreams(self._client, self._history_size)
        patches.patch_engine(self._client._engine)
        replica_set = ReplicaSet(fallback_address=f"{self._host}:{self._port}")
        streams = self._streams
        patches.patch_proxy(proxy, lambda inner: _BridgeExecutor(inner, streams, replica_set))
        address = await proxy.start()
        replica_set.fallback_address = f"{address.host}:{address.port}"
        return _format_uri(address.host, address.port)

    async def stop(self) -> None:
        self._uri = None
        proxy, self._proxy = self._proxy, None
        streams, self._streams = self._streams, None
        client, self._client = self._client, None
        if streams is not None:
            streams.close()  # wakes parked getMores before connections drop
        if proxy is not None:
            await proxy.close()
        if client is not None:
            await client.close()

    async def __aenter__(self) -> EmbeddedServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def serve(
    host: str = "127.0.0.1",
    port: int = 27017,
    *,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Run an embedded server until cancelled (``taskrunner dev-server``: until SIGINT/SIGTERM)."""
    async with EmbeddedServer(host, port) as server:
        if on_ready is not None:
            on_ready(server.uri)
        await asyncio.Event().wait()


class ServerThread:
    """An EmbeddedServer on its own event loop in a daemon thread, for sync code and fixtures."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = EmbeddedServer(host, port)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def uri(self) -> str:
        return self._server.uri

    def start(self) -> str:
        if self._thread is not None:
            return self.uri
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="taskrunner-embedded", daemon=True
        )
        self._thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._server.stop(), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
