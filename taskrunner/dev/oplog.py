"""The embedded server's oplog: every change, in order, with a replica set's cluster times.

MongoDB serves change streams from a replica set's oplog; the embedded server keeps a log of
the same shape, fed from mongoeco's change hub, and serves its streams from it
(``taskrunner.dev.streams``):

* Entries.  One per insert, update, replace and delete, and one per collection drop, rename
  and database drop.  mongoeco reports a drop as an ``invalidate`` event published outside
  its engine's commit sequence, which took the hub token of the next write and so lost that
  write's event; the log takes such events off the hub instead.  Renames and database drops
  mongoeco does not report at all: the bridge records them around their commands
  (``ChangeStreams.apply``).
* Cluster time.  Each entry gets a BSON Timestamp (seconds, increment), strictly increasing
  (a committed transaction's entries share its commit's, and carry its ``lsid`` and
  ``txnNumber``), and a wall time; replies carry ``operationTime`` and ``$clusterTime`` from
  the same clock, as a replica-set member's do.
* Resume tokens name this server instance, the entry's time and position and the token's
  kind (an event, an invalidate, or a high-water mark), so a token from another server or
  an earlier run is unknown here, as it would be to another replica set.
* History.  The newest ``history_size`` entries are kept; a resume point older than the
  oldest of them is lost (286), as one that fell off the oplog.
* Update descriptions.  mongoeco's update events carry no ``updateDescription``, so a
  ``$match`` on ``updateDescription.updatedFields`` (how MongoDB users filter events before
  any lookup) would never match.  The log diffs each update's post-image against the
  previous one it saw for that document (the engine starts empty, so it sees every
  document's history) and records ``updatedFields``/``removedFields``/``truncatedArrays``
  in MongoDB's dotted-path form.

It takes the place of the hub's append funnel (a mongoeco internal, replaced in
``taskrunner.dev.patches``).
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import datetime
import secrets
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from taskrunner.dev import patches
from taskrunner.dev.wire import MONGOECO_AVAILABLE, failure

if MONGOECO_AVAILABLE:
    from bson.binary import Binary
    from bson.int64 import Int64
    from mongoeco._types import Timestamp

_NON_RESUMABLE = "NonResumableChangeStreamError"
_TOKEN_PREFIX = "82"  # MongoDB's hex tokens start so; ours are opaque all the same
_TOKEN_LAYOUT = struct.Struct(">IIQB8s")  # seconds, increment, position, kind, server instance


def _history_lost() -> Exception:
    return failure(
        "Resume of change stream was not possible, as the resume point may no longer be in the oplog.",
        286,
        "ChangeStreamHistoryLost",
        _NON_RESUMABLE,
    )


class ClusterClock:
    """A replica set's logical clock: Timestamp(seconds, increment), strictly increasing."""

    def __init__(self) -> None:
        self.now: Any = Timestamp(int(time.time()), 0)

    def tick(self) -> Any:
        seconds, last = int(time.time()), self.now
        self.now = Timestamp(seconds, 1) if seconds > last.time else Timestamp(last.time, last.inc + 1)
        return self.now

    def stamp(self, reply: dict[str, Any]) -> dict[str, Any]:
        """Add what a replica-set member adds to every reply: its cluster and operation time."""
        # Without access control MongoDB signs with key 0 and a zero hash.
        signature = {"hash": Binary(bytes(20), 0), "keyId": Int64(0)}
        reply["$clusterTime"] = {"clusterTime": self.now, "signature": signature}
        reply["operationTime"] = self.now
        return reply


@dataclass(frozen=True, slots=True)
class Entry:
    """One oplog entry: a document change (``ns`` a collection) or a namespace change."""

    seq: int
    ts: Any  # mongoeco Timestamp
    wall: datetime.datetime
    op: str  # insert, update, replace, delete, drop, rename, dropDatabase
    db: str
    coll: str | None
    document_key: dict[str, Any] | None = None
    full_document: dict[str, Any] | None = None
    update_description: dict[str, Any] | None = None
    to: tuple[str, str] | None = None  # a rename's target
    lsid: dict[str, Any] | None = None  # a committed transaction's session and number
    txn_number: int | None = None


