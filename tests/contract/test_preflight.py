"""The start-up check (taskrunner.store.preflight): server replies judged, the worker's and
init's reactions, and what the embedded server and a real MongoDB answer."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import structlog
from pymongo import errors as pe
from structlog.testing import capture_logs
from typer.testing import CliRunner

from taskrunner import MemoryStore, ServerCheck, ServerInfo, ServerTooOld, TaskContext, TaskRunner
from taskrunner.cli import app
from taskrunner.engine.worker import Worker
from taskrunner.errors import StoreUnavailable
from taskrunner.store.base import ChangeStream
from taskrunner.store.mongo import MongoStore
from taskrunner.store.preflight import (
    CHANGE_STREAM,
    LOWEST_TESTED,
    MINIMUM,
    Privilege,
    Topology,
    init_needs,
    judge,
    read_server,
    worker_needs,
)
from taskrunner.store.preflight import check as preflight_check
from taskrunner.testing import wait_for

DB = "taskrunner"
POLLING = "polling for tasks every 5 s instead"
REPLICA_SET_HELLO = {"isWritablePrimary": True, "setName": "rs0", "hosts": ["mongo:27017"], "ok": 1.0}
NO_AUTH = {"authInfo": {"authenticatedUsers": [], "authenticatedUserPrivileges": []}, "ok": 1.0}


def build_info(version: str) -> dict[str, Any]:
    numbers = [int(n) for n in version.split("-")[0].split(".")]
    return {"version": version, "versionArray": [*numbers, 0], "ok": 1.0}


def status(*privileges: tuple[dict[str, Any], list[str]]) -> dict[str, Any]:
    """A connectionStatus reply for user ``worker@admin`` holding ``privileges``."""
    listed = [{"resource": resource, "actions": actions} for resource, actions in privileges]
    users = [{"user": "worker", "db": "admin"}]
    return {"authInfo": {"authenticatedUsers": users, "authenticatedUserPrivileges": listed}, "ok": 1.0}


def server(version: str = "7.0.2", hello: dict[str, Any] | None = None, auth: Any = None) -> ServerInfo:
    return read_server(hello or REPLICA_SET_HELLO, build_info(version), auth or NO_AUTH)


def on(collection: str) -> dict[str, str]:
    return {"db": DB, "collection": collection}


ROLE = re.compile(r'role: "(\w+)".*?privileges: \[(.*?)\n  \]', re.DOTALL)
PRIVILEGE = re.compile(r'\{resource: \{db: "(\w*)", collection: "([\w.]*)"\}, actions: \[([^\]]*)\]\}')


def documented_roles() -> dict[str, tuple[tuple[dict[str, str], list[str]], ...]]:
    """The privileges of each role docs/security.md creates, read from its mongosh block."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    return {
        name: tuple(
            ({"db": db, "collection": coll}, re.findall(r'"(\w+)"', actions))
            for db, coll, actions in PRIVILEGE.findall(body)
        )
        for name, body in ROLE.findall(text)
    }


ROLES = documented_roles()
WORKER_ROLE = ROLES["taskrunnerWorker"]
READ_WRITE = (  # part of what the built-in readWrite role on the database shows
    (on(""), ["changeStream", "createIndex", "find", "insert", "listCollections", "remove", "update"]),
)


# -- the replies ------------------------------------------------------------------------------
def test_hello_tells_replica_sets_sharded_clusters_and_standalones_apart() -> None:
    """setName means a replica set, msg isdbgrid a mongos, neither a standalone; only the
    standalone is taken to have no change streams."""
    assert server().topology is Topology.REPLICA_SET and server().change_streams
    mongos = server(hello={"isWritablePrimary": True, "msg": "isdbgrid"})
    assert mongos.topology is Topology.SHARDED and mongos.change_streams
    standalone = server(hello={"isWritablePrimary": True})
    assert standalone.topology is Topology.STANDALONE and not standalone.change_streams


def test_the_version_comes_from_version_array_else_from_the_version_string() -> None:
    """versionArray drops its build number; without it the leading numbers of version count,
    and a reply with neither gives an empty version."""
    assert server("8.0.4").version == (8, 0, 4)
    assert read_server(REPLICA_SET_HELLO, {"version": "4.2.0-rc1"}, NO_AUTH).version == (4, 2, 0)
    unknown = read_server(REPLICA_SET_HELLO, {"ok": 1.0}, NO_AUTH)
    assert unknown.version == () and unknown.version_text == "(version unknown)"


