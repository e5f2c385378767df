"""Security: no code from documents, credentials never shown, the dev server stays local.

docs/security.md describes each property; docs/guarantees.md maps them to these tests.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from workers import TESTS_DIR, WorkerPool, wait_exit

import taskrunner
from taskrunner import NewTask, TaskRunner, TaskState
from taskrunner.dev.processes import free_port
from taskrunner.engine.execution import Execution, error_of
from taskrunner.observability.redact import redact
from taskrunner.store import rules
from taskrunner.store.memory import MemoryStore
from taskrunner.testing import wait_for

Doc = dict[str, Any]
SECRET = "s3cret"
PACKAGE = Path(taskrunner.__file__).resolve().parent
# Task names that look like code: none may ever be resolved to anything but a registered handler.
CODE_LIKE_NAMES = [
    "os.system",
    "taskrunner.cli:main",
    "__import__",
    "eval",
    "builtins.exec",
    "subprocess.run",
]


def secret_uri() -> str:
    return (
        f"mongodb://user:{SECRET}@127.0.0.1:{free_port()}/?serverSelectionTimeoutMS=300&connectTimeoutMS=300"
    )


# -- no code from documents ------------------------------------------------------------------
async def test_code_like_task_names_only_ever_reach_the_handler_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Even when a run is claimed for a name like os.system, nothing is imported or called: FAIL UnknownTaskName."""
    calls: list[object] = []

    def record(*args: object, **kwargs: object) -> int:
        calls.append(args)
        return 0

    monkeypatch.setattr(os, "system", record)
    import taskrunner.cli

    monkeypatch.setattr(taskrunner.cli, "main", record)
    modules = set(sys.modules)
    runner = TaskRunner(store=MemoryStore())

    @runner.task("quick")
    async def quick(params: dict[str, Any]) -> str:
        return "ok"

    for name in CODE_LIKE_NAMES:
        await runner.publish(
            name,
            {"command": "touch /tmp/pwned", "args": ["-rf", "/"]},
            key=name,
            max_failures=1,
            allow_unknown=True,
        )
        claim = await runner.store.claim("w1", key=name)  # no names filter: the worst case
        assert claim is not None
        await Execution(claim, store=runner.store, handlers=runner.handlers, worker_id="w1").run()
        task = await runner.get(name)
        error = task.last_error
        assert task.state is TaskState.FAIL and error is not None
        assert (error.type, error.message) == (
            "UnknownTaskName",
            f"name: no handler registered for task name {name!r} (known: quick)",
        )
    assert calls == []
    assert set(sys.modules) - modules == set()