class TokenKind(IntEnum):
    EVENT = 0
    INVALIDATE = 1
    HIGH_WATER = 2  # a position between events, as a postBatchResumeToken after filtered entries


@dataclass(frozen=True, slots=True)
class Token:
    instance: bytes
    ts: Any
    seq: int
    kind: TokenKind

    def encode(self) -> dict[str, str]:
        packed = _TOKEN_LAYOUT.pack(self.ts.time, self.ts.inc, self.seq, self.kind, self.instance)
        return {"_data": _TOKEN_PREFIX + packed.hex().upper()}

    @staticmethod
    def decode(value: object) -> Token:
        data = value.get("_data") if isinstance(value, dict) else None
        try:
            if not isinstance(data, str) or not data.startswith(_TOKEN_PREFIX):
                raise ValueError(data)
            seconds, inc, seq, kind, instance = _TOKEN_LAYOUT.unpack(bytes.fromhex(data[2:]))
            return Token(instance, Timestamp(seconds, inc), seq, TokenKind(kind))
        except (ValueError, struct.error) as error:
            raise failure(f"invalid resume token: {value!r}", 9, "FailedToParse") from error


class Oplog:
    """The embedded server's change log, fed by mongoeco's change hub (see the module docstring)."""

    def __init__(self, hub: Any, history_size: int) -> None:
        self.instance = secrets.token_bytes(8)
        self.clock = ClusterClock()
        self._history = history_size
        self._entries: list[Entry] = []
        self._next_seq = 1
        self._start_ts: Any = self.clock.tick()
        self._floor_ts: Any = self._start_ts  # the server's start, then the oldest entry kept
        self._silenced: Counter[tuple[str, str]] = Counter()
        self._images = _PostImages()
        self._waiters: set[asyncio.Future[None]] = set()
        self._transaction: tuple[dict[str, Any], int] | None = None
        self._transaction_ts: Any = None
        self.on_entry: Callable[[Entry], None] | None = None  # told of every entry appended
        self._forward = patches.route_hub_events(hub, self._receive)

    # Writing.

    def _receive(self, event: Any) -> None:
        """The hub's append funnel: every event mongoeco publishes passes here, under its lock."""
        if event.operation_type == "invalidate":  # mongoeco's drop marker, outside its sequence
            self._dropped(event.db_name, event.coll_name)
            return
        self._forward(event)  # keeps the hub's tokens in step with the engine's commit sequence
        described = self._images.describe(event)
        self._append(
            op=event.operation_type,
            db=event.db_name,
            coll=event.coll_name,
            document_key=event.document_key,
            full_document=event.full_document,
            update_description=described,
        )

    def _dropped(self, db: str, coll: str) -> None:
        self._images.forget(db, coll)
        if self._silenced[db, coll]:
            self._silenced[db, coll] -= 1
            return
        self._append(op="drop", db=db, coll=coll)

    @contextmanager
    def silenced(self, namespaces: list[tuple[str, str]]) -> Iterator[None]:
        """Drops of these namespaces while inside are not MongoDB events (a missing collection,
        or the target a rename replaces, which MongoDB reports as the rename)."""
        self._silenced.update(namespaces)
        try:
            yield
        finally:
            self._silenced.subtract(namespaces)
            self._silenced = +self._silenced

    def renamed(self, db: str, coll: str, to_db: str, to_coll: str) -> None:
        self._images.move((db, coll), (to_db, to_coll))
        self._append(op="rename", db=db, coll=coll, to=(to_db, to_coll))

    @contextmanager
    def transaction(self, lsid: dict[str, Any], txn_number: int) -> Iterator[None]:
        """Entries appended while inside are a committed transaction's: they share one cluster
        time and carry its ``lsid`` and ``txnNumber``, as MongoDB's events of a transaction."""
        self._transaction, self._transaction_ts = (lsid, txn_number), None
        try:
            yield
        finally:
            self._transaction = self._transaction_ts = None

    def database_dropped(self, db: str) -> None:
        self._append(op="dropDatabase", db=db, coll=None)

    def _append(self, **fields: Any) -> None:
        wall = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        wall = wall.replace(microsecond=wall.microsecond // 1000 * 1000)  # BSON dates are ms
        if self._transaction is not None:
            ts = self._transaction_ts = self._transaction_ts or self.clock.tick()
            fields["lsid"], fields["txn_number"] = self._transaction
        else:
            ts = self.clock.tick()
        entry = Entry(seq=self._next_seq, ts=ts, wall=wall, **fields)
        self._next_seq += 1
        self._entries.append(entry)
        if len(self._entries) > self._history:
            del self._entries[: len(self._entries) - self._history]
            self._floor_ts = self._entries[0].ts
        if self.on_entry is not None:
            self.on_entry(entry)
        self.wake()

    # Reading.

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def entry(self, seq: int) -> Entry | None:
        """The entry at ``seq``, None if it is yet to come; raises 286 if it was pruned."""
        first = self._entries[0].seq if self._entries else self._next_seq
        if seq < first:
            raise _history_lost()
        return self._entries[seq - first] if seq < self._next_seq else None

    def holds(self, token: Token) -> bool:
        """Whether ``token`` names a position in this server's history still kept (0: its start)."""
        if token.seq == 0:
            return token.instance == self.instance and token.ts == self._start_ts == self._floor_ts
        return self.find(token) is not None

    def find(self, token: Token) -> Entry | None:
        """This server's entry that ``token`` names, if it is still kept."""
        if token.instance != self.instance or not 0 < token.seq < self._next_seq:
            return None
        first = self._entries[0].seq if self._entries else self._next_seq
        if token.seq < first:
            return None
        entry = self._entries[token.seq - first]
        return entry if entry.ts == token.ts else None

    def first_at(self, ts: Any) -> int:
        """Position of the first entry at or after cluster time ``ts``; 286 if older than history."""
        if ts < self._floor_ts:
            raise _history_lost()
        index = bisect.bisect_left(self._entries, ts, key=lambda entry: entry.ts)
        return self._entries[index].seq if index < len(self._entries) else self._next_seq

    def dropped_since(self, seq: int, db: str) -> bool:
        """Whether a collection of ``db`` was dropped at or after position ``seq``."""
        return any(entry.op == "drop" and entry.db == db for entry in self._entries if entry.seq >= seq)

    # Waiting.

    async def changed(self) -> None:
        """Return after the next append or ``wake`` (callers bound the wait)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await waiter
        finally:
            self._waiters.discard(waiter)

    def wake(self) -> None:
        """Wake every waiting reader (new entries, or streams ended or killed); thread-safe."""
        for waiter in list(self._waiters):
            waiter.get_loop().call_soon_threadsafe(_resolve, waiter)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _PostImages:
    """The last post-image of every document, by namespace and ``_id``, to describe updates."""

    def __init__(self) -> None:
        self._images: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}

    def describe(self, event: Any) -> dict[str, Any] | None:
        """The update description of ``event`` (None unless an update), remembering its image."""
        images = self._images.setdefault((event.db_name, event.coll_name), {})
        ident = repr(event.document_key.get("_id"))
        before = images.get(ident)
        if event.operation_type == "delete":
            images.pop(ident, None)
            return None
        if event.full_document is None:
            return event.update_description  # type: ignore[no-any-return]
        images[ident] = copy.deepcopy(event.full_document)
        if event.operation_type != "update" or event.update_description is not None or before is None:
            return event.update_description  # type: ignore[no-any-return]
        return update_description(before, event.full_document)

    def forget(self, db: str, coll: str) -> None:
        self._images.pop((db, coll), None)

    def move(self, source: tuple[str, str], target: tuple[str, str]) -> None:
        self._images.pop(target, None)
        if source in self._images:
            self._images[target] = self._images.pop(source)


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