def test_privileges_follow_mongodb_resource_rules() -> None:
    """A collection resource grants that collection; collection "" the database's
    non-system collections and database actions; db "" that name in every database;
    anyResource with anyAction everything; the cluster resource no collection."""
    exact = Privilege(on("tasks"), frozenset({"find"}))
    assert exact.covers("find", DB, "tasks")
    assert not exact.covers("find", DB, "tasks.workers") and not exact.covers("update", DB, "tasks")
    whole = Privilege(on(""), frozenset({"find", "listCollections"}))
    assert whole.covers("find", DB, "tasks.workers") and whole.covers("listCollections", DB, "")
    assert not whole.covers("find", DB, "system.js") and not whole.covers("find", "other", "tasks")
    assert not exact.covers("listCollections", DB, "")
    everywhere = Privilege({"db": "", "collection": "tasks"}, frozenset({"find"}))
    assert everywhere.covers("find", "other", "tasks")
    assert Privilege({"anyResource": True}, frozenset({"anyAction"})).covers("collMod", DB, "tasks")
    assert not Privilege({"cluster": True}, frozenset({"find"})).covers("find", DB, "tasks")


# -- the verdict --------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["3.6.23", "4.2.24", "4.4.1"])
def test_a_server_older_than_the_minimum_raises_naming_both_versions(version: str) -> None:
    """Below 4.4.2 ($unionWith, $isNumber, hello) the check raises ServerTooOld with the
    version found and the minimum, before anything else."""
    with pytest.raises(ServerTooOld) as raised:
        judge(server(version), DB, worker_needs("tasks", task_stream=True, schedules=False), polling=POLLING)
    assert raised.value.version == version and raised.value.minimum == "4.4.2"
    assert f"MongoDB {version} is older than 4.4.2" in str(raised.value)


def test_a_tested_replica_set_without_access_control_passes_silently() -> None:
    """A tested replica set without users gives no warning and follows streams; the
    minimum itself runs too, with one line saying it is older than the lowest tested."""
    needs = worker_needs("tasks", task_stream=True, schedules=True)
    checked = judge(server("8.0.4"), DB, needs, polling=POLLING)
    assert checked == ServerCheck(server("8.0.4"), streams=True, warnings=())
    minimum, lowest = (".".join(map(str, v)) for v in (MINIMUM, LOWEST_TESTED))
    at_minimum = judge(server(minimum), DB, needs, polling=POLLING)
    assert at_minimum.warnings == (f"MongoDB {minimum} is older than {lowest}, the oldest version tested",)


def test_a_standalone_is_one_line_naming_the_polling_fallback() -> None:
    """A server without change streams is one warning that names the topology and what the
    worker does instead; its changeStream privilege is then not asked for."""
    standalone = server(hello={"isWritablePrimary": True}, auth=status(*WORKER_ROLE[1:]))
    needs = {"tasks": frozenset({CHANGE_STREAM, "find", "update"})}
    checked = judge(standalone, DB, needs, polling=POLLING)
    assert not checked.streams
    assert checked.warnings == (
        "MongoDB 7.0.2 is a standalone, which has no change streams: polling for tasks every 5 s "
        "instead (a replica set, even of one node, gives instant pickup)",
        "user worker@admin lacks find, update on taskrunner.tasks: those operations will fail "
        "(docs/security.md lists the roles)",
    )


def test_the_roles_of_this_page_cover_what_they_are_for() -> None:
    """docs/security.md's roles as written: the worker role satisfies a worker, with the
    scheduler role one whose app declares schedules, the admin role init with validator
    and retention; so does readWrite on the database for a worker."""
    assert {"taskrunnerWorker", "taskrunnerScheduler", "taskrunnerAdmin"} <= set(ROLES)
    worker, scheduler = ROLES["taskrunnerWorker"], ROLES["taskrunnerScheduler"]
    cases = [
        (worker, worker_needs("tasks", task_stream=True, schedules=False)),
        (worker + scheduler, worker_needs("tasks", task_stream=True, schedules=True)),
        (ROLES["taskrunnerAdmin"], init_needs("tasks", validator=True, retention=True)),
        (READ_WRITE, worker_needs("tasks", task_stream=True, schedules=True)),
    ]
    for privileges, needs in cases:
        checked = judge(server(auth=status(*privileges)), DB, needs, polling=POLLING)
        assert checked.streams and checked.warnings == ()
    without = judge(server(auth=status(*worker)), DB, cases[1][1], polling=POLLING)
    assert without.warnings == (
        "user worker@admin lacks insert on taskrunner.tasks; find, insert, update on "
        "taskrunner.tasks.schedules: those operations will fail (docs/security.md lists the roles)",
    )


