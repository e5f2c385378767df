"""Every mongo-shell query in docs/*.md runs in the real ``mongosh`` and returns what the docs say.

The convention (docs/operations.md, "Mongo-shell queries"): a ```js fenced block is one
mongo-shell **expression** (comments allowed, no ``use``), and the line right before its
fence is an HTML comment naming the expected result:

- ``<!-- expect: count=3 -->``: the result (a cursor, an array or a number) has 3 documents
  or is the number 3;
- ``<!-- expect: keys=["img:43","img:44"] -->``: the documents' ``key`` fields, in this order;
- ``<!-- expect: keyset=["mail:1","mail:4"] -->``: the same in any order;
- ``<!-- expect: match=[{"_id": "w1", "n": 2}] -->``: the relaxed EJSON result contains this
  (objects: every listed field, recursively; arrays: same length, element by element;
  the string ``"<date>"`` matches any date).

Sample documents (not queries) use other fence languages (``jsonc``); a block in any
other language that runs ``db.`` commands fails the test, as does an expectation with
no query under it. The queries run against a fresh ``taskrunner dev-server`` with sample
data published through the Python API and driven through states with the store API,
plus raw updates for what only time can do (expired leases, old timestamps). With
``TASKRUNNER_TEST_MONGO_URI`` they also run against that MongoDB, in a scratch database.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import runs
from mongosh import mongosh_path
from pymongo import AsyncMongoClient, MongoClient
from workers import dev_server

from taskrunner import TaskRunner
from taskrunner.models import TaskError, WorkerInfo
from taskrunner.workflows.settling import follow_up

DOCS = Path(__file__).resolve().parents[2] / "docs"
EXPECT = re.compile(r"<!--\s*expect:\s*(?P<kind>count|keys|keyset|match)=(?P<value>.*?)\s*-->")
FENCE = re.compile(r"^\s*```(?P<lang>[\w-]*)")
SHELL_COMMAND = re.compile(r"^\s*db(\.|\[)", re.MULTILINE)
ANY_DATE = "<date>"

# The sample workers: A and B are alive, C stopped beating (its leases expired).
A, B, C = "host-1234-ab12cd", "host-5678-ef34ab", "host-9012-cd56ef"


@dataclass(frozen=True)
class Query:
    """One ```js block of a doc and the expectation written above it."""

    file: str
    line: int
    code: str
    kind: str | None
    expected: Any

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def parse_docs(docs: Path = DOCS) -> tuple[list[Query], list[str]]:
    """All ```js blocks of ``docs/*.md`` with their expectations, and every convention breach."""
    queries: list[Query] = []
    problems: list[str] = []
    for path in sorted(docs.glob("*.md")):
        lines = path.read_text().splitlines()
        index = 0
        while index < len(lines):
            opening = FENCE.match(lines[index])
            if opening is None:
                if EXPECT.fullmatch(lines[index].strip()) and not _opens_js(lines, index + 1):
                    problems.append(f"{path.name}:{index + 1}: expectation not followed by a ```js block")
                index += 1
                continue
            end = next((i for i in range(index + 1, len(lines)) if FENCE.match(lines[i])), len(lines))
            code = "\n".join(lines[index + 1 : end])
            where = f"{path.name}:{index + 1}"
            if opening["lang"] == "js":
                query, problem = _query(path.name, index + 1, code, lines[index - 1] if index else "")
                queries.append(query)
                if problem:
                    problems.append(f"{where}: {problem}")
            elif SHELL_COMMAND.search(code):
                problems.append(f"{where}: mongo-shell commands in a ```{opening['lang']} block, not ```js")
            index = end + 1
    return queries, problems


def _opens_js(lines: list[str], index: int) -> bool:
    opening = FENCE.match(lines[index]) if index < len(lines) else None
    return opening is not None and opening["lang"] == "js"


def _query(file: str, line: int, code: str, before: str) -> tuple[Query, str | None]:
    found = EXPECT.fullmatch(before.strip())
    if found is None:
        return Query(
            file, line, code, None, None
        ), "```js block without <!-- expect: ... --> on the line above"
    try:
        expected = json.loads(found["value"])
    except json.JSONDecodeError as exc:
        return Query(file, line, code, None, None), f"expectation is not JSON: {exc}"
    return Query(file, line, code, found["kind"], expected), None


QUERIES, PROBLEMS = parse_docs()


def test_every_js_block_is_a_query_with_an_expectation() -> None:
    """Each ```js block has an expectation, each expectation a block, and shell code is only in ```js."""
    assert PROBLEMS == []
    assert {q.file for q in QUERIES} >= {"operations.md", "schema.md"}


# -- the server and its sample data ----------------------------------------------------


async def _load_sample(uri: str, database: str) -> None:
    """Tasks in every state the docs' queries look for, with timestamps relative to server now."""
    runner = TaskRunner(uri, database=database, collection="tasks")
    store = runner.store
    raw: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
    tasks, registry = raw[database]["tasks"], raw[database]["tasks.workers"]

    async def publish(name: str, key: str, **options: Any) -> None:
        # Hour-long leases: live sample runs must stay live however slowly mongosh runs.
        options = {"ping_interval": 60, "ping_timeout": 3600, **options}
        await runner.publish(name, {"n": key}, key=key, **options)
        await asyncio.sleep(0.01)  # distinct created_at

    async def claim(worker_id: str, key: str) -> str:
        claimed = await store.claim(worker_id, key=key)
        assert claimed is not None, (worker_id, key)
        return claimed.run_id

    async def fail(worker_id: str, key: str, kind: str, message: str) -> None:
        await runs.fail(store, key, await claim(worker_id, key), TaskError(type=kind, message=message))

    async def backdate(key: str, worker_id: str | None = None, **ago: timedelta) -> None:
        """Move task fields (or one worker entry's) into the past."""
        prefix = "" if worker_id is None else "workers.$."
        match = {"key": key} if worker_id is None else {"key": key, "workers.worker_id": worker_id}
        result = await tasks.update_one(match, {"$set": {prefix + k: now - d for k, d in ago.items()}})
        assert result.modified_count == 1, (key, worker_id, ago)

    try:
        await runner.init()
        now = await store.server_time()
        # resize: three PENDING (claim order img:43, img:44, img:41) and img:42 RUNNING on A.
        await publish("resize", "img:41")
        await publish("resize", "img:43", priority=5)
        await publish("resize", "img:44", priority=5)
        await publish("resize", "img:42", priority=5)
        await runs.ping(store, "img:42", await claim(A, "img:42"))
        # email: mail:1 and mail:4 RUNNING on C whose lease expired; mail:4 had one failure to spend.
        for key, budget in (("mail:1", 3), ("mail:4", 1)):
            await publish("email", key, max_failures=budget)
            await claim(C, key)
            minute = timedelta(minutes=1)
            await backdate(key, C, claimed_at=5 * minute, ping_at=1.5 * minute, expires_at=minute)
            await backdate(key, claimable_at=minute)
        # mail:2 failed on A a moment ago and runs on B; mail:3 spent its one failure on A.
        await publish("email", "mail:2", retry_backoff=0)
        await fail(A, "mail:2", "SMTPError", "connection refused")
        await runs.ping(store, "mail:2", await claim(B, "mail:2"))
        await publish("email", "mail:3", max_failures=1)
        await fail(A, "mail:3", "SMTPError", "mailbox full")
        # report: rep:1 failed 3 h ago, then succeeded on B; rep:2 succeeded 10 days ago;
        # rep:3 has run on B for 2 h (still pinging); rep:4 was canceled before it started.
        await publish("report", "rep:1", max_failures=2, retry_backoff=0)
        await fail(A, "rep:1", "TimeoutError", "query timed out")
        await backdate("rep:1", A, claimed_at=timedelta(hours=3, minutes=1), finished_at=timedelta(hours=3))
        await runs.succeed(store, "rep:1", await claim(B, "rep:1"), {"rows": 10})
        await publish("report", "rep:2")
        await runs.succeed(store, "rep:2", await claim(A, "rep:2"), {"rows": 3})
        days = timedelta(days=10)
        await backdate("rep:2", created_at=days, run_at=days, updated_at=days, finished_at=days)
        await backdate("rep:2", A, claimed_at=days, ping_at=days, finished_at=days)
        await publish("report", "rep:3")
        await runs.ping(store, "rep:3", await claim(B, "rep:3"))
        await backdate("rep:3", B, claimed_at=timedelta(hours=2))
        await publish("report", "rep:4")
        await store.cancel("rep:4")
        # mail:5 failed on A with budget left: PENDING, its next attempt ten minutes away.
        await publish("email", "mail:5")
        error = TaskError(type="SMTPError", message="greylisted")
        await runs.fail(store, "mail:5", await claim(A, "mail:5"), error, retry_in=600)
        # rep:5 raised Fail on B: FAIL at once (fatal), its budget untouched.
        await publish("report", "rep:5")
        await runs.fail(
            store,
            "rep:5",
            await claim(B, "rep:5"),
            TaskError(type="Fail", message="no such team"),
            final=True,
        )
        # img:45 snoozed on A for ten minutes; the name "digest" is paused.
        await publish("resize", "img:45")
        await store.snooze("img:45", await claim(A, "img:45"), 600)
        await runner.pause("digest", force=True)  # no worker is live in the sample
        # "email" is declared with max_running=3; an operator set its rate to 10/s.
        await store.declare_limits("email", {"rate_limit": None, "max_running": 3, "limit_by": None})
        await runner.set_limits("email", rate_limit="10/s")
        # The registry: A and B beat; C stopped beating a minute ago.
        # Hour-long registrations: the live workers must stay live however slowly mongosh runs.
        for worker_id, names, running, ttl in (
            (A, ["resize", "email"], ["img:42"], 3600.0),
            (B, ["email", "report"], ["mail:2", "rep:3"], 3600.0),
            (C, ["email"], ["mail:1", "mail:4"], 10.0),
        ):
            await store.beat(
                WorkerInfo(
                    worker_id=worker_id,
                    host=worker_id.rsplit("-", 2)[0],
                    pid=1234,
                    started_at=now - timedelta(hours=3),
                    names=names,
                    concurrency=4,
                    running=running,
                    version="0.1.0",
                ),
                ttl=ttl,
            )
        ago = {"beat_at": now - timedelta(seconds=70), "expires_at": now - timedelta(seconds=60)}
        await registry.update_one({"_id": C}, {"$set": ago})
        await _sample_schedules(runner, now)
        await _sample_workflows(runner, tasks, now)
        await tasks.insert_many(_left_alone(now))
        await registry.update_one({"_id": A}, {"$set": {"schedules": ["nightly-report"]}})
    finally:
        await raw.close()
        await runner.close()


async def _sample_workflows(runner: TaskRunner, tasks: Any, now: datetime) -> None:
    """Two flows and a task others wait on (docs/workflows.md), driven through the store as a
    worker would, with the follow-ups left undone where a dead worker or publisher left them.

    etl:2026-11-26 runs: extract and transform SUCCESS, transform-2 released (PENDING),
    transform-3 SUCCESS whose worker died before the follow-up (it owes a ``notify``), load
    WAITING on transform-2 and transform-3. audit:1 was stored by a publisher that died
    before linking it (it owes a ``link``): WAITING on extract, which succeeded.
    etl:2026-11-25 failed a day ago: extract FAIL (budget spent), transform and load
    CANCELED in turn (UpstreamFailed)."""
    store = runner.store

    async def settle(key: str) -> None:
        """The follow-up the worker that ended ``key`` does (and those it causes)."""
        await follow_up(store, await store.follow_ups(keys=[key]))

    async def succeed(worker_id: str, key: str, result: Any) -> None:
        claimed = await store.claim(worker_id, key=key)
        assert claimed is not None, key
        await runs.succeed(store, key, claimed.run_id, result)

    failed = runner.flow("etl:2026-11-25")
    extract = failed.add("extract", {"day": "2026-11-25"}, max_failures=1)
    failed.chain(("transform", {"part": 1}), ("load", {"table": "sales"}), after=extract)
    await failed.publish()
    claimed = await store.claim(A, key="etl:2026-11-25/extract")
    assert claimed is not None
    error = TaskError(type="ConnectionError", message="source unreachable")
    await runs.fail(store, "etl:2026-11-25/extract", claimed.run_id, error)
    await settle("etl:2026-11-25/extract")
    # A day ago, one step after the other: extract failed, then transform and load were canceled.
    for key, ago in (("extract", 3), ("transform", 2), ("load", 1)):
        moment = now - timedelta(days=1, minutes=ago)
        published = now - timedelta(days=1, minutes=5)
        times = {"created_at": published, "run_at": published, "updated_at": moment, "finished_at": moment}
        await tasks.update_one({"key": f"etl:2026-11-25/{key}"}, {"$set": times})
    await tasks.update_one(
        {"key": "etl:2026-11-25/extract"},
        {
            "$set": {
                "workers.0.claimed_at": now - timedelta(days=1, minutes=4),
                "workers.0.finished_at": now - timedelta(days=1, minutes=3),
            }
        },
    )
    # Last, the follow-ups this sample leaves undone: no later write may do them.
    running = runner.flow("etl:2026-11-26")
    extract = running.add("extract", {"day": "2026-11-26"})
    parts = running.group(*[("transform", {"part": part}) for part in (1, 2, 3)], after=extract)
    running.add("load", {"table": "sales"}, after=parts)
    await running.publish()
    await succeed(A, "etl:2026-11-26/extract", {"rows": 3000})
    await settle("etl:2026-11-26/extract")
    await succeed(A, "etl:2026-11-26/transform", {"rows": 1000})
    await settle("etl:2026-11-26/transform")
    await succeed(B, "etl:2026-11-26/transform-3", {"rows": 1000})  # its follow-up: undone
    audit = runner.new_task({"name": "audit", "key": "audit:1", "after": ["etl:2026-11-26/extract"]})
    await store.publish([audit])  # stored, never linked


def _left_alone(now: datetime) -> list[dict[str, Any]]:
    """Documents written by hand that no worker ever reads as a task (docs/schema.md): no
    string key (nothing can address or normalize it), a name or a state that is not a
    string. Every documented query must run over them; those about tasks leave them out."""
    minute, day = timedelta(minutes=1), timedelta(days=1)
    expired = {
        "worker_id": C,
        "state": "RUNNING",
        "claimed_at": now - 120 * minute,
        "expires_at": now - minute,
    }
    failed = {
        "worker_id": A,
        "state": "FAIL",
        "finished_at": now - minute,
        "error": {"type": "X", "message": "x"},
    }
    return [
        {"name": "resize"},  # the one an operator inserts by mistake: only a name (unique: one)
        {"key": 7, "name": 7, "state": 7},
        {"key": 8, "name": "resize", "state": "PENDING", "priority": 9, "created_at": now - day},
        {"key": 9.5, "name": "email", "state": "RUNNING", "failures": 5, "workers": [expired]},
        {
            "key": False,
            "name": "report",
            "state": ["FAIL"],
            "finished_at": now - 10 * day,
            "workers": [failed],
        },
        # A string key, settled, but a name no worker can serve: it stays PENDING for good.
        {"key": "hand:1", "name": 42, "state": "PENDING", "created_at": now - day, "claimable_at": now - day},
    ]


async def _sample_schedules(runner: TaskRunner, now: datetime) -> None:
    """nightly-report (declared by A, fired last night) and cleanup (paused; no live worker declares it)."""
    runner.schedule(
        "digest", id="nightly-report", cron="0 2 * * *", timezone="Europe/Paris", params={"n": "nightly"}
    )
    runner.schedule("email", id="cleanup", every=timedelta(hours=1))
    for schedule in runner.schedules.values():
        await runner.store.declare_schedule(schedule, schedule.recurrence.after(now))
    nightly = runner.schedules["nightly-report"]
    tick = nightly.recurrence.latest(now)
    assert tick is not None
    [task] = await runner.store.publish([nightly.task(tick)])
    await runner.store.record_tick(nightly.id, None, tick, task.key, nightly.recurrence.after(now))
    await runner.pause_schedule("cleanup")


@dataclass(frozen=True)
class Target:
    """A server with the sample data loaded into ``database``."""

    uri: str
    database: str


@pytest.fixture(scope="module", params=[pytest.param("embedded", marks=pytest.mark.embedded), "external"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """The dev server (always) and TASKRUNNER_TEST_MONGO_URI (when set, in a scratch database)."""
    if request.param == "embedded":
        with dev_server() as (_, uri):
            asyncio.run(_load_sample(uri, "taskrunner"))
            yield Target(uri, "taskrunner")
        return
    external = os.environ.get("TASKRUNNER_TEST_MONGO_URI")
    if not external:
        pytest.skip("real MongoDB: set TASKRUNNER_TEST_MONGO_URI to run the docs' queries on it")
    database = f"taskrunner_docs_{uuid4().hex[:8]}"
    asyncio.run(_load_sample(external, database))
    try:
        yield Target(external, database)
    finally:
        client: MongoClient[dict[str, Any]] = MongoClient(external)
        with client:
            client.drop_database(database)


# -- running the queries ----------------------------------------------------------------

_SCRIPT = """db = db.getSiblingDB({database});
const result = (
{code}
);
print(EJSON.stringify(result !== null && typeof result === "object" && typeof result.toArray === "function"
  ? result.toArray() : result, {{relaxed: true}}));
"""


def _run(mongosh: Path, target: Target, query: Query, home: Path) -> Any:
    """Evaluate the query in mongosh; its relaxed-EJSON result, or an AssertionError."""
    code = query.code.rstrip().removesuffix(";")
    script = _SCRIPT.format(database=json.dumps(target.database), code=code)
    env = {**os.environ, "HOME": str(home), "DO_NOT_TRACK": "1"}
    done = subprocess.run(
        [str(mongosh), target.uri, "--quiet", "--norc", "--eval", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, f"{query.id}: mongosh failed:\n{done.stderr or done.stdout}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"{query.id}: mongosh printed nothing:\n{done.stderr}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def results(target: Target, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every query's result (or the AssertionError it raised), run in parallel mongosh processes."""
    mongosh = mongosh_path()
    home = tmp_path_factory.mktemp("mongosh-home")

    def run(query: Query) -> Any:
        try:
            return _run(mongosh, target, query, home)
        except AssertionError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip([q.id for q in QUERIES], pool.map(run, QUERIES), strict=True))


@pytest.mark.timeout(600)  # the first run installs mongosh with npm
@pytest.mark.parametrize("query", QUERIES, ids=[q.id for q in QUERIES])
def test_doc_query_returns_what_the_doc_says(query: Query, results: dict[str, Any]) -> None:
    """The query runs in mongosh and its result meets the expectation written above it."""
    assert query.kind is not None, f"{query.id}: no expectation (see the convention above)"
    result = results[query.id]
    if isinstance(result, AssertionError):
        raise result
    check(query.kind, query.expected, result)


def check(kind: str, expected: Any, result: Any) -> None:
    """Assert one expectation (``count``, ``keys``, ``keyset`` or ``match``) of a relaxed-EJSON result."""
    if kind == "count":
        assert (len(result) if isinstance(result, list) else result) == expected, result
    elif kind in ("keys", "keyset"):
        assert isinstance(result, list), result
        keys = [doc.get("key") for doc in result]
        # json.dumps orders keys of any type (a document written by hand may hold any)
        assert (keys if kind == "keys" else sorted(keys, key=json.dumps)) == (
            expected if kind == "keys" else sorted(expected, key=json.dumps)
        )
    else:
        mismatch = _mismatch(expected, result, "result")
        assert mismatch is None, f"{mismatch}\nresult: {json.dumps(result)}"


def _mismatch(expected: Any, actual: Any, path: str) -> str | None:
    if expected == ANY_DATE:
        ok = isinstance(actual, dict) and set(actual) == {"$date"} and _is_date(actual["$date"])
        return None if ok else f"{path}: expected a date, got {actual!r}"
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{path}: expected an object, got {actual!r}"
        for name, value in expected.items():
            if name not in actual:
                return f"{path}.{name}: missing"
            found = _mismatch(value, actual[name], f"{path}.{name}")
            if found:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return f"{path}: expected {len(expected)} items, got {actual!r}"
        return next(
            (
                m
                for i, (e, a) in enumerate(zip(expected, actual, strict=True))
                if (m := _mismatch(e, a, f"{path}[{i}]"))
            ),
            None,
        )
    return None if expected == actual else f"{path}: expected {expected!r}, got {actual!r}"


def _is_date(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def test_check_reads_the_convention() -> None:
    """The expectation kinds accept what they describe and reject near misses."""
    docs = [{"key": "a", "at": {"$date": "2026-01-01T00:00:00.000Z"}}, {"key": "b", "at": None}]
    check("count", 2, docs)
    check("count", 7, 7)
    check("keys", ["a", "b"], docs)
    check("keyset", ["b", "a"], docs)
    check("match", [{"key": "a", "at": ANY_DATE}, {"key": "b"}], docs)
    for kind, expected in [
        ("count", 3),
        ("keys", ["b", "a"]),
        ("match", [{"key": "a"}]),
        ("match", [{"key": "a"}, {"at": ANY_DATE}]),
        ("match", [{"x": 1}, {}]),
    ]:
        with pytest.raises(AssertionError):
            check(kind, expected, docs)


def test_parse_docs_flags_blocks_without_expectations(tmp_path: Path) -> None:
    """A bare ```js block, a dangling expectation and shell code outside ```js are all reported."""
    (tmp_path / "x.md").write_text(
        "<!-- expect: count=1 -->\n```js\ndb.tasks.find()\n```\n\n```js\ndb.tasks.find()\n```\n"
        "<!-- expect: count=2 -->\n\ntext\n```sh\necho\n```\n```text\ndb.tasks.drop()\n```\n"
    )
    queries, problems = parse_docs(tmp_path)
    assert [(q.line, q.kind, q.expected) for q in queries] == [(2, "count", 1), (6, None, None)]
    assert problems == [
        "x.md:6: ```js block without <!-- expect: ... --> on the line above",
        "x.md:9: expectation not followed by a ```js block",
        "x.md:15: mongo-shell commands in a ```text block, not ```js",
    ]