async def test_worker_process_never_claims_unregistered_names(
    mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A worker process leaves published and hand-written tasks named like code PENDING and unclaimed."""
    pwned = tmp_path / "pwned"
    async with TaskRunner(mongo_uri, collection=collection_name) as runner:
        await runner.init()
        for name in CODE_LIKE_NAMES:
            await runner.publish(name, {"command": f"touch {pwned}"}, key=f"api-{name}")
        now = datetime.now(UTC)
        doc = rules.new_document(NewTask(key="by-hand", name="quick"), publish_id="by-hand")
        doc.update(
            {
                "name": "os.system",
                "params": {"command": f"touch {pwned}"},
                "created_at": now,
                "updated_at": now,
                "run_at": now,
                "claimable_at": now,
                "priority": 100,
            }
        )
        async with AsyncMongoClient[Doc](mongo_uri, tz_aware=True) as client:
            await client.taskrunner[collection_name].insert_one(doc)
        with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
            worker = pool.start("w1")
            await runner.publish("quick", key="normal")
            await wait_for(lambda: _succeeded(runner, "normal"), 30, "the registered task")
            assert worker.alive()
        for key in [*(f"api-{name}" for name in CODE_LIKE_NAMES), "by-hand"]:
            task = await runner.get(key)
            assert (task.state, task.attempts, task.workers) == (TaskState.PENDING, 0, []), key
    assert not pwned.exists()


async def _succeeded(runner: TaskRunner, key: str) -> bool:
    return (await runner.get(key)).state is TaskState.SUCCESS


# Patterns that would turn data into code; loader.py's importlib serves the operator's --app (importlib.metadata reads package versions, no code).
DANGEROUS = re.compile(
    r"\bpickle\b|\bcPickle\b|\bmarshal\b|\bshelve\b|(?<![\w.])(?:eval|exec|compile)\(|__import__\("
    r"|\bimportlib\b(?!\.metadata)|\byaml\.(?:unsafe_)?load\(|\bimport_string\b|\bpydoc\.locate\b"
)
ALLOWED = {
    ("loader.py", "import importlib"),
    ("loader.py", "return importlib.import_module(module_name)"),
    # The package's lazy exports (PEP 562): a module from its own fixed table, never a name from outside.
    ("__init__.py", "import importlib"),
    ("__init__.py", "value = getattr(importlib.import_module(module), name)"),
}


def test_source_never_evaluates_or_imports_by_name() -> None:
    """taskrunner/ uses no pickle, eval, exec, compile or __import__; importlib only in loader.py (--app) and the package's lazy exports."""
    hits = [
        (path.relative_to(PACKAGE).as_posix(), line.strip())
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in path.read_text().splitlines()
        if DANGEROUS.search(line) and not line.lstrip().startswith("#")
    ]
    assert set(hits) <= ALLOWED, hits
    assert ("loader.py", "import importlib") in hits  # the scan does see the one allowed use


def test_app_reference_comes_from_the_operator_only() -> None:
    """--app is read from the command line or TASKRUNNER_APP, never from a task document."""
    uses = [
        path.relative_to(PACKAGE).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        if "load_app(" in path.read_text() and path.name != "loader.py"
    ]
    assert uses == ["cli/options.py"], uses


# -- credentials -----------------------------------------------------------------------------
def test_redact_hides_userinfo_in_every_uri_form() -> None:
    for uri in (
        f"mongodb://user:{SECRET}@db1:27017,db2:27017/?replicaSet=rs0&authSource=admin",
        f"mongodb+srv://user:{SECRET}@cluster0.example.net/?tls=true",
        f"failed: mongodb://{SECRET}@host/db",
        f"mongodb://us%40er:{SECRET}%2F@host/",
    ):
        shown = redact(uri)
        assert SECRET not in shown and "***@" in shown, shown


def test_handler_errors_are_redacted_before_they_are_stored() -> None:
    """A handler exception quoting a URI is stored without the password (message and traceback)."""
    try:
        raise ConnectionError(f"cannot reach mongodb://app:{SECRET}@db:27017/prod")
    except ConnectionError as exc:
        error = error_of(exc)
    assert SECRET not in error.message and error.traceback is not None and SECRET not in error.traceback
    assert "mongodb://***@db:27017/prod" in error.message


async def test_worker_logs_never_show_the_password(collection_name: str, tmp_path: Path) -> None:
    """A worker on an unreachable server with credentials in its URI logs errors, never the password."""
    with WorkerPool(secret_uri(), collection_name, tmp_path, env={"TASKRUNNER_TIMEOUT": "1"}) as pool:
        worker = pool.start("w1")
        await wait_for(
            lambda: (
                [e for e in worker.logs() if e.get("level") in ("warning", "error")] or not worker.alive()
            ),
            30,
            "an error about the unreachable server",
        )
        await asyncio.sleep(1.0)  # a later line (one per outage) would be written by now
        if worker.alive():
            worker.terminate()
            await wait_exit(worker, 15)
        output = worker.log_path.read_text(errors="replace")
    assert "127.0.0.1" in output  # it did report the unreachable server
    assert SECRET not in output, output[-2000:]


@pytest.mark.parametrize(
    "args",
    [["show", "img:42"], ["publish", "quick", "--params", "{}"], ["list"], ["stats"], ["init"]],
    ids=["show", "publish", "list", "stats", "init"],
)
def test_cli_errors_never_show_the_password(args: list[str], tmp_path: Path) -> None:
    """CLI commands that cannot reach the server say so without the URI's password."""
    env = {**os.environ, "TASKRUNNER_MONGO_URI": secret_uri(), "TASKRUNNER_TIMEOUT": "1", "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "taskrunner", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "error" in output.lower(), output
    assert SECRET not in output, output


@pytest.mark.parametrize(
    "uri",
    [
        f"mongodb://user:{SECRET}@host:notaport/",
        f"mongodb://user:{SECRET}@/x",
        f"mongodb+srv://user:{SECRET}@cluster.example.net:27017/",
    ],
    ids=["bad-port", "no-host", "srv-with-port"],
)
@pytest.mark.parametrize("command", ["show", "worker"])
def test_bad_uri_errors_quote_the_uri_without_the_password(uri: str, command: str, tmp_path: Path) -> None:
    """A URI PyMongo refuses is quoted in the error with its userinfo replaced by ***."""
    args = ["show", "k"] if command == "show" else ["worker", "--app", "apps.acceptance_app:runner"]
    env = {
        **os.environ,
        "TASKRUNNER_MONGO_URI": uri,
        "TASKRUNNER_TIMEOUT": "1",
        "NO_COLOR": "1",
        "PYTHONPATH": str(TESTS_DIR),
    }
    done = subprocess.run(
        [sys.executable, "-m", "taskrunner", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "***@" in output and SECRET not in output, output


# -- the embedded dev server -----------------------------------------------------------------
@pytest.fixture
def dev_server(tmp_path: Path) -> Iterator[Callable[..., tuple[str, str]]]:
    """Starts ``taskrunner dev-server --port 0 ARGS``; returns (printed URI, stderr so far)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> tuple[str, str]:
        out, err = tmp_path / f"out{len(procs)}", tmp_path / f"err{len(procs)}"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "taskrunner", "dev-server", "--port", "0", *args],
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                cwd=TESTS_DIR,
            )
        procs.append(proc)
        deadline = time.monotonic() + 120  # a busy machine starts Python and mongoeco slowly
        while not out.read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        return out.read_text().strip(), err.read_text()

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.embedded
def test_dev_server_binds_loopback_by_default(dev_server: Callable[..., tuple[str, str]]) -> None:
    """The dev server listens on loopback only unless told otherwise, and then says nothing."""
    uri, stderr = dev_server()
    assert uri.startswith("mongodb://127.0.0.1:"), uri
    assert "WARNING" not in stderr


@pytest.mark.embedded
def test_dev_server_warns_loudly_when_exposed(dev_server: Callable[..., tuple[str, str]]) -> None:
    """--host 0.0.0.0 works but prints a warning that the server has no authentication."""
    _, stderr = dev_server("--host", "0.0.0.0")
    assert "WARNING" in stderr and "WITHOUT authentication" in stderr and "'0.0.0.0'" in stderr, stderr


@pytest.mark.embedded
def test_test_server_binds_loopback(embedded_uri: str) -> None:
    """The test suite's embedded server listens on loopback only."""
    assert embedded_uri.startswith("mongodb://127.0.0.1:"), embedded_uri