def test_missing_privileges_are_one_line_naming_actions_and_namespaces() -> None:
    """A user without the limits, gates and registry privileges gets one line listing each
    missing action with its namespace (the stream's own line apart)."""
    only_tasks = status((on("tasks"), ["find", "update", "changeStream"]))
    checked = judge(
        server(auth=only_tasks), DB, worker_needs("tasks", task_stream=True, schedules=False), polling=POLLING
    )
    assert checked.warnings == (
        "user worker@admin may not open change streams (changeStream) on taskrunner.tasks.limits: "
        "polling for tasks every 5 s instead",
        "user worker@admin lacks find, insert, remove, update on taskrunner.tasks.workers; "
        "find, insert, update on taskrunner.tasks.limits; find, insert, update on taskrunner.tasks.gates: "
        "those operations will fail (docs/security.md lists the roles)",
    )
    assert not checked.streams


def test_init_needs_database_and_collection_actions() -> None:
    """init asks listCollections on the database, collMod only with the validator, and
    listIndexes/dropIndex only with retention."""
    plain = init_needs("tasks", validator=False, retention=False)
    assert plain[""] == {"listCollections"} and plain["tasks"] == {"createCollection", "createIndex"}
    full = init_needs("tasks", validator=True, retention=True)
    assert full["tasks"] >= {"collMod", "listIndexes", "dropIndex"}
    assert judge(server(auth=status(*ROLES["taskrunnerAdmin"])), DB, full, polling=POLLING).warnings == ()
    no_db = status((on("tasks"), ["createCollection", "createIndex", "listCollections"]))
    [line] = judge(server(auth=no_db), DB, plain, polling=POLLING).warnings
    assert line.startswith("user worker@admin lacks listCollections on database taskrunner; ")


# -- MongoStore against fake replies ---------------------------------------------------------------
class FakeStream:
    async def close(self) -> None:
        return None


class FakeCollection:
    """A collection whose ``watch`` fails like a standalone mongod, or opens."""

    def __init__(self, streams: bool) -> None:
        self.streams, self.watched = streams, 0

    async def watch(self, pipeline: Any, **options: Any) -> FakeStream:
        self.watched += 1
        if not self.streams:
            raise pe.OperationFailure("The $changeStream stage is only supported on replica sets", 40573)
        return FakeStream()


class FakeClient:
    """Answers hello, buildInfo and connectionStatus from dicts; counts the commands."""

    def __init__(self, hello: dict[str, Any], streams: bool) -> None:
        self.replies = {"hello": hello, "buildInfo": build_info("7.0.2"), "connectionStatus": NO_AUTH}
        self.commands: list[tuple[str, dict[str, Any]]] = []
        self.collection = FakeCollection(streams)
        self.admin = self

    async def command(self, name: str, **options: Any) -> dict[str, Any]:
        self.commands.append((name, options))
        if name not in self.replies:  # as a server answers a command it does not have
            raise pe.OperationFailure(f"no such command: '{name}'", 59)
        return self.replies[name]

    def __getitem__(self, name: str) -> Any:
        return self if name == DB else self.collection

    def get_database(self, name: str, **options: Any) -> Any:
        return self[name]

    def get_collection(self, name: str, **options: Any) -> Any:
        return self.collection


@pytest.mark.parametrize("streams", [False, True])
async def test_mongo_store_asks_for_a_stream_only_when_hello_says_standalone(streams: bool) -> None:
    """Three commands (connectionStatus with showPrivileges); a standalone-looking server is
    asked to open a change stream, and only its answer decides (a look-alike may serve them)."""
    client = FakeClient({"isWritablePrimary": True}, streams)
    info = await MongoStore(cast("Any", client), DB, "tasks").server_info()
    assert [name for name, _ in client.commands] == ["buildInfo", "hello", "connectionStatus"]
    assert client.commands[2][1] == {"showPrivileges": True}
    assert info.topology is Topology.STANDALONE and info.change_streams is streams
    assert client.collection.watched == 1
    replica = FakeClient(REPLICA_SET_HELLO, streams=False)
    assert (await MongoStore(cast("Any", replica), DB, "tasks").server_info()).change_streams
    assert replica.collection.watched == 0


