"""The start-up check: can taskrunner run on this MongoDB server, as this user?

``TaskRunner.init`` and a starting worker read three replies (``buildInfo``: the version,
asked first since a server too old may not know ``hello``; ``hello``: replica set,
sharded cluster or standalone; ``connectionStatus`` with ``showPrivileges``: what the
connection's user may do) and say in one line each what will not work and what
taskrunner does instead, rather than failing later:

* a server older than ``MINIMUM``, or one without ``hello``, raises ``ServerTooOld`` (its
  commands would fail);
* a server without change streams (a standalone) means polling;
* an authenticated user without a privilege taskrunner uses is named with the action and
  the collection; a missing ``changeStream`` also means polling.

A connection without authenticated users has no privileges to check: the server runs
without access control (with access control, every command fails with "requires
authentication", which says so itself). docs/compatibility.md lists the versions,
docs/security.md the roles.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from taskrunner.errors import ServerTooOld
from taskrunner.store import fields as f

MINIMUM: Final = (4, 4, 2)
"""The oldest server taskrunner runs on: ``$unionWith`` and ``$isNumber`` are 4.4, the
``hello`` command (server time, this check) 4.4.2."""
MINIMUM_TEXT: Final = ".".join(map(str, MINIMUM))
WHY_MINIMUM: Final = "$unionWith and $isNumber need 4.4, the hello command 4.4.2"
LOWEST_TESTED: Final = (6, 0)
"""The oldest server the CI runs the whole suite against (docs/compatibility.md)."""

# Privilege actions (https://www.mongodb.com/docs/manual/reference/privilege-actions/).
FIND: Final = "find"
INSERT: Final = "insert"
UPDATE: Final = "update"
REMOVE: Final = "remove"
CHANGE_STREAM: Final = "changeStream"
CREATE_COLLECTION: Final = "createCollection"
CREATE_INDEX: Final = "createIndex"
DROP_INDEX: Final = "dropIndex"
LIST_INDEXES: Final = "listIndexes"
LIST_COLLECTIONS: Final = "listCollections"
COLL_MOD: Final = "collMod"
ANY_ACTION: Final = "anyAction"

Needs = Mapping[str, frozenset[str]]
"""Privilege actions by collection name ("" for the database itself)."""


class Topology(enum.StrEnum):
    """What ``hello`` says the server is."""

    REPLICA_SET = "replica set"
    SHARDED = "sharded cluster"
    STANDALONE = "standalone"


@dataclass(frozen=True, slots=True)
class Privilege:
    """One entry of ``connectionStatus``'s ``authenticatedUserPrivileges``."""

    resource: Mapping[str, Any]
    actions: frozenset[str]

    def covers(self, action: str, database: str, collection: str) -> bool:
        """Whether it grants ``action`` on the collection ("" for the database itself),
        by MongoDB's resource document rules: "" for db means every database, "" for
        collection every collection but the ``system.`` ones."""
        if action not in self.actions and ANY_ACTION not in self.actions:
            return False
        if self.resource.get(f.ANY_RESOURCE) is True:
            return True
        db, coll = self.resource.get(f.RESOURCE_DB), self.resource.get(f.RESOURCE_COLLECTION)
        if db not in (database, "") or not isinstance(coll, str):
            return False
        if not collection:  # a database action needs a database resource
            return coll == ""
        return coll == collection or (coll == "" and not collection.startswith("system."))


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a server says about itself and about this connection's user."""

    version: tuple[int, ...]
    """``(7, 0, 2)``; empty when the server did not say."""
    topology: Topology
    change_streams: bool
    """Whether change streams open here (a replica set or a sharded cluster)."""
    users: tuple[str, ...] = ()
    """Authenticated users as ``name@db``; none: no access control to check."""
    privileges: tuple[Privilege, ...] = ()

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version)) or "(version unknown)"

    def allows(self, action: str, database: str, collection: str = "") -> bool:
        """Whether the user may (always, without authenticated users)."""
        return not self.users or any(p.covers(action, database, collection) for p in self.privileges)


@dataclass(frozen=True, slots=True)
class ServerCheck:
    """What the start-up check found: ``server`` (None for a store without one, the
    ``MemoryStore``), whether change streams can be followed (``streams``), and one line
    per problem (``warnings``), each saying what taskrunner does instead."""

    server: ServerInfo | None = None
    streams: bool = True
    warnings: tuple[str, ...] = ()


def read_server(
    hello: Mapping[str, Any], build_info: Mapping[str, Any], status: Mapping[str, Any]
) -> ServerInfo:
    """A ``ServerInfo`` from the replies of ``hello``, ``buildInfo`` and ``connectionStatus``
    (``showPrivileges: true``); change streams as the topology implies."""
    topology = _topology(hello)
    auth = status.get(f.AUTH_INFO)
    auth = auth if isinstance(auth, Mapping) else {}
    return ServerInfo(
        version=_version(build_info),
        topology=topology,
        change_streams=topology is not Topology.STANDALONE,
        users=tuple(_users(auth.get(f.AUTHENTICATED_USERS) or [])),
        privileges=tuple(_privileges(auth.get(f.AUTHENTICATED_PRIVILEGES) or [])),
    )


def too_old(build_info: Mapping[str, Any]) -> bool:
    """Whether ``buildInfo`` reports a version below ``MINIMUM`` (asked first: such a
    server may not know ``hello``)."""
    version = _version(build_info)
    return bool(version) and version < MINIMUM


def _topology(hello: Mapping[str, Any]) -> Topology:
    if hello.get(f.HELLO_MSG) == f.IS_DBGRID:
        return Topology.SHARDED
    return Topology.REPLICA_SET if hello.get(f.SET_NAME) else Topology.STANDALONE


