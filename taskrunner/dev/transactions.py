"""Multi-document transactions as a replica-set primary runs them.

mongoeco gives each transaction a snapshot of the whole engine (copy-on-write), reads and
writes in it, and at commit installs it only if nothing at all was written since the
snapshot, with an error that has no code.  A server with a worker heartbeating never
commits then.  The bridge keeps mongoeco's snapshot (a transaction reads a consistent view
taken at its first statement, plus its own writes: MongoDB's ``snapshot`` read concern,
whatever level the client asks) and runs the rest as MongoDB does:

* Transaction numbers.  ``startTransaction`` with a newer ``txnNumber`` aborts the
  session's open transaction and starts one; an older number fails TransactionTooOld (225);
  a statement, ``commitTransaction`` or ``abortTransaction`` naming a transaction that is
  not open fails NoSuchTransaction (251, labelled TransientTransactionError), one naming a
  committed transaction TransactionCommitted (256).  ``commitTransaction`` sent again for
  a committed transaction (a driver retrying after UnknownTransactionCommitResult) answers
  as the first time, without committing anything again.
* Write conflicts, per document and unique key.  A transaction that writes a document
  another open transaction has written, or that was written (by anyone) after its snapshot,
  fails WriteConflict (112, TransientTransactionError) and is aborted, so
  ``with_transaction`` retries it; so does one that writes a value of a unique index
  (``_id`` or secondary, partial ones aside) another open transaction wrote.  Two
  transactions inserting one ``_id`` or upserting one unique key: the second fails
  WriteConflict; its retry, whose snapshot holds the first's committed document, fails
  DuplicateKey (11000) or updates it.  A unique key committed by a write after the
  snapshot is found at commit: that commit fails WriteConflict instead.
* Writes outside transactions.  An ``insert``, ``update``, ``delete`` or ``findAndModify``
  that targets a document an open transaction has written, inserts a unique key one holds,
  or upserts one by its filter, waits until that transaction commits or aborts, as
  MongoDB's does ("Production considerations": "the write waits until the transaction
  ends"; past its ``maxTimeMS`` it fails MaxTimeMSExpired), then runs.  What a write
  targets is found by a query just before it (a single-document write's first match by
  its sort), and only while some transaction holds something of that collection, so writes
  cost nothing extra otherwise.  A write that slips past (a transaction writing the same
  document meanwhile, or an update that sets a unique key a transaction holds) is not
  lost: the transaction then fails WriteConflict at commit.
* Commit.  The transaction's writes become visible at once: installed in one step between
  two commands of the event loop.  When other writes happened since the snapshot (to other
  documents), the transaction's final documents are applied to the current data in one
  mongoeco transaction instead.  Change streams get its events only at commit, in the
  transaction's order, all with the commit's cluster time and each with its ``lsid`` and
  ``txnNumber``, as MongoDB's (``taskrunner.dev.oplog``).
* Aborting.  ``abortTransaction``, a failed statement (a write error included, as on
  MongoDB), ``endSessions`` of its session, a newer ``startTransaction`` on the session and
  the lifetime limit abort a transaction.  The limit is ``transactionLifetimeLimitSeconds``
  (60 by default, settable with ``setParameter`` on admin as on MongoDB); a transaction
  older than it is aborted by a timer, and writes waiting for it go on.  A dropped
  connection does not abort a transaction (drivers may use another connection for its next
  statement), as on MongoDB: the lifetime limit does.
* Refusals inside a transaction: ``count`` fails OperationNotSupportedInTransaction (263);
  ``writeConcern`` on a statement and ``readConcern`` on any but the first fail
  InvalidOptions (72).  Creating a collection or an index implicitly is allowed (4.4+).
"""

from __future__ import annotations

import asyncio
import copy
import enum
import functools
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from taskrunner.dev import patches
from taskrunner.dev.oplog import Entry, Oplog
from taskrunner.dev.retryable import MAX_SESSIONS
from taskrunner.dev.wire import MONGOECO_AVAILABLE, failure, plain_int

if MONGOECO_AVAILABLE:
    from mongoeco.errors import OperationFailure

DEFAULT_LIFETIME_SECONDS = 60  # MongoDB's transactionLifetimeLimitSeconds default
TRANSIENT = "TransientTransactionError"
LIFETIME_PARAMETER = "transactionLifetimeLimitSeconds"

