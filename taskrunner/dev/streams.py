"""The embedded server's change streams: mongoeco's in-process ``watch()`` served over the wire.

* Change streams.  The wire server rejects ``$changeStream``, but the
  in-process client supports ``watch()``.  The bridge answers ``aggregate``
  commands that start with ``$changeStream`` (collection, database and cluster
  level) plus the ``getMore``/``killCursors`` of those cursors by serving
  batches from an in-process watch, with a ``postBatchResumeToken`` on every
  batch.  Bridge cursor ids live in ``[2**30, 2**31)``: mongoeco's own ids
  count up from 1 and it rejects ids that do not fit in 32 bits.
* Change history.  mongoeco records events only while a watcher exists, and
  writes without one become gaps that break later resumes, so one idle
  watcher stays open for the server's lifetime.
* Update descriptions.  mongoeco's update events carry no ``updateDescription``,
  so a ``$match`` on ``updateDescription.updatedFields`` (how MongoDB users
  filter events before any lookup) never matches.  The bridge diffs each
  update's post-image against the previous one it saw for that document
  (the embedded engine starts empty, so it sees every document's history) and
  adds ``updatedFields``/``removedFields``/``truncatedArrays`` in MongoDB's
  dotted-path form.
* ``$match`` per event.  mongoeco prepares and compiles a stream's pipeline again
  for every event in every open stream, which cost more than the match itself
  and grew with the number of streams.  A pipeline of plain ``$match`` stages
  (no ``$expr``) is compiled once per stream with mongoeco's own matcher, so
  what matches is unchanged; other pipelines run as before.

It reads mongoeco internals (the hub's lock and event list and its append funnel, the
cursor offset); ``tests/test_embedded.py`` fails loudly when a mongoeco upgrade moves any
of them.
"""

from __future__ import annotations

import copy
import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from taskrunner.dev.wire import MONGOECO_AVAILABLE, BridgedCommand, failure, plain_int

if MONGOECO_AVAILABLE:
    from mongoeco._change_streams.pipeline import apply_full_document_mode
    from mongoeco._types.documents import encode_change_stream_token
    from mongoeco.core.aggregation.planning import _match_spec_contains_expr
    from mongoeco.core.bson_scalars import BsonInt64
    from mongoeco.core.compiled_query import CompiledQuery
    from mongoeco.core.query_plan import compile_filter
    from mongoeco.errors import OperationFailure

_FIRST_BRIDGE_ID = 2**30
_ID_LIMIT = 2**31
_DEFAULT_AWAIT_MS = 1000  # MongoDB's awaitData default for getMore
_DEFAULT_BATCH = 1000  # bounds a reply when the client sets no batchSize
_IDLE_CURSOR_SECONDS = 600.0  # MongoDB's cursorTimeoutMillis default
_HISTORY_LOST = "no longer available"
_STREAM_OPTIONS = {
    "fullDocument": "full_document",
    "resumeAfter": "resume_after",
    "startAfter": "start_after",
}


def _cursor_not_found(cursor_id: int) -> Exception:
    return failure(f"cursor id {cursor_id} not found", 43, "CursorNotFound", "ResumableChangeStreamError")


def _translate(error: Exception) -> Exception:
    """Give mongoeco's code-less history errors MongoDB's code so drivers react correctly."""
    if _HISTORY_LOST in str(error):
        return failure(str(error), 286, "ChangeStreamHistoryLost")
    return error


def is_bridge_id(value: object) -> bool:
    return isinstance(value, int) and _FIRST_BRIDGE_ID <= value < _ID_LIMIT


def is_change_stream(body: dict[str, Any]) -> bool:
    pipeline = body.get("pipeline")
    if not isinstance(pipeline, list) or not pipeline:
        return False
    return isinstance(pipeline[0], dict) and "$changeStream" in pipeline[0]


def _batch_size(value: object) -> int:
    value = plain_int(value)
    return value if isinstance(value, int) and value >= 0 else _DEFAULT_BATCH


def _await_ms(body: dict[str, Any]) -> int:
    value = plain_int(body.get("maxTimeMS"))
    return value if isinstance(value, int) and value >= 0 else _DEFAULT_AWAIT_MS