@pytest.mark.parametrize("version", ["4.2.24", "4.4.1"])
async def test_a_server_without_hello_is_judged_by_its_build_info(version: str) -> None:
    """A server older than 4.4.2 may not know ``hello``: buildInfo is asked first and its
    version alone makes the check raise ServerTooOld (not "start-up check skipped")."""
    client = FakeClient({}, streams=False)
    del client.replies["hello"]
    client.replies["buildInfo"] = build_info(version)
    store = MongoStore(cast("Any", client), DB, "tasks")
    with pytest.raises(ServerTooOld, match=f"MongoDB {re.escape(version)} is older than 4.4.2"):
        await preflight_check(
            store, DB, worker_needs("tasks", task_stream=True, schedules=False), polling=POLLING
        )
    assert [name for name, _ in client.commands] == ["buildInfo"]


async def test_a_server_that_lacks_hello_is_too_old_whatever_it_reports() -> None:
    """No ``hello`` means older than 4.4.2, even when buildInfo gives no version to judge."""
    client = FakeClient({}, streams=False)
    del client.replies["hello"]
    client.replies["buildInfo"] = {"ok": 1.0}
    with pytest.raises(ServerTooOld, match=r"\(version unknown\) is older than 4\.4\.2"):
        await MongoStore(cast("Any", client), DB, "tasks").server_info()


# -- the worker and init ---------------------------------------------------------------------------
class Reporting(MemoryStore):
    """An in-memory store that reports ``info`` as its server; streams must not be opened
    when the info says there are none."""

    def __init__(self, info: ServerInfo | Exception) -> None:
        super().__init__()
        self.info, self.streams_opened, self.inits = info, 0, 0

    async def server_info(self) -> ServerInfo:
        if isinstance(self.info, Exception):
            raise self.info
        return self.info

    async def watch(self, **options: Any) -> ChangeStream:
        self.streams_opened += 1
        return await super().watch(**options)

    async def watch_limits(self) -> ChangeStream:
        self.streams_opened += 1
        return await super().watch_limits()

    async def init(
        self,
        *,
        validator: bool = False,
        retain_finished: float | None = None,
        retain_failed: float | None = None,
    ) -> None:
        self.inits += 1


def job_runner(store: MemoryStore) -> tuple[TaskRunner, list[str]]:
    runner, done = TaskRunner(store=store), []

    @runner.task("job")
    async def job(params: dict[str, Any], ctx: TaskContext) -> None:
        done.append(ctx.key)

    return runner, done


async def run_until_done(worker: Worker, done: list[str]) -> None:
    running = asyncio.create_task(worker.run())
    try:
        await wait_for(lambda: done == ["a"], 20, "the task to run", interval=0.02)
    finally:
        worker.stop()
        await running


async def test_a_worker_on_a_standalone_warns_once_and_polls_from_the_start() -> None:
    """One warning naming the poll interval; no stream is ever opened, no second warning
    about failing streams, and tasks still run."""
    store = Reporting(server(hello={"isWritablePrimary": True}))
    runner, done = job_runner(store)
    await runner.publish("job", key="a")
    with capture_logs() as logs:  # before the worker binds its logger, which keeps the processors of then
        worker = Worker(runner, worker_id="w", poll_interval=0.2)
        await run_until_done(worker, done)
    warnings = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warnings == [
        "MongoDB 7.0.2 is a standalone, which has no change streams: polling for tasks every 0.2 s "
        "instead (a replica set, even of one node, gives instant pickup)"
    ]
    assert worker.discovery.by_choice and not worker.limits.follow and store.streams_opened == 0
    checked = next(e for e in logs if e["event"] == "server checked")
    assert checked["version"] == "7.0.2" and checked["topology"] == "standalone"


async def test_a_worker_refuses_a_server_older_than_the_minimum() -> None:
    """run() raises ServerTooOld before any side task starts: nothing is claimed."""
    store = Reporting(server("4.2.24"))
    runner, done = job_runner(store)
    await runner.publish("job", key="a")
    with pytest.raises(ServerTooOld, match=r"MongoDB 4\.2\.24 is older than 4\.4\.2"):
        await Worker(runner, worker_id="w").run()
    assert done == [] and await store.workers() == []


async def test_a_worker_names_missing_privileges_and_keeps_running() -> None:
    """Missing privileges are warnings: the worker says which and runs what it can."""
    only_tasks = status((on("tasks"), ["find", "update", "changeStream"]))
    runner, done = job_runner(Reporting(server(auth=only_tasks)))
    await runner.publish("job", key="a")
    with capture_logs() as logs:
        await run_until_done(Worker(runner, worker_id="w", poll_interval=0.2), done)
    lines = [e["event"] for e in logs if str(e["event"]).startswith("user worker@admin")]
    assert len(lines) == 2 and "lacks find, insert, remove, update on taskrunner.tasks.workers" in lines[1]


