"""The embedded server's change streams, served from its oplog (``taskrunner.dev.oplog``) as
MongoDB serves them from a replica set's.

* Commands.  The wire server rejects ``$changeStream``; the bridge answers ``aggregate``
  commands that start with ``$changeStream`` (collection, database and cluster level) and the
  ``getMore``/``killCursors`` of those cursors, with a ``postBatchResumeToken`` on every
  batch.  Bridge cursor ids live in ``[2**30, 2**31)``: mongoeco's own ids count up from 1
  and it rejects ids that do not fit in 32 bits.
* Events have MongoDB's shapes: ``clusterTime`` a BSON Timestamp, ``wallTime`` a date, and
  ``drop``, ``rename``, ``dropDatabase`` and ``invalidate`` events.  A collection stream sees
  its collection's drop, and a rename from or to it, each followed by an invalidate; a
  database stream sees every drop and rename in it, and a ``dropDatabase`` followed by an
  invalidate; a cluster stream sees them all and is never invalidated.
* Ends.  An invalidate closes the stream: the batch that carries it, or an empty batch where
  the stream's pipeline filters it out, answers cursor id 0 with the invalidate's token as
  its ``postBatchResumeToken``.  :meth:`ChangeStreams.end` ends streams on purpose the same
  way, for tests.
* Resuming.  ``resumeAfter`` an invalidate's token fails with 260 (InvalidResumeToken);
  ``startAfter`` it opens a stream after it.  A token or ``startAtOperationTime`` older than
  the history kept fails with 286 (ChangeStreamHistoryLost).  A token the history does not
  hold (another server's, or an event outside the stream's namespace) fails with 280
  (ChangeStreamFatalError) once the stream reaches an event past its time, as MongoDB's
  resume check does; until then the stream waits, as it would for a token from the future.
* ``$match``.  A pipeline of plain ``$match`` stages (no ``$expr``) is compiled once per
  stream with mongoeco's own matcher; other pipelines run through mongoeco's aggregation.

It reads mongoeco internals (the pipeline helpers, the request context of the namespace
commands it records); ``tests/contract/test_embedded.py`` fails loudly when a mongoeco upgrade moves
any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from taskrunner.dev.oplog import Entry, Oplog, Token, TokenKind
from taskrunner.dev.wire import MONGOECO_AVAILABLE, BridgedCommand, failure, plain_int

if MONGOECO_AVAILABLE:
    from mongoeco._change_streams.pipeline import compile_change_stream_pipeline
    from mongoeco._types import Timestamp
    from mongoeco.core.aggregation import apply_pipeline
    from mongoeco.core.aggregation.planning import _match_spec_contains_expr
    from mongoeco.core.bson_scalars import BsonInt64
    from mongoeco.core.codec import DocumentCodec
    from mongoeco.core.compiled_query import CompiledQuery
    from mongoeco.core.query_plan import compile_filter
    from mongoeco.errors import OperationFailure

_FIRST_BRIDGE_ID = 2**30
_ID_LIMIT = 2**31
_DEFAULT_AWAIT_MS = 1000  # MongoDB's awaitData default for getMore
_DEFAULT_BATCH = 1000  # bounds a reply when the client sets no batchSize
_IDLE_CURSOR_SECONDS = 600.0  # MongoDB's cursorTimeoutMillis default
_START_OPTIONS = ("resumeAfter", "startAfter", "startAtOperationTime")
_FULL_DOCUMENT_MODES = ("default", "updateLookup", "whenAvailable", "required")
_NAMESPACE_COMMANDS = ("drop", "renameCollection", "dropDatabase")

Pipeline = Callable[[dict[str, Any]], "dict[str, Any] | None"]


def _cursor_not_found(cursor_id: int) -> Exception:
    return failure(f"cursor id {cursor_id} not found", 43, "CursorNotFound", "ResumableChangeStreamError")


def _token_not_found(token: dict[str, Any]) -> Exception:
    return failure(
        f"cannot resume stream; the resume token was not found. {token}",
        280,
        "ChangeStreamFatalError",
        "NonResumableChangeStreamError",
    )


def _resume_after_invalidate() -> Exception:
    return failure(
        "Attempting to resume a change stream using 'resumeAfter' is not allowed from an invalidate"
        " notification.",
        260,
        "InvalidResumeToken",
    )


def is_bridge_id(value: object) -> bool:
    return isinstance(value, int) and _FIRST_BRIDGE_ID <= value < _ID_LIMIT


def is_change_stream(body: dict[str, Any]) -> bool:
    pipeline = body.get("pipeline")
    if not isinstance(pipeline, list) or not pipeline:
        return False
    return isinstance(pipeline[0], dict) and "$changeStream" in pipeline[0]


def command_database(command: str, body: dict[str, Any], db: str | None) -> str | None:
    """The database mongoeco must run ``command`` in.  MongoDB runs ``renameCollection`` on
    admin; mongoeco renames only within the database it runs in, so there it runs."""
    source = body.get("renameCollection")
    if command != "renameCollection" or not isinstance(source, str) or "." not in source:
        return db
    return source.partition(".")[0] if (db or body.get("$db")) == "admin" else db


def _batch_size(value: object) -> int:
    value = plain_int(value)
    return value if isinstance(value, int) and value >= 0 else _DEFAULT_BATCH


def _await_ms(body: dict[str, Any]) -> int:
    value = plain_int(body.get("maxTimeMS"))
    return value if isinstance(value, int) and value >= 0 else _DEFAULT_AWAIT_MS


def _namespace(value: object) -> tuple[str, str]:
    db, _, coll = str(value).partition(".")
    return db, coll


@dataclass(frozen=True, slots=True)
class _Scope:
    """What a stream watches: a collection, a database (``coll`` None) or the cluster (both None)."""

    db: str | None = None
    coll: str | None = None

    @property
    def ns(self) -> str | None:
        if self.db is None:
            return None
        return self.db if self.coll is None else f"{self.db}.{self.coll}"

    def sees(self, entry: Entry) -> tuple[bool, bool]:
        """Whether ``entry`` is an event of this stream, and whether it invalidates the stream."""
        if self.db is None:
            return True, False
        if self.coll is None:
            mine = entry.db == self.db or (entry.to is not None and entry.to[0] == self.db)
            return mine, mine and entry.op == "dropDatabase"
        if entry.op == "dropDatabase":
            return False, False  # its collections' own drops came first
        mine = (entry.db, entry.coll) == (self.db, self.coll) or entry.to == (self.db, self.coll)
        return mine, mine and entry.op in ("drop", "rename")


def _event(entry: Entry, token: Token, full_document: str) -> dict[str, Any]:
    """The change event MongoDB would send for ``entry`` (internal BSON values, sharing the
    entry's documents: the pipeline copies before it changes anything)."""
    event: dict[str, Any] = {
        "_id": token.encode(),
        "operationType": "invalidate" if token.kind is TokenKind.INVALIDATE else entry.op,
        "clusterTime": entry.ts,
        "wallTime": entry.wall,
    }
    if token.kind is TokenKind.INVALIDATE:
        return event
    if entry.op in ("insert", "replace") or (entry.op == "update" and full_document != "default"):
        event["fullDocument"] = entry.full_document
    event["ns"] = {"db": entry.db} if entry.coll is None else {"db": entry.db, "coll": entry.coll}
    if entry.to is not None:
        event["to"] = {"db": entry.to[0], "coll": entry.to[1]}
    if entry.document_key is not None:
        event["documentKey"] = entry.document_key
    if entry.update_description is not None:
        event["updateDescription"] = entry.update_description
    if entry.lsid is not None and entry.txn_number is not None:
        event["lsid"] = entry.lsid
        event["txnNumber"] = BsonInt64(entry.txn_number)
    return event


def _compile_pipeline(stages: list[Any]) -> Pipeline:
    """The stream's stages after ``$changeStream`` as a function of one event (None: filtered
    out); plain ``$match`` stages compile once, the rest run through mongoeco's aggregation."""
    if not stages:
        return lambda event: event
    compiled = compile_change_stream_pipeline(DocumentCodec.to_internal(stages))
    assert compiled is not None
    if all(set(stage) == {"$match"} and not _match_spec_contains_expr(stage["$match"]) for stage in compiled):
        specs = [stage["$match"] for stage in compiled]
        matchers = [CompiledQuery(compile_filter(spec)) for spec in specs if isinstance(spec, dict) and spec]
        return lambda event: event if all(matcher.match(event) for matcher in matchers) else None

    def run(event: dict[str, Any]) -> dict[str, Any] | None:
        out = apply_pipeline([copy.deepcopy(event)], compiled)
        return out[0] if out else None

    return run


@dataclass(slots=True)
class _Position:
    """Where a stream reads next, and what it still owes or must check there."""

    next_seq: int
    last_token: Token  # the postBatchResumeToken: the last event sent, or a high-water mark
    pending_invalidate: Entry | None = None  # resumed after an invalidating event's token
    min_ts: Any = None  # entries before this cluster time are not the stream's
    unverified: Token | None = None  # a client token the history does not hold: 280 at the next event


def _start_position(oplog: Oplog, scope: _Scope, spec: dict[str, Any]) -> _Position:
    """Where a new stream starts: now, or at the resume point its options name."""
    given = [name for name in _START_OPTIONS if spec.get(name) is not None]
    if len(given) > 1:
        raise failure(
            "Only one type of resume option is allowed, but multiple were found.", 40674, "Location40674"
        )
    if not given:
        now = Token(oplog.instance, oplog.clock.now, oplog.next_seq - 1, TokenKind.HIGH_WATER)
        return _Position(oplog.next_seq, now)
    if given[0] == "startAtOperationTime":
        at = spec["startAtOperationTime"]
        if not isinstance(at, Timestamp):
            raise failure("startAtOperationTime must be a timestamp", 14, "TypeMismatch")
        seq = oplog.first_at(at)
        return _Position(seq, Token(oplog.instance, at, seq - 1, TokenKind.HIGH_WATER), min_ts=at)
    token = Token.decode(spec[given[0]])
    if given[0] == "resumeAfter" and token.kind is TokenKind.INVALIDATE:
        raise _resume_after_invalidate()
    return _resume_position(oplog, scope, token)


def _resume_position(oplog: Oplog, scope: _Scope, token: Token) -> _Position:
    if token.kind is not TokenKind.EVENT and oplog.holds(token):
        return _Position(token.seq + 1, token)
    entry = oplog.find(token) if token.kind is TokenKind.EVENT else None
    if entry is not None and scope.sees(entry)[0]:
        # After an event that invalidates this stream comes its invalidate, as on MongoDB.
        invalidates = scope.sees(entry)[1]
        return _Position(entry.seq + 1, token, pending_invalidate=entry if invalidates else None)
    # Not this server's, or not an event of this stream: MongoDB reads on from the token's time
    # and fails once it passes an event without having met the token's own.
    unverified = None if token.kind is TokenKind.HIGH_WATER else token
    return _Position(oplog.first_at(token.ts), token, min_ts=token.ts, unverified=unverified)


class _Stream:
    """One change-stream cursor: a scope, a pipeline and a position in the oplog."""

    def __init__(
        self, cursor_id: int, ns: str, scope: _Scope, position: _Position, pipeline: Pipeline, full: str
    ) -> None:
        self.cursor_id = cursor_id
        self.ns = ns
        self.scope = scope
        self.position = position
        self.pipeline = pipeline
        self.full_document = full
        self.invalidated = False
        self.ended_on_purpose = False  # set by ChangeStreams.end, possibly from another thread
        self.last_used = time.monotonic()

    @property
    def closed(self) -> bool:
        return self.invalidated or self.ended_on_purpose

    def take(self, oplog: Oplog, limit: int) -> list[dict[str, Any]]:
        """The events now available, at most ``limit``; stops after an invalidate."""
        events: list[dict[str, Any]] = []
        while len(events) < limit and not self.invalidated:
            if (invalidating := self.position.pending_invalidate) is not None:
                self.position.pending_invalidate = None
                self.invalidated = True
                self._send(oplog, invalidating, TokenKind.INVALIDATE, events)
            elif (entry := oplog.entry(self.position.next_seq)) is not None:
                self._read(oplog, entry, events)
            else:
                break
        return events

    def _read(self, oplog: Oplog, entry: Entry, events: list[dict[str, Any]]) -> None:
        at = self.position
        at.next_seq += 1
        reported, invalidates = self.scope.sees(entry)
        if not reported or (at.min_ts is not None and entry.ts < at.min_ts):
            at.last_token = Token(oplog.instance, entry.ts, entry.seq, TokenKind.HIGH_WATER)
            return
        if at.unverified is not None:
            raise _token_not_found(at.unverified.encode())
        at.pending_invalidate = entry if invalidates else None
        self._send(oplog, entry, TokenKind.EVENT, events)

    def _send(self, oplog: Oplog, entry: Entry, kind: TokenKind, events: list[dict[str, Any]]) -> None:
        token = Token(oplog.instance, entry.ts, entry.seq, kind)
        self.position.last_token = token
        event = self.pipeline(_event(entry, token, self.full_document))
        if event is not None:
            events.append(DocumentCodec.to_pymongo(event))

    def final_token(self) -> Token:
        """The last batch's postBatchResumeToken; an ended stream's is an invalidate's, as MongoDB's."""
        token = self.position.last_token
        return dataclasses.replace(token, kind=TokenKind.INVALIDATE) if self.ended_on_purpose else token


class ChangeStreams:
    """Serves change-stream cursors from the oplog fed by the proxy's own client's change hub."""

    def __init__(self, client: Any, history_size: int = 10_000) -> None:
        self.client = client
        # Never read: it only keeps mongoeco publishing changes to the hub, whose funnel feeds the oplog.
        self._keeper = client.watch(max_await_time_ms=0)
        self.oplog = Oplog(self._keeper._hub, history_size)
        self._cursors: dict[int, _Stream] = {}

    def owns(self, cursor_id: object) -> bool:
        return is_bridge_id(cursor_id)

    def close(self) -> None:
        self._cursors.clear()
        self.oplog.wake()  # parked getMores see their cursors gone
        self._keeper.close()

    def stamp(self, reply: dict[str, Any]) -> dict[str, Any]:
        """``reply`` with the ``$clusterTime`` and ``operationTime`` a replica-set member adds."""
        return self.oplog.clock.stamp(reply)

    def end(self, ns: str | None) -> int:
        """End every open stream on ``ns`` (a collection's ``"db.coll"`` or a database's ``"db"``;
        None: every stream): its pending or next getMore answers an empty batch and cursor id 0,
        as MongoDB's after an invalidate its ``$match`` hid.  Returns how many were ended.
        Safe to call from any thread."""
        streams = [s for s in list(self._cursors.values()) if ns is None or s.scope.ns == ns]
        ended = [stream for stream in streams if not stream.closed]
        for stream in ended:
            stream.ended_on_purpose = True
        self.oplog.wake()
        return len(ended)

    async def apply(
        self, command: str, db: str, body: dict[str, Any], run: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """Run a mongoeco command (``run``), recording the namespace change a drop, rename or
        dropDatabase makes as MongoDB's oplog does (mongoeco reports only drops, and drops of
        collections that do not exist too)."""
        if command not in _NAMESPACE_COMMANDS:
            return await run()
        silenced = await self._unreported_drops(command, db, body)
        first = self.oplog.next_seq
        with self.oplog.silenced(silenced):
            reply = await run()
        if reply.get("ok"):
            self._record(command, db, body, first)
        return reply

    async def _unreported_drops(self, command: str, db: str, body: dict[str, Any]) -> list[tuple[str, str]]:
        if command == "renameCollection":
            return [_namespace(body.get("to"))]  # a dropped target is part of the rename event
        if command == "drop" and isinstance(body.get("drop"), str):
            names = await self.client.get_database(db).list_collection_names()
            return [] if body["drop"] in names else [(db, body["drop"])]
        return []

    def _record(self, command: str, db: str, body: dict[str, Any], first: int) -> None:
        if command == "renameCollection":
            self.oplog.renamed(*_namespace(body["renameCollection"]), *_namespace(body["to"]))
        elif command == "dropDatabase" and self.oplog.dropped_since(first, db):
            self.oplog.database_dropped(db)

    async def aggregate(self, command: BridgedCommand) -> dict[str, Any]:
        self._reap_idle()
        spec = command.body["pipeline"][0]["$changeStream"]
        scope, ns = self._scope(command, spec)
        full = _full_document_mode(spec)
        pipeline = _compile_pipeline(command.body["pipeline"][1:])
        stream = _Stream(self._new_id(), ns, scope, _start_position(self.oplog, scope, spec), pipeline, full)
        # The first batch is answered before the cursor exists: an error there leaves none behind.
        size = _batch_size((command.body.get("cursor") or {}).get("batchSize"))
        events = stream.take(self.oplog, size)
        if not stream.closed:
            self._cursors[stream.cursor_id] = stream
        return self._batch(stream, "firstBatch", events)

    async def get_more(self, command: BridgedCommand) -> dict[str, Any]:
        cursor_id = command.body["getMore"]
        stream = self._cursors.get(cursor_id)
        if stream is None:
            raise _cursor_not_found(cursor_id)
        size = _batch_size(command.body.get("batchSize"))
        try:
            events = await self._collect(stream, size, _await_ms(command.body))
        except OperationFailure:
            self.kill([cursor_id])
            raise
        if cursor_id not in self._cursors:  # killed while it waited
            raise _cursor_not_found(cursor_id)
        stream.last_used = time.monotonic()
        if stream.closed:
            self.kill([cursor_id])
        return self._batch(stream, "nextBatch", events)

    def kill(self, cursor_ids: list[int]) -> tuple[list[int], list[int]]:
        killed = [cursor_id for cursor_id in cursor_ids if self._cursors.pop(cursor_id, None)]
        if killed:
            self.oplog.wake()
        return killed, [cursor_id for cursor_id in cursor_ids if cursor_id not in killed]

    async def _collect(self, stream: _Stream, limit: int, await_ms: int) -> list[dict[str, Any]]:
        """Wait up to await_ms for a first event, then take only what is already there."""
        deadline = time.monotonic() + await_ms / 1000
        while True:
            if stream.ended_on_purpose:
                return []
            events = stream.take(self.oplog, limit)
            remaining = deadline - time.monotonic()
            if events or stream.closed or remaining <= 0 or stream.cursor_id not in self._cursors:
                return events
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self.oplog.changed()

    def _batch(self, stream: _Stream, key: str, events: list[dict[str, Any]]) -> dict[str, Any]:
        reply_id = stream.cursor_id if stream.cursor_id in self._cursors else 0
        batch = {
            key: events,
            "id": BsonInt64(reply_id),
            "ns": stream.ns,
            "postBatchResumeToken": stream.final_token().encode(),
        }
        return {"cursor": batch, "ok": 1.0}

    def _scope(self, command: BridgedCommand, spec: dict[str, Any]) -> tuple[_Scope, str]:
        source = command.body["aggregate"]
        if isinstance(source, str):
            return _Scope(command.db, source), f"{command.db}.{source}"
        if spec.get("allChangesForCluster"):
            if command.db != "admin":
                raise failure(
                    "$changeStream with allChangesForCluster must run on admin", 40492, "Location40492"
                )
            return _Scope(), "admin.$cmd.aggregate"
        return _Scope(command.db), f"{command.db}.$cmd.aggregate"

    def _new_id(self) -> int:
        # Random rather than sequential so a client that outlived a server restart
        # gets CursorNotFound instead of another client's stream.
        while True:
            cursor_id = _FIRST_BRIDGE_ID + secrets.randbelow(_ID_LIMIT - _FIRST_BRIDGE_ID)
            if cursor_id not in self._cursors:
                return cursor_id

    def _reap_idle(self) -> None:
        # Clients that vanish never send killCursors.
        cutoff = time.monotonic() - _IDLE_CURSOR_SECONDS
        self.kill([s.cursor_id for s in list(self._cursors.values()) if s.last_used < cutoff])


def _full_document_mode(spec: dict[str, Any]) -> str:
    supported = {*_START_OPTIONS, "fullDocument", "allChangesForCluster", "fullDocumentBeforeChange"}
    for key, value in spec.items():
        if key not in supported or (key == "fullDocumentBeforeChange" and value != "off"):
            raise failure(
                f"$changeStream option {key!r} is not supported by the embedded server", 9, "FailedToParse"
            )
    mode = spec.get("fullDocument", "default")
    if mode not in _FULL_DOCUMENT_MODES:
        raise failure(f"unknown fullDocument mode {mode!r}", 9, "FailedToParse")
    return str(mode)
