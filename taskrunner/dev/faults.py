"""Faults for tests: the ``taskrunnerFault`` admin command, lost replies, closed connections.

``taskrunnerFault`` is not a MongoDB command; the embedded server answers it so that
tests can make it fail the ways a real deployment fails (docs/embedded-server.md)::

    {taskrunnerFault: "off"}                               -> {ok: 1}
    {taskrunnerFault: "endStreams", ns: "db.coll"}         -> {ok: 1, ended: n}
    {taskrunnerFault: "stepDown", seconds: 10}             -> {ok: 1}
    {taskrunnerFault: "loseReplies", every: 7, commands: [...]} -> {ok: 1}

A connection is closed without a reply by raising :class:`DropConnection` from the
executor: it passes mongoeco's ``except Exception`` in request dispatch, and the hook
installed on the proxy turns it into the ``ConnectionError`` on which the proxy's
connection handler closes the socket.  mongoeco's own ``failCommand`` fail point
(``configureFailPoint``) is applied here to the commands mongoeco does not dispatch
itself (the bridge's change streams and ``collMod``, ``getMore``, ``killCursors``,
``endSessions``), and its ``closeConnection: true`` closes the connection the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from taskrunner.dev.engine import current_message_size
from taskrunner.dev.replset import ReplicaSet, local_address
from taskrunner.dev.wire import MONGOECO_AVAILABLE, failure, plain_int

if MONGOECO_AVAILABLE:
    from mongoeco.errors import OperationFailure

FAULT_COMMAND = "taskrunnerFault"
DEFAULT_LOST_COMMANDS = ("insert", "update", "delete", "findAndModify")
# Commands mongoeco answers without its database-command path, which applies failCommand.
FAIL_POINT_COMMANDS = frozenset(
    {"getMore", "killCursors", "endSessions", "commitTransaction", "abortTransaction"}
)


class DropConnection(BaseException):
    """Close the client's connection without sending a reply (not an ``Exception``, so that
    mongoeco's dispatch does not turn it into an error reply)."""


def _bad_value(message: str) -> Exception:
    return failure(f"{FAULT_COMMAND}: {message}", 2, "BadValue")


def _positive_int(value: object, name: str) -> int:
    value = plain_int(value)
    if type(value) is not int or value < 1:
        raise _bad_value(f"{name} must be an integer >= 1")
    return value


def _commands(value: object) -> frozenset[str]:
    if value is None:
        return frozenset(DEFAULT_LOST_COMMANDS)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise _bad_value("commands must be a non-empty list of command names")
    return frozenset(value)


class Faults:
    """The server's switchable faults and the ``taskrunnerFault`` command that sets them."""

    def __init__(self, replica_set: ReplicaSet, end_streams: Callable[[str | None], int]) -> None:
        self._replica_set = replica_set
        self._end_streams = end_streams
        self._lose_every = 0
        self._lost_commands: frozenset[str] = frozenset()
        self._seen = 0

    def command(self, db: str, body: dict[str, Any]) -> dict[str, Any]:
        if db != "admin":
            raise failure(f"{FAULT_COMMAND} may only be run against the admin database.", 13, "Unauthorized")
        mode = body[FAULT_COMMAND]
        if mode == "off":
            self._replica_set.step_up()
            self._lose_every = 0
            return {"ok": 1.0}
        if mode == "endStreams":
            ns = body.get("ns")
            if ns is not None and not isinstance(ns, str):
                raise _bad_value('ns must be a "db.collection" string')
            return {"ok": 1.0, "ended": self._end_streams(ns)}
        if mode == "stepDown":
            seconds = plain_int(body.get("seconds"))
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
                raise _bad_value("seconds must be a number >= 0")
            self._replica_set.step_down(float(seconds))
            return {"ok": 1.0}
        if mode == "loseReplies":
            every, commands = _positive_int(body.get("every"), "every"), _commands(body.get("commands"))
            self._lose_every, self._lost_commands, self._seen = every, commands, 0
            return {"ok": 1.0}
        raise _bad_value(f"unknown mode {mode!r}; one of off, endStreams, stepDown, loseReplies")

    def loses_reply(self, command: str) -> bool:
        """Whether this executed ``command``'s reply is to be lost (every Nth matching one)."""
        if not self._lose_every or command not in self._lost_commands:
            return False
        self._seen += 1
        return self._seen % self._lose_every == 0


async def apply_fail_point(engine: Any, command: str, namespace: str | None) -> None:
    """Apply mongoeco's ``failCommand`` fail point to a command mongoeco does not dispatch,
    as mongoeco applies it to its own commands (a ``times`` mode counts it)."""
    state = getattr(engine, "_command_failpoint_state", None)
    if state is None:
        return  # no fail point was ever configured
    injection = state.consume_fail_command(command, namespace=namespace)
    if injection is None:
        return
    if injection.block_time_ms > 0:
        await asyncio.sleep(injection.block_time_ms / 1000)
    if injection.close_connection:
        raise DropConnection
    details: dict[str, Any] = {"failPoint": "failCommand", "commandName": command}
    code = injection.error_code
    if injection.write_concern_error is not None:
        details["writeConcernError"] = dict(injection.write_concern_error)
        code = injection.write_concern_error.get("code", code)
    raise OperationFailure(
        injection.error_message, code=code, details=details, error_labels=injection.error_labels
    )


def _format_address(sockname: Any) -> str | None:
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return None
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def connection_hooks(
    handle: Callable[..., Awaitable[None]], dispatch: Callable[..., Awaitable[bytes | None]]
) -> tuple[Callable[..., Awaitable[None]], Callable[..., Awaitable[bytes | None]]]:
    """The proxy's connection handler (made to record each connection's local address) and
    its request dispatch (made to record the message size, and to close a connection on
    DropConnection)."""

    async def handle_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        local_address.set(_format_address(writer.get_extra_info("sockname")))  # this task's context
        await handle(reader, writer)

    async def dispatch_or_drop(header: Any, payload: bytes, *, connection: Any) -> bytes | None:
        size = current_message_size.set(header.message_length)
        try:
            response: bytes | None = await dispatch(header, payload, connection=connection)
        except DropConnection:
            raise ConnectionAbortedError("connection closed without a reply (a test fault)") from None
        finally:
            current_message_size.reset(size)
        return response

    return handle_connection, dispatch_or_drop
