"""Retryable writes as a replica set runs them: a statement runs once per ``lsid`` + ``txnNumber``.

A driver retries a retryable write (``insert``, ``update``/``delete`` statements on one
document each, ``findAndModify``) once, with the same ``lsid`` and ``txnNumber``, when the
first attempt's reply was lost.  MongoDB remembers which statements of the session's
latest ``txnNumber`` ran (its per-session transaction record) and answers a retry
without running them again: the reply carries the first attempt's counts (``n``,
``nModified``, ``upserted``) or, for ``findAndModify``, its ``value``.  Statements that
did not run (they failed, or an ordered batch stopped before them) run on the retry.

A ``txnNumber`` older than the session's latest is refused (225, TransactionTooOld).
Writes that are not retryable (``multi: true`` updates, ``limit: 0`` deletes, writes in
a transaction, writes without ``txnNumber``) are never deduplicated, as on MongoDB.

Memory is bounded as MongoDB bounds its records: one record per session (the latest
``txnNumber``), dropped after the logical session timeout without use and, beyond
``max_sessions``, least recently used first.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from taskrunner.dev.wire import failure, plain_int

SESSION_TIMEOUT_SECONDS = 30 * 60.0  # MongoDB's logicalSessionTimeoutMinutes default
MAX_SESSIONS = 10_000
_STATEMENTS = {"insert": "documents", "update": "updates", "delete": "deletes"}
_WRITES = {*_STATEMENTS, "findAndModify"}


@dataclass(frozen=True, slots=True)
class RetryableWrite:
    """One retryable write command: its session, txnNumber and statements."""

    session: str
    txn_number: int
    command: str
    body: dict[str, Any]

    @property
    def statements(self) -> list[Any]:
        if self.command == "findAndModify":
            return [self.body]
        statements: list[Any] = self.body[_STATEMENTS[self.command]]
        return statements

    def only(self, indexes: list[int]) -> dict[str, Any]:
        """The command body restricted to the statements at ``indexes``."""
        body = dict(self.body)
        body[_STATEMENTS[self.command]] = [self.statements[i] for i in indexes]
        return body


def retryable_write(command: str, body: dict[str, Any], session: str | None) -> RetryableWrite | None:
    """``body`` as a retryable write, or None when MongoDB would not treat it as one."""
    txn_number = plain_int(body.get("txnNumber"))
    if session is None or command not in _WRITES or type(txn_number) is not int:
        return None
    if "autocommit" in body or "startTransaction" in body:
        return None  # a transaction: committed or aborted as a whole, not deduplicated
    write = RetryableWrite(session, txn_number, command, body)
    if command != "findAndModify":
        statements = body.get(_STATEMENTS[command])
        if not isinstance(statements, list) or not statements:
            return None
        if command == "update" and any(not isinstance(s, dict) or s.get("multi") for s in statements):
            return None
        if command == "delete" and any(
            not isinstance(s, dict) or plain_int(s.get("limit")) != 1 for s in statements
        ):
            return None
    return write


@dataclass(slots=True)
class _Record:
    """A session's latest txnNumber: which statements ran and the reply so far."""

    txn_number: int
    ran: set[int] = field(default_factory=set)
    reply: dict[str, Any] | None = None


@dataclass(slots=True)
class _Session:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    record: _Record | None = None
    used_at: float = field(default_factory=time.monotonic)


class RetryableWrites:
    """The per-session records of retryable writes the server has run."""

    def __init__(
        self, *, idle_seconds: float = SESSION_TIMEOUT_SECONDS, max_sessions: int = MAX_SESSIONS
    ) -> None:
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._idle_seconds = idle_seconds
        self._max_sessions = max_sessions

    def __len__(self) -> int:
        return len(self._sessions)

    async def execute(
        self, write: RetryableWrite, run: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any]:
        """Run the statements of ``write`` that have not run yet (``run`` executes a command
        body) and answer as MongoDB does, the first attempt's results included."""
        session = self._session(write.session)
        async with session.lock:  # MongoDB checks a session out to one operation at a time
            record = _current_record(session, write)
            pending = [i for i in range(len(write.statements)) if i not in record.ran]
            if not pending and record.reply is not None:
                return copy.deepcopy(record.reply)
            ran_all = len(pending) == len(write.statements)
            reply = await run(write.body if ran_all else write.only(pending))
            record.reply = _merge(write, record, pending, reply)
            return copy.deepcopy(record.reply)

    def _session(self, key: str) -> _Session:
        now = time.monotonic()
        session = self._sessions.pop(key, None)
        if session is not None and now - session.used_at > self._idle_seconds and not session.lock.locked():
            session = None  # expired, as MongoDB reaps an idle session's record
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            idle = now - oldest.used_at > self._idle_seconds
            if (not idle and len(self._sessions) < self._max_sessions) or oldest.lock.locked():
                break  # a session in use is dropped later, once its operation has ended
            self._sessions.popitem(last=False)
        session = session or _Session()
        session.used_at = now
        self._sessions[key] = session
        return session


def _current_record(session: _Session, write: RetryableWrite) -> _Record:
    record = session.record
    if record is not None and write.txn_number < record.txn_number:
        raise failure(
            f"Retryable write with txnNumber {write.txn_number} is prohibited on session"
            f" {write.session} because a newer retryable write with txnNumber"
            f" {record.txn_number} has already started on this session.",
            225,
            "TransactionTooOld",
        )
    if record is None or write.txn_number > record.txn_number:
        record = session.record = _Record(write.txn_number)
    return record


def _merge(
    write: RetryableWrite, record: _Record, pending: list[int], reply: dict[str, Any]
) -> dict[str, Any]:
    """Record which statements of ``pending`` ran and add their results to the record's."""
    if write.command == "findAndModify":
        record.ran.add(0)
        return reply
    errors = [dict(e, index=pending[e["index"]]) for e in reply.get("writeErrors") or []]
    failed = {e["index"] for e in errors}
    if errors and write.body.get("ordered", True) is not False:
        first_failed = pending.index(min(failed))
        record.ran.update(pending[:first_failed])
    else:
        record.ran.update(i for i in pending if i not in failed)
    merged = dict(reply)
    previous = record.reply or {}
    merged["n"] = previous.get("n", 0) + reply.get("n", 0)
    if write.command == "update":
        merged["nModified"] = previous.get("nModified", 0) + reply.get("nModified", 0)
        upserted = list(previous.get("upserted") or [])
        upserted += [dict(u, index=pending[u["index"]]) for u in reply.get("upserted") or []]
        if upserted:
            merged["upserted"] = sorted(upserted, key=lambda u: u["index"])
    merged.pop("writeErrors", None)
    if errors:
        merged["writeErrors"] = errors
    return merged