def _version(build_info: Mapping[str, Any]) -> tuple[int, ...]:
    """``versionArray`` without its build number, else the leading numbers of ``version``."""
    array = build_info.get(f.VERSION_ARRAY)
    if isinstance(array, list) and array and all(isinstance(n, int) for n in array):
        return tuple(array[:3])
    match = re.match(r"(\d+(?:\.\d+)*)", str(build_info.get(f.SERVER_VERSION, "")))
    return tuple(int(n) for n in match.group(1).split(".")[:3]) if match else ()


def _users(users: list[Any]) -> Iterator[str]:
    for user in users:
        if isinstance(user, Mapping):
            yield f"{user.get(f.USER)}@{user.get(f.USER_DB)}"


def _privileges(privileges: list[Any]) -> Iterator[Privilege]:
    for privilege in privileges:
        if not isinstance(privilege, Mapping):
            continue
        resource, actions = privilege.get(f.RESOURCE), privilege.get(f.ACTIONS)
        if isinstance(resource, Mapping) and isinstance(actions, list):
            yield Privilege(resource, frozenset(str(a) for a in actions))


def worker_needs(collection: str, *, task_stream: bool, schedules: bool) -> Needs:
    """What a worker does to each collection (docs/security.md): claims and outcomes are
    updates, beats and declarations upserts, and schedules publish their ticks' tasks."""
    written = frozenset({FIND, INSERT, UPDATE})
    tasks = {FIND, UPDATE} | ({INSERT} if schedules else set()) | ({CHANGE_STREAM} if task_stream else set())
    needs = {
        collection: frozenset(tasks),
        f"{collection}.{f.REGISTRY_SUFFIX}": written | {REMOVE},
        f"{collection}.{f.LIMITS_SUFFIX}": written | {CHANGE_STREAM},
        f"{collection}.{f.GATES_SUFFIX}": written,  # any name may get a fleet-wide limit
    }
    if schedules:
        needs[f"{collection}.{f.SCHEDULES_SUFFIX}"] = written
    return needs


def init_needs(collection: str, *, validator: bool, retention: bool) -> Needs:
    """What ``init`` does: list and create the collections, their indexes, optionally the
    validator (``collMod``) and the retention TTL index (read, dropped when it changes)."""
    tasks = {CREATE_COLLECTION, CREATE_INDEX}
    tasks |= {COLL_MOD} if validator else set()
    tasks |= {LIST_INDEXES, DROP_INDEX} if retention else set()
    return {
        "": frozenset({LIST_COLLECTIONS}),
        collection: frozenset(tasks),
        f"{collection}.{f.REGISTRY_SUFFIX}": frozenset({CREATE_COLLECTION, CREATE_INDEX}),
    }


def judge(info: ServerInfo, database: str, needs: Needs, *, polling: str) -> ServerCheck:
    """Raise ``ServerTooOld`` below ``MINIMUM``; otherwise one warning per problem.
    ``polling`` says what happens without change streams (e.g. "polling every 5 s")."""
    if info.version and info.version < MINIMUM:
        raise ServerTooOld(info.version_text, MINIMUM_TEXT, WHY_MINIMUM)
    warnings: list[str] = []
    if not info.version:
        warnings.append("the server did not report its version (buildInfo); the start-up check cannot tell")
    elif info.version < LOWEST_TESTED:
        lowest = ".".join(map(str, LOWEST_TESTED))
        warnings.append(f"MongoDB {info.version_text} is older than {lowest}, the oldest version tested")
    if not info.change_streams:
        warnings.append(
            f"MongoDB {info.version_text} is a {info.topology}, which has no change streams: "
            f"{polling} (a replica set, even of one node, gives instant pickup)"
        )
    missing = _missing(info, database, needs)
    streams = info.change_streams and not any(CHANGE_STREAM in actions for actions in missing.values())
    warnings += _privilege_lines(info, database, missing, polling)
    return ServerCheck(info, streams, tuple(warnings))


def _missing(info: ServerInfo, database: str, needs: Needs) -> dict[str, list[str]]:
    """Actions the user lacks, by collection (change streams only where the server has them)."""
    missing: dict[str, list[str]] = {}
    for collection, actions in needs.items():
        wanted = actions if info.change_streams else actions - {CHANGE_STREAM}
        lacking = sorted(a for a in wanted if not info.allows(a, database, collection))
        if lacking:
            missing[collection] = lacking
    return missing


def _privilege_lines(
    info: ServerInfo, database: str, missing: dict[str, list[str]], polling: str
) -> list[str]:
    user = " and ".join(info.users)
    streams = [c for c, actions in missing.items() if CHANGE_STREAM in actions]
    others = {c: [a for a in actions if a != CHANGE_STREAM] for c, actions in missing.items()}
    lines = []
    if streams:
        where = ", ".join(_namespace(database, c) for c in streams)
        lines.append(f"user {user} may not open change streams (changeStream) on {where}: {polling}")
    lacking = "; ".join(f"{', '.join(a)} on {_namespace(database, c)}" for c, a in others.items() if a)
    if lacking:
        lines.append(
            f"user {user} lacks {lacking}: those operations will fail (docs/security.md lists the roles)"
        )
    return lines


def _namespace(database: str, collection: str) -> str:
    return f"{database}.{collection}" if collection else f"database {database}"


class ServerReader(Protocol):
    """What the check reads the server through: a ``Store`` (this module is below it)."""

    async def server_info(self) -> ServerInfo | None: ...


async def check(store: ServerReader, database: str, needs: Needs, *, polling: str) -> ServerCheck:
    """Read the server behind ``store`` (three commands) and ``judge`` it."""
    info = await store.server_info()
    return ServerCheck() if info is None else judge(info, database, needs, polling=polling)