def _post_batch_token(stream: Any) -> dict[str, str]:
    """Resume token meaning "everything this stream has passed over", read under the hub lock.

    Built from the stream's own offset, not the hub's end, so events that land
    while the reply is assembled are neither skipped nor repeated on resume.
    """
    hub = stream._hub
    with hub._condition:
        events = hub._events
        index = stream._offset - hub._base_offset
        if 0 < index <= len(events):
            token = events[index - 1].token
        elif events:
            token = events[0].token - 1
        else:
            token = hub._next_token - 1
    return {"_data": encode_change_stream_token(token)}


async def _collect(stream: Any, limit: int, await_ms: int) -> list[Any]:
    """Wait up to await_ms for a first event, then take only what is already there."""
    events: list[Any] = []
    while len(events) < limit and stream.alive:
        stream._max_await_time_ms = 0 if events else await_ms
        event = await stream.try_next()
        if event is None:
            break
        events.append(event)
    return events


def update_description(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What MongoDB reports for an update from ``before`` to ``after``: changed paths (dotted,
    into sub-documents and array elements), removed fields and shortened arrays."""
    description: dict[str, Any] = {"updatedFields": {}, "removedFields": [], "truncatedArrays": []}
    _diff_document(before, after, "", description)
    return description


def _diff_document(before: dict[str, Any], after: dict[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for name, value in after.items():
        if name not in before:
            out["updatedFields"][prefix + name] = copy.deepcopy(value)
        else:
            _diff_value(before[name], value, prefix + name, out)
    out["removedFields"].extend(prefix + name for name in before if name not in after)


def _diff_value(old: Any, new: Any, path: str, out: dict[str, Any]) -> None:
    if type(old) is type(new) and isinstance(new, dict):
        _diff_document(old, new, path + ".", out)
    elif type(old) is type(new) and isinstance(new, list):
        if len(new) < len(old):
            out["truncatedArrays"].append({"field": path, "newSize": len(new)})
        for index, item in enumerate(new):
            if index >= len(old):
                out["updatedFields"][f"{path}.{index}"] = copy.deepcopy(item)
            else:
                _diff_value(old[index], item, f"{path}.{index}", out)
    elif type(old) is not type(new) or old != new:
        out["updatedFields"][path] = copy.deepcopy(new)


class _UpdateDescriptions:
    """Adds ``updateDescription`` to the update events of one mongoeco change hub.

    Wraps the hub's single append point; keeps the last post-image of every document
    (by namespace and ``_id``) to diff the next update against.
    """

    def __init__(self, hub: Any) -> None:
        self._images: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._append = hub._append_committed_event_locked
        hub._append_committed_event_locked = self.append

    def append(self, event: Any) -> None:
        ident = (event.db_name, event.coll_name, repr(event.document_key.get("_id")))
        before = self._images.get(ident)
        if event.operation_type == "delete":
            self._images.pop(ident, None)
        elif event.full_document is not None:
            self._images[ident] = copy.deepcopy(event.full_document)
            if event.operation_type == "update" and before is not None and event.update_description is None:
                described = update_description(before, event.full_document)
                event = dataclasses.replace(event, update_description=described)
        self._append(event)


def _compile_matches(stream: Any) -> None:
    """Match ``stream``'s events with its ``$match`` stages compiled once (see the module
    docstring); a pipeline with other stages or ``$expr`` is left to mongoeco."""
    stages = stream._pipeline
    if not stages or any(
        set(stage) != {"$match"} or _match_spec_contains_expr(stage["$match"]) for stage in stages
    ):
        return
    matchers = [CompiledQuery(compile_filter(stage["$match"])) for stage in stages if stage["$match"]]

    def transform(event: Any) -> Any:
        if not stream._scope.matches(event):
            return None
        document = apply_full_document_mode(event.to_document(), stream._full_document)
        if all(matcher.match(document) for matcher in matchers):
            return stream._materialize_document(document)
        return None

    stream._transform = transform


@dataclass(slots=True)
class _StreamCursor:
    cursor_id: int
    ns: str
    stream: Any
    last_used: float = field(default_factory=time.monotonic)


class ChangeStreams:
    """Serves change-stream cursors from in-process watches of the proxy's own client."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._cursors: dict[int, _StreamCursor] = {}
        # Never read: it only keeps mongoeco recording history between streams.
        self._keeper = client.watch(max_await_time_ms=0)
        self._descriptions = _UpdateDescriptions(self._keeper._hub)

    def owns(self, cursor_id: object) -> bool:
        return is_bridge_id(cursor_id)

    def close(self) -> None:
        for cursor in self._cursors.values():
            cursor.stream.close()
        self._cursors.clear()
        self._keeper.close()

    async def aggregate(self, command: BridgedCommand) -> dict[str, Any]:
        self._reap_idle()
        spec = command.body["pipeline"][0]["$changeStream"]
        target, ns = self._target(command, spec)
        try:
            stream = target.watch(command.body["pipeline"][1:] or None, **_watch_options(spec))
        except OperationFailure as error:
            raise _translate(error) from error
        _compile_matches(stream)
        cursor = _StreamCursor(self._new_id(), ns, stream)
        self._cursors[cursor.cursor_id] = cursor
        size = _batch_size((command.body.get("cursor") or {}).get("batchSize"))
        # A first batch must not block: MongoDB returns it at once, often empty.
        return await self._reply(cursor, "firstBatch", size, await_ms=0)

    async def get_more(self, command: BridgedCommand) -> dict[str, Any]:
        cursor_id = command.body["getMore"]
        cursor = self._cursors.get(cursor_id)
        if cursor is None:
            raise _cursor_not_found(cursor_id)
        size = _batch_size(command.body.get("batchSize"))
        return await self._reply(cursor, "nextBatch", size, _await_ms(command.body))

    def kill(self, cursor_ids: list[int]) -> tuple[list[int], list[int]]:
        killed = [cursor_id for cursor_id in cursor_ids if cursor_id in self._cursors]
        for cursor_id in killed:
            self._cursors.pop(cursor_id).stream.close()
        return killed, [cursor_id for cursor_id in cursor_ids if cursor_id not in killed]

    async def _reply(self, cursor: _StreamCursor, key: str, size: int, await_ms: int) -> dict[str, Any]:
        try:
            events = await _collect(cursor.stream, size, await_ms)
        except OperationFailure as error:
            killed_while_waiting = cursor.cursor_id not in self._cursors
            self.kill([cursor.cursor_id])
            if killed_while_waiting:
                raise _cursor_not_found(cursor.cursor_id) from error
            raise _translate(error) from error
        cursor.last_used = time.monotonic()
        if not cursor.stream.alive:  # an invalidate event closed it
            self.kill([cursor.cursor_id])
        reply_id = cursor.cursor_id if cursor.cursor_id in self._cursors else 0
        batch = {
            key: events,
            "id": BsonInt64(reply_id),
            "ns": cursor.ns,
            "postBatchResumeToken": _post_batch_token(cursor.stream),
        }
        return {"cursor": batch, "ok": 1.0}

    def _target(self, command: BridgedCommand, spec: dict[str, Any]) -> tuple[Any, str]:
        database = self.client.get_database(command.db)
        source = command.body["aggregate"]
        if isinstance(source, str):
            return database.get_collection(source), f"{command.db}.{source}"
        if spec.get("allChangesForCluster"):
            if command.db != "admin":
                raise OperationFailure("allChangesForCluster is only allowed on 'admin'")
            return self.client, "admin.$cmd.aggregate"
        return database, f"{command.db}.$cmd.aggregate"

    def _new_id(self) -> int:
        # Random rather than sequential so a client that outlived a server restart
        # gets CursorNotFound instead of another client's stream.
        while True:
            cursor_id = _FIRST_BRIDGE_ID + secrets.randbelow(_ID_LIMIT - _FIRST_BRIDGE_ID)
            if cursor_id not in self._cursors:
                return cursor_id

    def _reap_idle(self) -> None:
        # Clients that vanish never send killCursors; each stream pins a watcher.
        cutoff = time.monotonic() - _IDLE_CURSOR_SECONDS
        self.kill([c.cursor_id for c in self._cursors.values() if c.last_used < cutoff])


def _watch_options(spec: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in spec.items():
        if key in _STREAM_OPTIONS:
            options[_STREAM_OPTIONS[key]] = value
        elif key == "allChangesForCluster" or (key == "fullDocumentBeforeChange" and value == "off"):
            continue
        else:
            raise OperationFailure(f"$changeStream option {key!r} is not supported by mongoeco")
    return options