_WRITES = {"insert": "documents", "update": "updates", "delete": "deletes", "findAndModify": None}
_ENDING = {"commitTransaction", "abortTransaction"}

# What a transaction holds: a document (index "_id_", its _id) or a unique secondary key
# (the index's name and the key's values): db, collection, index, repr of the value(s).
DocKey = tuple[str, str, str, str]
UniqueIndex = tuple[str, list[str], bool]  # name, fields, sparse
Run = Callable[[], Awaitable[dict[str, Any]]]


class _State(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class _Transaction:
    session: str
    lsid: Any
    number: int
    snapshot_seq: int
    state: _State = _State.OPEN
    writes: set[DocKey] = field(default_factory=set)
    seen_changes: int = 0  # how many of mongoeco's pending changes were checked for conflicts
    statements: int = 0
    started: float = field(default_factory=time.monotonic)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None


def write_conflict() -> Exception:
    return failure(
        "Write conflict during plan execution and yielding is disabled."
        " :: Please retry your operation or multi-document transaction.",
        112,
        "WriteConflict",
        TRANSIENT,
    )


def _no_such_transaction(number: int, aborted: bool) -> Exception:
    message = (
        f"Transaction with {{ txnNumber: {number} }} has been aborted."
        if aborted
        else f"Given transaction number {number} does not match any in-progress transactions."
    )
    return failure(message, 251, "NoSuchTransaction", TRANSIENT)


def _doc_key(db: str, coll: str, document_key: Any) -> DocKey | None:
    if not isinstance(document_key, dict) or "_id" not in document_key:
        return None
    return db, coll, "_id_", repr(document_key["_id"])


_ABSENT = object()


def _path(document: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(document, dict) or part not in document:
            return _ABSENT
        document = document[part]
    return document


def _unique_keys(
    db: str, coll: str, values: Callable[[str], Any], indexes: list[UniqueIndex], *, whole: bool = False
) -> list[DocKey]:
    """The unique keys of a document (``values`` reads a field): missing fields index as null,
    as MongoDB's, except in a sparse index, which skips documents missing them all; ``whole``:
    only keys whose every field has a value (a filter's, which may not name them all)."""
    keys = []
    for name, fields, sparse in indexes:
        found = [values(f) for f in fields]
        if whole and any(v is _ABSENT for v in found):
            continue
        if sparse and all(v is _ABSENT for v in found):
            continue
        keys.append((db, coll, name, repr([None if v is _ABSENT else v for v in found])))
    return keys


def _query_value(query: Any, field: str) -> Any:
    """The value a filter requires of ``field`` by equality (what an upsert would insert)."""
    value = query.get(field, _ABSENT) if isinstance(query, dict) else _ABSENT
    return _ABSENT if _is_operator(value) else value


class Transactions:
    """The server's transactions, by session (see the module docstring)."""

    def __init__(self, client: Any, sessions: Any, oplog: Oplog) -> None:
        self._client = client
        self._engine = client._engine
        self._sessions = sessions  # mongoeco's wire session store
        self._oplog = oplog
        self.lifetime_seconds: float = DEFAULT_LIFETIME_SECONDS
        self._open: dict[str, _Transaction] = {}  # the latest transaction of each session
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._holders: dict[DocKey, _Transaction] = {}
        self._held_namespaces: Counter[tuple[str, str]] = Counter()
        self._written: dict[DocKey, int] = {}  # oplog position of each document's last write
        self._open_count = 0
        self._starting: dict[str, int] = {}  # snapshot positions of transactions being started
        self._reapers: set[asyncio.Task[None]] = set()
        # Commits, and writes outside transactions while any is open: a commit applied beside
        # other writes (``_rebase``) awaits, and no write may land in between.
        self._gate = asyncio.Lock()
        oplog.on_entry = self._on_entry

    # Hooks from the bridge.

    def before_build(self, body: dict[str, Any]) -> None:
        """Called before mongoeco resolves a command's session (and, for ``startTransaction``,
        takes its snapshot): a newer transaction ends the session's open one first."""
        if body.get("startTransaction") is not True or "lsid" not in body:
            return
        number = plain_int(body.get("txnNumber"))
        if type(number) is not int:
            return
        key = patches.wire_session_key(body["lsid"])
        current = self._open.get(key)
        if current is not None and number <= current.number:
            return  # refused in execute
        if current is not None and current.state is _State.OPEN:
            self._abort(current)
        else:  # one mongoeco started for a start the bridge refused (a stepdown, a fail point)
            patches.abort_wire_transaction(self._sessions, key)
        patches.dispatch_changes(self._client)  # the snapshot holds every write the oplog has
        self._starting[key] = self._oplog.next_seq

    def settled(self, body: dict[str, Any]) -> None:
        """Called once a command has been answered or refused: a start that did not reach
        ``execute`` holds back nothing."""
        if self._starting and body.get("startTransaction") is True and "lsid" in body:
            self._starting.pop(patches.wire_session_key(body["lsid"]), None)

    async def execute(self, name: str, db: str, body: dict[str, Any], run: Run) -> dict[str, Any]:
        """Run command ``name`` (``run`` executes it in mongoeco) as MongoDB would."""
        if name in ("setParameter", "getParameter") and LIFETIME_PARAMETER in body:
            return self._parameter(name, db, body)
        if name == "endSessions":
            self._end_sessions(body.get("endSessions"))
            return await run()
        if body.get("autocommit") is False and "lsid" in body:
            key = patches.wire_session_key(body["lsid"])
            async with self._session_lock(key):
                return await self._in_transaction(key, name, body, run)
        if name in _WRITES:
            return await self._outside(name, db, body, run)
        return await run()

    # Statements of a transaction.

    async def _in_transaction(self, key: str, name: str, body: dict[str, Any], run: Run) -> dict[str, Any]:
        number = plain_int(body.get("txnNumber"))
        if type(number) is not int:
            raise failure("txnNumber must be provided for multi-document transactions", 72, "InvalidOptions")
        if body.get("startTransaction") is True:
            transaction = self._start(key, body, number)
        else:
            transaction = self._current(key, name, number)
            if name == "commitTransaction":
                return await self._commit(transaction)
            if name == "abortTransaction":
                self._abort(transaction)
                return {"ok": 1.0}
        _refuse(name, body, first=transaction.statements == 0)
        transaction.statements += 1
        try:
            reply = await run()
        except BaseException:
            self._abort(transaction)
            raise
        if reply.get("writeErrors") or not reply.get("ok", 1):
            self._abort(transaction)  # MongoDB aborts a transaction whose statement failed
        elif not await self._claim(transaction):
            self._abort(transaction)
            raise write_conflict()
        return reply

    def _start(self, key: str, body: dict[str, Any], number: int) -> _Transaction:
        current = self._open.get(key)
        if current is not None and number <= current.number:
            if current.state is not _State.OPEN:
                patches.abort_wire_transaction(self._sessions, key)  # mongoeco started one
            if number < current.number:
                raise failure(
                    f"Cannot start transaction {number} on session {key} because a newer"
                    f" transaction {current.number} has already started.",
                    225,
                    "TransactionTooOld",
                )
            raise failure(
                f"Transaction {number} has already started on session {key}.",
                117,
                "ConflictingOperationInProgress",
            )
        transaction = _Transaction(key, body["lsid"], number, self._starting.pop(key, self._oplog.next_seq))
        self._open.pop(key, None)
        self._open[key] = transaction  # the newest last, so that the oldest are pruned first
        self._open_count += 1
        self._prune()
        self._schedule_expiry(transaction)
        return transaction

    def _prune(self) -> None:
        """Forget the oldest ended transactions beyond ``MAX_SESSIONS`` sessions (a retried
        commit of one of them then fails NoSuchTransaction, as after MongoDB reaps a session)."""
        excess = len(self._open) - MAX_SESSIONS
        for key, transaction in list(self._open.items()):
            if excess <= 0:
                return
            if transaction.state is not _State.OPEN and not self._session_lock(key).locked():
                del self._open[key]
                del self._session_locks[key]
                excess -= 1

    def _current(self, key: str, name: str, number: int) -> _Transaction:
        transaction = self._open.get(key)
        if transaction is None or transaction.number != number:
            raise _no_such_transaction(number, aborted=False)
        if transaction.state is _State.ABORTED:
            raise _no_such_transaction(number, aborted=True)
        if transaction.state is _State.COMMITTED and name != "commitTransaction":
            raise failure(f"Transaction {number} has been committed.", 256, "TransactionCommitted")
        return transaction

    async def _claim(self, transaction: _Transaction) -> bool:
        """Take the documents and unique keys the transaction's last statement wrote; False on
        a conflict with another open transaction or with a write after its snapshot."""
        patches.dispatch_changes(self._client)  # every write committed so far is in the oplog
        changes = patches.pending_changes(self._engine, self._sessions, transaction.session)
        new, transaction.seen_changes = changes[transaction.seen_changes :], len(changes)
        unique: dict[tuple[str, str], list[UniqueIndex]] = {}
        for change in new:
            if not isinstance(change, dict):
                continue
            db, coll = change["db_name"], change["coll_name"]
            doc = _doc_key(db, coll, change.get("document_key"))
            if doc is None:
                continue
            if doc not in transaction.writes and self._written.get(doc, -1) >= transaction.snapshot_seq:
                return False
            held = [doc]
            image = change.get("full_document")
            if image is not None:
                if (db, coll) not in unique:
                    unique[db, coll] = await self._unique_indexes(db, coll)
                indexes = unique[db, coll]
                held += _unique_keys(db, coll, functools.partial(_path, image), indexes)
            if not self._hold(transaction, held):
                return False
        return True

    def _hold(self, transaction: _Transaction, keys: list[DocKey]) -> bool:
        for key in keys:
            holder = self._holders.get(key)
            if holder is not None and holder is not transaction and holder.state is _State.OPEN:
                return False
        for key in keys:
            if key not in transaction.writes:
                self._holders[key] = transaction
                self._held_namespaces[key[0], key[1]] += 1
                transaction.writes.add(key)
        return True

    async def _unique_indexes(self, db: str, coll: str) -> list[UniqueIndex]:
        """The collection's unique secondary indexes (partial ones left out: the embedded
        server does not evaluate their filters here)."""
        try:
            info = await self._client.get_database(db).get_collection(coll).index_information()
        except OperationFailure:
            return []
        return [
            (name, [field for field, _ in spec["key"]], bool(spec.get("sparse")))
            for name, spec in info.items()
            if name != "_id_" and spec.get("unique") and "partialFilterExpression" not in spec
        ]

    # Commit and abort.

    async def _commit(self, transaction: _Transaction) -> dict[str, Any]:
        if transaction.state is _State.COMMITTED:
            return {"ok": 1.0}  # a retried commit: already done, nothing runs again
        async with self._gate:
            patches.dispatch_changes(self._client)  # every write committed so far is in the oplog
            if any(self._written.get(doc, -1) >= transaction.snapshot_seq for doc in transaction.writes):
                self._abort(transaction)
                raise write_conflict()
            if patches.can_install(self._engine, self._sessions, transaction.session):
                self._publish(
                    transaction, lambda: patches.commit_wire_transaction(self._sessions, transaction.session)
                )
            else:
                await self._rebase(transaction)
        self._end(transaction, _State.COMMITTED)
        return {"ok": 1.0}

    def _publish(self, transaction: _Transaction, commit: Callable[[], None]) -> None:
        """Commit, and give the oplog the transaction's events with its lsid and txnNumber
        (no await between: nothing else is published in between)."""
        patches.dispatch_changes(self._client)  # others' changes first, without them
        with self._oplog.transaction(transaction.lsid, transaction.number):
            commit()
            patches.dispatch_changes(self._client)

    async def _rebase(self, transaction: _Transaction) -> None:
        """Apply the transaction's final documents to data that changed since its snapshot
        (other documents only: conflicts were checked), in one mongoeco transaction.  Indexes it
        created cannot be carried over so: such a commit fails WriteConflict (its retry commits
        when nothing else is written in the meantime)."""
        changes = patches.pending_changes(self._engine, self._sessions, transaction.session)
        final: dict[DocKey, dict[str, Any]] = {}
        for change in changes:
            if isinstance(change, dict):
                doc = _doc_key(change["db_name"], change["coll_name"], change.get("document_key"))
                if doc is not None:
                    final[doc] = change
        if patches.creates_indexes(self._engine, self._sessions, transaction.session) or any(
            c["operation_type"] != "delete" and c.get("full_document") is None for c in final.values()
        ):
            self._abort(transaction)
            raise write_conflict()
        session = self._client.start_session()
        try:
            session.start_transaction()
            for change in final.values():
                await self._apply(change, session)
            patches.replace_pending_changes(self._engine, session, changes)
            self._publish(transaction, session.commit_transaction)
        except OperationFailure as error:  # a unique key another commit took meanwhile
            if session.transaction_active:
                session.abort_transaction()
            self._abort(transaction)
            raise write_conflict() from error
        finally:
            session.close()
        patches.abort_wire_transaction(self._sessions, transaction.session)

    async def _apply(self, change: dict[str, Any], session: Any) -> None:
        collection = self._client.get_database(change["db_name"]).get_collection(change["coll_name"])
        selector = {"_id": change["document_key"]["_id"]}
        if change["operation_type"] == "delete":
            await collection.delete_one(selector, session=session)
        else:
            await collection.replace_one(selector, change["full_document"], upsert=True, session=session)

    def _abort(self, transaction: _Transaction) -> None:
        if transaction.state is not _State.OPEN:
            return
        patches.abort_wire_transaction(self._sessions, transaction.session)
        self._end(transaction, _State.ABORTED)

    def _end(self, transaction: _Transaction, state: _State) -> None:
        if transaction.state is _State.OPEN:
            self._open_count -= 1
        transaction.state = state
        for doc in transaction.writes:
            if self._holders.get(doc) is transaction:
                del self._holders[doc]
                self._held_namespaces[doc[0], doc[1]] -= 1
        self._held_namespaces = +self._held_namespaces
        if transaction.timer is not None:
            transaction.timer.cancel()
        transaction.ended.set()
        if not self._snapshots_open():
            self._written.clear()  # no snapshot is older than what comes next

    def _end_sessions(self, sessions: object) -> None:
        if not isinstance(sessions, list):
            return
        for lsid in sessions:
            key = patches.wire_session_key(lsid)
            transaction = self._open.pop(key, None)
            if transaction is not None:
                self._abort(transaction)
            lock = self._session_locks.get(key)
            if lock is not None and not lock.locked():
                del self._session_locks[key]

    # The lifetime limit.

    def _schedule_expiry(self, transaction: _Transaction) -> None:
        delay = max(0.0, transaction.started + self.lifetime_seconds - time.monotonic())
        transaction.timer = asyncio.get_running_loop().call_later(delay, self._expire, transaction)

    def _expire(self, transaction: _Transaction) -> None:
        task = asyncio.get_running_loop().create_task(self._expired(transaction))
        self._reapers.add(task)
        task.add_done_callback(self._reapers.discard)

    async def _expired(self, transaction: _Transaction) -> None:
        async with self._session_lock(transaction.session):  # after a statement in progress
            self._abort(transaction)

    def _parameter(self, name: str, db: str, body: dict[str, Any]) -> dict[str, Any]:
        if db != "admin":
            raise failure(f"{name} may only be run against the admin database.", 13, "Unauthorized")
        if name == "getParameter":
            return {LIFETIME_PARAMETER: _whole(self.lifetime_seconds), "ok": 1.0}
        value = plain_int(body[LIFETIME_PARAMETER])
        if type(value) is not int or value < 1:
            raise failure(f"{LIFETIME_PARAMETER} must be greater than or equal to 1s", 2, "BadValue")
        was, self.lifetime_seconds = self.lifetime_seconds, value
        for transaction in self._open.values():
            if transaction.state is _State.OPEN:
                if transaction.timer is not None:
                    transaction.timer.cancel()
                self._schedule_expiry(transaction)
        return {"was": _whole(was), "ok": 1.0}

    # Writes outside transactions.

    async def _outside(self, name: str, db: str, body: dict[str, Any], run: Run) -> dict[str, Any]:
        coll = body.get(name)
        max_time_ms = plain_int(body.get("maxTimeMS"))
        deadline = (
            time.monotonic() + max_time_ms / 1000 if type(max_time_ms) is int and max_time_ms > 0 else None
        )
        while isinstance(coll, str) and self._held_namespaces[db, coll]:
            holder = await self._holder_of_targets(name, db, coll, body)
            if holder is None:
                break
            await _wait(holder.ended, deadline)  # MongoDB: the write waits until the transaction ends
        if not self._open_count:
            # No transaction can be committing: writes go ahead without the gate (one that is
            # still running when a commit must be applied beside it fails that commit's
            # mongoeco transaction, a WriteConflict the client retries).
            return await run()
        async with self._gate:
            return await run()

    async def _holder_of_targets(
        self, name: str, db: str, coll: str, body: dict[str, Any]
    ) -> _Transaction | None:
        for key in await self._targets(name, db, coll, body):
            holder = self._holders.get(key)
            if holder is not None and holder.state is _State.OPEN:
                return holder
        return None

    async def _targets(self, name: str, db: str, coll: str, body: dict[str, Any]) -> list[DocKey]:
        """What the write would touch now: an insert's documents and their unique keys; the first
        match of a single-document statement (by its sort for findAndModify), every match of a
        multi one; and the ``_id`` and unique keys an upsert's filter would insert."""
        indexes = await self._unique_indexes(db, coll)
        if name == "insert":
            keys: list[DocKey] = []
            for document in body.get("documents") or []:
                if isinstance(document, dict) and "_id" in document:
                    keys.append((db, coll, "_id_", repr(document["_id"])))
                    keys += _unique_keys(db, coll, functools.partial(_path, document), indexes)
            return keys
        if name == "findAndModify":
            found = [(body.get("query") or {}, body.get("sort"), 1, body.get("upsert"))]
        elif name == "update":
            found = [
                (s.get("q") or {}, None, 0 if s.get("multi") else 1, s.get("upsert"))
                for s in body.get("updates") or []
                if isinstance(s, dict)
            ]
        else:
            found = [
                (s.get("q") or {}, None, plain_int(s.get("limit")) or 0, False)
                for s in body.get("deletes") or []
                if isinstance(s, dict)
            ]
        collection = self._client.get_database(db).get_collection(coll)
        keys = []
        for query, sort, limit, upsert in found:
            cursor = collection.find(copy.deepcopy(query), {"_id": 1}, sort=sort, limit=limit)
            keys += [(db, coll, "_id_", repr(d["_id"])) for d in await cursor.to_list(None)]
            if upsert:
                if (upserted := _query_value(query, "_id")) is not _ABSENT:
                    keys.append((db, coll, "_id_", repr(upserted)))
                value = functools.partial(_query_value, query)
                keys += _unique_keys(db, coll, value, indexes, whole=True)
        return keys

    def _on_entry(self, entry: Entry) -> None:
        if entry.coll is None or entry.document_key is None:
            return
        if self._snapshots_open():
            doc = _doc_key(entry.db, entry.coll, entry.document_key)
            if doc is not None:
                self._written[doc] = entry.seq

    def _snapshots_open(self) -> bool:
        return bool(self._starting) or self._open_count > 0

    def _session_lock(self, key: str) -> asyncio.Lock:
        return self._session_locks.setdefault(key, asyncio.Lock())


async def _wait(ended: asyncio.Event, deadline: float | None) -> None:
    """Wait for ``ended``, failing MaxTimeMSExpired (50) past ``deadline`` as MongoDB's
    waiting write does past its ``maxTimeMS``."""
    try:
        async with asyncio.timeout_at(None if deadline is None else _loop_time(deadline)):
            await ended.wait()
    except TimeoutError:
        raise failure("operation exceeded time limit", 50, "MaxTimeMSExpired") from None


def _loop_time(monotonic_deadline: float) -> float:
    return asyncio.get_running_loop().time() + monotonic_deadline - time.monotonic()


def _whole(seconds: float) -> int | float:
    return int(seconds) if float(seconds).is_integer() else seconds


def _is_operator(value: Any) -> bool:
    return isinstance(value, dict) and any(isinstance(k, str) and k.startswith("$") for k in value)


def _refuse(name: str, body: dict[str, Any], *, first: bool) -> None:
    """MongoDB's refusals of a statement inside a transaction."""
    if name == "count":
        raise failure(
            "Cannot run 'count' in a multi-document transaction.", 263, "OperationNotSupportedInTransaction"
        )
    if name in _ENDING:
        return
    if "writeConcern" in body:
        raise failure("Cannot set write concern after starting a transaction.", 72, "InvalidOptions")
    if "readConcern" in body and not first:
        raise failure(
            "Only the first command in a transaction may specify a readConcern", 72, "InvalidOptions"
        )
