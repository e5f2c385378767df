"""The taskrunner command as a user runs it: a subprocess against a MongoDB-compatible server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient
from rich.console import Console
from typer.testing import CliRunner

from taskrunner.cli import app, render
from taskrunner.models import Task

ROOT = Path(__file__).resolve().parents[2]


def cli(
    *args: str, uri: str, collection: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TASKRUNNER_MONGO_URI": uri, "TASKRUNNER_COLLECTION": collection, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "taskrunner", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=cwd,
    )


@pytest.mark.mongo
def test_init_publish_show_round_trip(mongo_uri: str, collection_name: str) -> None:
    """init is idempotent, publish prints the key, show --json returns the stored task."""
    for _ in range(2):
        assert cli("init", uri=mongo_uri, collection=collection_name).returncode == 0
    published = cli(
        "publish",
        "resize",
        "--params",
        '{"width": 3}',
        "--key",
        "img:1",
        "--priority",
        "4",
        uri=mongo_uri,
        collection=collection_name,
    )
    assert published.returncode == 0, published.stderr
    assert published.stdout.strip() == "img:1"
    # --mongo-uri beats the environment (which points nowhere here).
    shown = cli(
        "show",
        "img:1",
        "--json",
        "--mongo-uri",
        mongo_uri,
        uri="mongodb://127.0.0.1:9",
        collection=collection_name,
    )
    task = json.loads(shown.stdout)
    assert (task["key"], task["name"], task["params"], task["priority"], task["state"]) == (
        "img:1",
        "resize",
        {"width": 3},
        4,
        "PENDING",
    )
    table = cli("show", "img:1", uri=mongo_uri, collection=collection_name)
    assert table.returncode == 0 and "PENDING" in table.stdout and "img:1" in table.stdout


@pytest.mark.mongo
def test_worker_drain_runs_the_backlog_and_exits_0(mongo_uri: str, collection_name: str) -> None:
    """`worker --drain` runs what is claimable, leaves a task due tomorrow PENDING, and exits 0."""
    for key, extra in (("now:1", []), ("now:2", []), ("later", ["--delay", "86400"])):
        args = ("publish", "sleep", "--params", '{"seconds": 0}', "--key", key, *extra)
        assert cli(*args, uri=mongo_uri, collection=collection_name).returncode == 0
    drained = cli(
        "worker",
        "--app",
        "examples.app:runner",
        "--drain",
        uri=mongo_uri,
        collection=collection_name,
        cwd=ROOT,
    )
    assert drained.returncode == 0, drained.stderr
    states = {
        key: json.loads(cli("show", key, "--json", uri=mongo_uri, collection=collection_name).stdout)["state"]
        for key in ("now:1", "now:2", "later")
    }
    assert states == {"now:1": "SUCCESS", "now:2": "SUCCESS", "later": "PENDING"}


@pytest.mark.mongo
def test_publish_twice_reports_the_existing_task(mongo_uri: str, collection_name: str) -> None:
    """Publishing an existing key prints its key, says it was not created, and exits 0."""
    for _ in range(2):
        result = cli("publish", "job", "--key", "dup", uri=mongo_uri, collection=collection_name)
    assert result.returncode == 0 and result.stdout.strip() == "dup" and "not created" in result.stderr


@pytest.mark.mongo
def test_invalid_params_name_the_field_and_write_nothing(
    mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """Bad JSON, non-object params and params failing the app's model exit non-zero, nothing written."""
    (tmp_path / "demo_app.py").write_text(
        "from pydantic import BaseModel\nfrom taskrunner import TaskRunner\n"
        "class P(BaseModel):\n    width: int\n"
        "runner = TaskRunner()\n@runner.task('resize')\nasync def resize(params: P, ctx): ...\n"
    )
    cases = [
        (["--params", "{nope"], "params"),
        (["--params", "[1]"], "params"),
        (["--params", '{"width": "x"}', "--app", "demo_app:runner"], "params.width"),
        (["--concurrency", "0"], "options.concurrency"),
    ]
    for args, field in cases:
        result = cli("publish", "resize", *args, uri=mongo_uri, collection=collection_name, cwd=tmp_path)
        assert result.returncode != 0 and field in result.stderr, (args, result.stderr)
    with MongoClient[dict[str, object]](mongo_uri) as client:
        assert client.taskrunner[collection_name].count_documents({}) == 0
    missing = cli("show", "anything", uri=mongo_uri, collection=collection_name)
    assert missing.returncode == 1 and "no task with key 'anything'" in missing.stderr


