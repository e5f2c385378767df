"""The embedded server as the primary of a one-member replica set, and a primary stepdown.

``hello`` names a replica set (``setName``, ``hosts``, ``primary``), as a
``mongod --replSet`` initiated alone does.  Drivers then treat the server as a
replica-set primary: PyMongo sends ``txnNumber`` with retryable writes (it does so
only for a replica-set primary or mongos with ``logicalSessionTimeoutMinutes``), and
``$readPreference: primaryPreferred`` on every read over a direct connection.

A stepdown (the test-only ``taskrunnerFault: "stepDown"``) makes the server a
secondary for some seconds, with the errors MongoDB gives (codes and labels from
the server's ``service_entry_point_common.cpp`` and ``error_labels.cpp``):

* writes: NotWritablePrimary (10107) "not primary", labelled RetryableWriteError
  when the write is retryable (``txnNumber``, no transaction);
* reads that may not run on a secondary (``find``, ``aggregate``, ``count``, ... without
  a ``$readPreference`` other than primary): NotPrimaryNoSecondaryOk (13435);
* operations in flight when it steps down, a change-stream ``getMore`` waiting for
  events included: InterruptedDueToReplStateChange (11602); the cursor is killed;
* ``hello``: ``isWritablePrimary: false``, ``secondary: true``, no ``primary``.

Errors of a change stream's ``aggregate`` or ``getMore`` with those codes carry the
ResumableChangeStreamError label, as MongoDB adds it, so drivers resume the stream.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from taskrunner.dev.wire import failure

T = TypeVar("T")
SET_NAME = "taskrunner"
WRITE_COMMANDS = frozenset(
    {
        "insert",
        "update",
        "delete",
        "findAndModify",
        "create",
        "drop",
        "dropDatabase",
        "createIndexes",
        "dropIndexes",
        "collMod",
        "renameCollection",
    }
)
# Commands a secondary runs only when the read preference allows it (AllowedOnSecondary::kOptIn).
OPT_IN_READS = frozenset(
    {"find", "aggregate", "count", "distinct", "listCollections", "listIndexes", "mapReduce"}
)
_HELLO_COMMANDS = frozenset({"hello", "isMaster", "ismaster"})
_RESUMABLE = "ResumableChangeStreamError"

# host:port of the connection's local end, set per connection: what the client dialled.
local_address: contextvars.ContextVar[str | None] = contextvars.ContextVar("local_address", default=None)


def is_hello(command: str) -> bool:
    return command in _HELLO_COMMANDS


def _is_retryable_write(body: dict[str, Any]) -> bool:
    return "txnNumber" in body and "autocommit" not in body


def _secondary_ok(body: dict[str, Any]) -> bool:
    preference = body.get("$readPreference")
    return isinstance(preference, dict) and preference.get("mode", "primary") != "primary"


def _stream_labels(command: str, change_stream: bool) -> tuple[str, ...]:
    return (_RESUMABLE,) if change_stream and command in ("aggregate", "getMore") else ()


def interrupted(command: str, change_stream: bool) -> Exception:
    return failure(
        "operation was interrupted",
        11602,
        "InterruptedDueToReplStateChange",
        *_stream_labels(command, change_stream),
    )


class ReplicaSet:
    """Replica-set state: primary, or stepped down until some time."""

    def __init__(self, fallback_address: str) -> None:
        self.fallback_address = fallback_address
        self._primary_at = 0.0  # monotonic time from which the server is primary again
        self._stepped_down = asyncio.Event()

    @property
    def is_primary(self) -> bool:
        return time.monotonic() >= self._primary_at

    def step_down(self, seconds: float) -> None:
        """Secondary for ``seconds``; operations in flight are interrupted."""
        self._primary_at = time.monotonic() + seconds
        stepped_down, self._stepped_down = self._stepped_down, asyncio.Event()
        stepped_down.set()

    def step_up(self) -> None:
        self._primary_at = 0.0

    def refusal(self, command: str, body: dict[str, Any], *, change_stream: bool) -> Exception | None:
        """The error MongoDB gives ``command`` on a secondary, if it refuses it."""
        if self.is_primary:
            return None
        if command in WRITE_COMMANDS:
            labels: tuple[str, ...] = ("RetryableWriteError",) if _is_retryable_write(body) else ()
            return failure("not primary", 10107, "NotWritablePrimary", *labels)
        if command in OPT_IN_READS and not _secondary_ok(body):
            labels = _stream_labels(command, change_stream)
            return failure("not primary and secondaryOk=false", 13435, "NotPrimaryNoSecondaryOk", *labels)
        return None

    def hello(self, reply: dict[str, Any]) -> dict[str, Any]:
        """mongoeco's ``hello`` reply as a replica-set member's."""
        address = local_address.get() or self.fallback_address
        primary = self.is_primary
        reply.update(setName=SET_NAME, setVersion=1, hosts=[address], me=address, secondary=not primary)
        if "ismaster" in reply:
            reply["ismaster"] = primary
        else:
            reply["isWritablePrimary"] = primary
        if primary:
            reply["primary"] = address
        return reply

    async def interruptible(self, operation: Coroutine[Any, Any, T], error: Exception) -> T:
        """Run ``operation``; if the server steps down meanwhile, cancel it and raise ``error``."""
        work = asyncio.ensure_future(operation)
        stepped_down = asyncio.ensure_future(self._stepped_down.wait())
        try:
            await asyncio.wait((work, stepped_down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stepped_down.cancel()
            if not work.done():
                work.cancel()
            # Retrieves its outcome whatever happens here (its error is raised below, or was
            # made moot by our own cancellation at server shutdown).
            await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            raise error
        return work.result()