async def test_a_worker_starts_anyway_when_the_check_cannot_reach_the_server() -> None:
    """A server away at start: one warning that the check was skipped, and the worker runs."""
    runner, done = job_runner(Reporting(StoreUnavailable("MongoDB unavailable: no servers")))
    await runner.publish("job", key="a")
    with capture_logs() as logs:
        await run_until_done(Worker(runner, worker_id="w"), done)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["start-up check skipped"]


async def test_init_checks_before_it_creates_anything() -> None:
    """init raises ServerTooOld without touching the collection, and otherwise returns the
    check's warnings; the memory store has no server and no warnings."""
    old = Reporting(server("4.0.28"))
    with pytest.raises(ServerTooOld):
        await TaskRunner(store=old).init()
    assert old.inits == 0
    standalone = Reporting(server(hello={"isWritablePrimary": True}))
    checked = await TaskRunner(store=standalone).init()
    assert standalone.inits == 1 and not checked.streams
    assert (
        "workers will poll for tasks instead (every --poll-interval, 5 s by default)" in checked.warnings[0]
    )
    assert await TaskRunner(store=MemoryStore()).init() == ServerCheck()


# -- real servers ---------------------------------------------------------------------------------
@pytest.mark.mongo
async def test_init_on_the_test_server_passes_the_check(mongo_uri: str, collection_name: str) -> None:
    """The suite's server (embedded, or TASKRUNNER_TEST_MONGO_URI's replica set) is new
    enough, has change streams and gives init nothing to warn about."""
    async with TaskRunner(mongo_uri, collection=collection_name) as runner:
        checked = await runner.init()
    assert checked.server is not None and checked.server.version >= MINIMUM
    assert checked.streams and checked.warnings == ()


@pytest.mark.embedded
async def test_the_embedded_server_reports_7_0_as_a_replica_set(
    embedded_uri: str, collection_name: str
) -> None:
    """The embedded server answers hello as a one-member replica set (setName, so change
    streams without a probe), buildInfo 7.0.0 and connectionStatus without users."""
    store = MongoStore.connect(embedded_uri, collection=collection_name)
    try:
        info = await store.server_info()
    finally:
        await store.close()
    assert info == ServerInfo((7, 0, 0), Topology.REPLICA_SET, change_streams=True)


@pytest.mark.embedded
def test_cli_init_prints_each_warning_on_stderr(
    embedded_uri: str, collection_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`taskrunner init` prints the check's lines as "warning: ..." on stderr and still
    initialises; a server too old is one error line and exit 1."""

    async def standalone(self: MongoStore) -> ServerInfo:
        return server(hello={"isWritablePrimary": True})

    monkeypatch.setattr(MongoStore, "server_info", standalone)
    env = {"TASKRUNNER_MONGO_URI": embedded_uri, "TASKRUNNER_COLLECTION": collection_name}
    result = CliRunner().invoke(app, ["init"], env=env)
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "warning: MongoDB 7.0.2 is a standalone, which has no change streams: workers will poll for "
        "tasks instead (every --poll-interval, 5 s by default) (a replica set, even of one node, "
        "gives instant pickup)\n"
    )
    assert result.stdout.startswith(f"initialised taskrunner.{collection_name}: indexes ")

    async def old(self: MongoStore) -> ServerInfo:
        return server("4.2.24")

    monkeypatch.setattr(MongoStore, "server_info", old)
    result = CliRunner().invoke(app, ["init"], env=env)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: MongoDB 4.2.24 is older than 4.4.2, the oldest version")


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """The `worker` command configures structlog to write to CliRunner's stderr, which
    closes with the invocation: put the configuration back so later tests can log."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.mark.usefixtures("logging_restored")
def test_cli_worker_refuses_a_server_too_old_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """`taskrunner worker` on a server older than 4.4.2 exits 1 with one error line naming
    both versions, before it claims anything (no server needed: the check's reply is faked)."""

    async def old(self: MongoStore) -> ServerInfo:
        return server("4.2.24")

    monkeypatch.setattr(MongoStore, "server_info", old)
    env = {"TASKRUNNER_MONGO_URI": "mongodb://127.0.0.1:1", "TASKRUNNER_TIMEOUT": "1"}
    result = CliRunner().invoke(
        app, ["worker", "--app", "examples.app:runner", "--log-format", "json"], env=env
    )
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: MongoDB 4.2.24 is older than 4.4.2, the oldest version taskrunner runs on ($unionWith "
        "and $isNumber need 4.4, the hello command 4.4.2); upgrade the server (docs/compatibility.md)"
    ]