@pytest.mark.mongo
def test_unreachable_server_fails_fast_with_redacted_uri(collection_name: str) -> None:
    """A dead server gives a clear error within the timeout and never prints the password."""
    result = cli(
        "show", "k", "--timeout", "1", uri="mongodb://user:s3cret@127.0.0.1:9/", collection=collection_name
    )
    assert result.returncode == 1 and "MongoDB unavailable" in result.stderr
    assert "s3cret" not in result.stderr + result.stdout


@pytest.mark.mongo
def test_show_json_stays_valid_json_in_a_narrow_terminal(mongo_uri: str, collection_name: str) -> None:
    """`show --json` at COLUMNS=40 prints JSON that parses, long values unbroken."""
    path = "/" + "very-long-directory-name/" * 6 + "image.png"
    long = {"path": path, "sizes": list(range(30))}
    published = cli(
        "publish",
        "resize",
        "--params",
        json.dumps(long),
        "--key",
        "k" * 60,
        uri=mongo_uri,
        collection=collection_name,
    )
    assert published.returncode == 0, published.stderr
    shown = cli("show", "k" * 60, "--json", uri=mongo_uri, collection=collection_name, env={"COLUMNS": "40"})
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["params"] == long
    table = cli("show", "k" * 60, uri=mongo_uri, collection=collection_name, env={"COLUMNS": "40"})
    assert "k" * 60 in table.stdout and path in table.stdout  # piped: one line per value


def _task_with_entries(**entry: Any) -> Task:
    now = datetime.now(UTC)
    run = {
        "worker_id": "worker-with-a-long-host-name-1234-abcdef",
        "run_id": "0123456789abcdef",
        "state": "SUCCESS",
        "claimed_at": now,
        "ping_at": now,
        "expires_at": now + timedelta(seconds=30),
        "finished_at": now,
        "result": {"resized": "/tmp/some/long/output/path/image-640x480.png"},
        **entry,
    }
    return Task.model_validate(
        {
            "key": "img:1",
            "name": "resize",
            "params": {"width": 640},
            "priority": 0,
            "created_at": now,
            "updated_at": now,
            "run_at": now,
            "options": {},
            "workers": [run],
            "state": "SUCCESS",
        }
    )


def test_show_never_cuts_a_value_in_a_narrow_terminal() -> None:
    """At 80 columns and less `show` cuts no cell ('…'): each value is whole, folded onto more lines if need be."""
    task = _task_with_entries()
    values = [task.workers[0].worker_id, "SUCCESS", json.dumps(task.workers[0].result), "img:1"]
    for width in (80, 50):
        console = Console(width=width, force_terminal=True, color_system=None)
        with console.capture() as captured:
            render.print_task(console, task)
        shown = captured.get()
        assert "…" not in shown and max(map(len, shown.splitlines())) <= width, shown
        unfolded = "".join(shown.split())
        assert all("".join(value.split()) in unfolded for value in values), shown


def test_help_shows_no_value_type_for_flags() -> None:
    """`--help` and flags such as `--json` show no `<bool>`: a flag takes no value."""
    for args in (["--help"], ["show", "--help"], ["schedules", "--help"], ["worker", "--help"]):
        result = CliRunner(env={"COLUMNS": "120"}).invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output and "--help" in result.output, result.output
    assert (
        "--timeout DURATION" in CliRunner().invoke(app, ["show", "--help"]).output
    )  # valued options keep theirs


def test_app_reference_errors_say_what_is_missing() -> None:
    """`--app` names the missing attribute or module on one line, never "NoneType", exit 1."""
    cases = {
        "examples.app:nosuch": f"module 'examples.app' (from {ROOT / 'examples' / 'app.py'}) has no attribute "
        "'nosuch' (its TaskRunner objects: runner)",
        "examples.nosuch:runner": "no module named 'examples.nosuch'",
        "examples.app:TaskRunner": "'TaskRunner' is a type, not a TaskRunner",
        "examples.app": "--app must look like MODULE:OBJECT",
    }
    for reference, message in cases.items():
        result = subprocess.run(
            [sys.executable, "-m", "taskrunner", "publish", "x", "--app", reference],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert result.returncode == 1 and message in result.stderr, (reference, result.stderr)
        assert "NoneType" not in result.stderr and "Traceback" not in result.stderr


_SIGNALLED = """
import asyncio, os, signal, sys
from taskrunner.cli.signals import REPEAT_AFTER, Signalled, cancelled_by_signal

async def work():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(30)
    finally:
        print("cleaned up", flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # the same request delivered again at once
        await asyncio.sleep(0.1)
        if sys.argv[1] == "twice":
            await asyncio.sleep(REPEAT_AFTER)  # a person pressing Ctrl-C again
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(30)

try:
    asyncio.run(cancelled_by_signal(work(), at_once="bye"))
except Signalled as stopped:
    print("stopped by", stopped.signum.name, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # a late duplicate, after the command
    print("exiting", flush=True)
"""


def test_first_signal_stops_gracefully_and_a_later_second_exits_at_once() -> None:
    """The first SIGTERM cancels the command and its cleanup runs; a signal within
    REPEAT_AFTER of it (or after the command) is the same request and changes nothing;
    one REPEAT_AFTER later exits 1 on the spot."""
    once = subprocess.run(
        [sys.executable, "-c", _SIGNALLED, "once"], capture_output=True, text=True, timeout=60
    )
    assert once.returncode == 0, once
    assert once.stdout.splitlines() == ["cleaned up", "stopped by SIGTERM", "exiting"], once
    assert once.stderr == "", once
    twice = subprocess.run(
        [sys.executable, "-c", _SIGNALLED, "twice"], capture_output=True, text=True, timeout=60
    )
    assert twice.returncode == 1 and "stopped by" not in twice.stdout, twice
    assert twice.stderr.count("second signal: bye") == 1, twice


# The project root at the end of sys.path, the current directory nowhere else: how uv's
# editable install runs the `taskrunner` script from a clone.
_LIKE_UV = (
    "import os, sys; sys.path.remove(''); sys.path.append(os.getcwd()); "
    "sys.argv = ['taskrunner', *sys.argv[1:]]; from taskrunner.cli import main; main()"
)


@pytest.mark.parametrize("module", ["sched", "calendar", "queue", "email"])
def test_app_in_the_current_directory_wins_or_the_error_names_the_file_loaded(
    module: str, tmp_path: Path
) -> None:
    """`--app sched:runner` loads ./sched.py, not the standard library's; where that cannot be
    (a module the engine imported first), the error names the file loaded and the one that was not."""
    local = tmp_path / f"{module}.py"
    local.write_text(
        "from taskrunner import MemoryStore, TaskRunner\nrunner = TaskRunner(store=MemoryStore())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", _LIKE_UV, "publish", "x", "--app", f"{module}:nosuch"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 1, result
    loaded = re.search(rf"module '{module}' \(from (\S+)\) has no attribute 'nosuch'", result.stderr)
    assert loaded is not None, result.stderr
    if module == "sched" or loaded[1] == str(local):
        assert loaded[1] == str(local) and "(its TaskRunner objects: runner)" in result.stderr, result.stderr
    else:
        assert Path(loaded[1]).is_relative_to(sysconfig.get_paths()["stdlib"]), result.stderr
        assert (
            f"{local} was not loaded: a module named '{module}' was imported before the app" in result.stderr
        )


def _click_commands() -> dict[str, Any]:
    """Every command and subcommand as click sees it, by its command line ("schedules pause")."""
    import typer.main

    root = typer.main.get_command(app)
    found: dict[str, Any] = {}

    def walk(prefix: str, group: Any) -> None:
        for name, command in group.commands.items():
            found[f"{prefix}{name}"] = command
            if hasattr(command, "commands"):
                walk(f"{prefix}{name} ", command)

    walk("", root)
    return found


# Every option that takes a time, by command.
DURATION_OPTIONS = {
    "publish": ["delay", "retry_backoff", "ping_interval", "ping_timeout", "run_timeout", "timeout"],
    "worker": ["shutdown_timeout", "poll_interval", "beat_interval", "timeout"],
    "wait": ["within", "timeout"],
    "purge": ["older_than", "timeout"],
    "show": ["timeout"],
}


def test_every_time_option_takes_a_duration() -> None:
    """`--delay 1m`, `--timeout 2s`, `--within 60s`: every time option takes seconds or a unit, shown as DURATION."""
    commands = _click_commands()
    for command_name, names in DURATION_OPTIONS.items():
        command = commands[command_name]
        context = command.make_context(
            command_name, ["k"] if command_name != "worker" else [], resilient_parsing=True
        )
        params = {p.name: p for p in command.params}
        for name in names:
            param = params[name]
            assert param.metavar == "DURATION", (command_name, name)
            assert param.process_value(context, "1m") == 60.0, (command_name, name)
            assert param.process_value(context, "1.5") == 1.5, (command_name, name)
    for command_name, command in commands.items():  # no time option left in plain seconds
        for param in command.params:
            assert not (getattr(param, "help", None) or "").lower().startswith("seconds"), (
                command_name,
                param.name,
            )


def test_help_names_types_a_reader_knows() -> None:
    """No option shows a Python type such as `<list[str]>`; `--log-format`, `--timeout` and `--run-timeout` say what they are."""
    runner = CliRunner(env={"COLUMNS": "200"})
    for command_name in ["", *_click_commands()]:
        shown = runner.invoke(app, [*command_name.split(), "--help"]).output
        assert not re.search(r"<(list|dict|tuple)\[|\[str\]", shown), (command_name, shown)
    publish = " ".join(runner.invoke(app, ["publish", "--help"]).output.split())
    assert "<list" not in publish and "--worker-id ID" in publish
    assert "not a task's time limit" in publish and "--timeout is the server's" in publish
    worker = " ".join(runner.invoke(app, ["worker", "--help"]).output.split())
    assert "json: one JSON object per line" in worker


def test_schedules_help_names_only_commands_that_exist() -> None:
    """`schedules --help` says the group lists schedules itself; it names no `list` command."""
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["schedules", "--help"])
    assert "without a command, list the stored ones" in result.output
    assert "list," not in result.output
    assert CliRunner().invoke(app, ["schedules", "list"]).exit_code == 2  # indeed no such command


def test_version_prints_the_package_version() -> None:
    """`taskrunner --version` prints `taskrunner X.Y.Z` and exits 0."""
    import taskrunner

    result = CliRunner().invoke(app, ["--version"])
    assert (result.exit_code, result.output) == (0, f"taskrunner {taskrunner.__version__}\n")


def test_help_lists_commands_in_the_order_of_docs_cli_md() -> None:
    """`taskrunner --help` starts with demo and dev-server, and lists commands in docs/cli.md's table order."""
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["--help"])
    listed = [line.split()[0] for line in result.output.split("Commands:")[1].strip().splitlines()]
    assert listed[:2] == ["demo", "dev-server"]
    table = (ROOT / "docs" / "cli.md").read_text().split("| command | does | API |")[1].split("\n\n")[0]
    documented = list(dict.fromkeys(re.findall(r"^\| `([a-z-]+)", table, re.M)))
    assert listed == documented


@pytest.mark.mongo
def test_output_to_a_pipe_has_no_padded_lines(mongo_uri: str, collection_name: str) -> None:
    """`show` and `stats` into a pipe print lines as wide as their content: none ends in padding."""
    published = cli(
        "publish",
        "resize",
        "--params",
        '{"width": 3}',
        "--key",
        "img:1",
        uri=mongo_uri,
        collection=collection_name,
    )
    assert published.returncode == 0, published.stderr
    for command in (["show", "img:1"], ["stats"], ["list"]):
        shown = cli(*command, uri=mongo_uri, collection=collection_name)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines and [line for line in lines if line != line.rstrip()] == [], command
    summary = cli("show", "img:1", uri=mongo_uri, collection=collection_name).stdout.splitlines()
    assert "key           img:1" in summary and 'params        {"width": 3}' in summary
