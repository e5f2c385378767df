"""A `taskrunner` command imports what it uses, so it starts at about the cost of its libraries.

Names, not seconds (the figures are bench/cli_startup.py's): ``python -X importtime`` lists
every module a process imported, which a busy machine does not change.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Never needed to show help or read a task: structlog loads its dev console and rich
# tracebacks (0.5 s and more), the worker's machinery and the dashboard are for their commands.
NOT_FOR_ANY_COMMAND = (
    "structlog",
    "rich.traceback",
    "taskrunner.engine.worker",
    "taskrunner.engine.discovery",
    "taskrunner.engine.execution",
    "taskrunner.limits.gatekeeper",
    "taskrunner.dashboard",
    "taskrunner.dev",
)
NOT_FOR_HELP = (
    "pymongo",
    "bson",
    "pydantic.main",
    "rich",
    "taskrunner.runner",
    "taskrunner.models",
    "taskrunner.limits.gates",
    # The store's modules; its package holds the field names --help shows (defaults).
    "taskrunner.store.base",
    "taskrunner.store.mongo",
    "taskrunner.store.memory",
    "taskrunner.store.rules",
)


def imported(*args: str) -> set[str]:
    """The modules ``python -m taskrunner ARGS`` imports (whatever its exit status)."""
    env = {**os.environ, "TASKRUNNER_MONGO_URI": "mongodb://127.0.0.1:9", "TASKRUNNER_TIMEOUT": "0.2"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "taskrunner", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert lines, done.stderr
    return {line.rsplit("|", 1)[1].strip() for line in lines[1:]}


def loaded(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


def test_help_imports_typer_and_the_command_modules_only() -> None:
    """`taskrunner --help` imports no engine, driver, pydantic models, structlog or rich."""
    modules = imported("--help")
    assert "taskrunner.cli.tasks" in modules
    assert loaded(modules, NOT_FOR_ANY_COMMAND + NOT_FOR_HELP) == []


def test_a_store_command_imports_no_logging_worker_or_dashboard() -> None:
    """`taskrunner show KEY` imports the runner, the driver and rich, never structlog or the worker."""
    modules = imported("show", "img:1")
    assert {"taskrunner.runner", "taskrunner.store.mongo", "pymongo"} <= modules
    assert loaded(modules, NOT_FOR_ANY_COMMAND) == []


def test_importing_the_package_imports_no_submodule() -> None:
    """`import taskrunner` loads its public names on first use: the CLI and scripts pay for what they name."""
    code = "import sys, taskrunner; print(sorted(m for m in sys.modules if m.startswith('taskrunner')))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "['taskrunner', 'taskrunner._version']"
    code = "import sys; from taskrunner import TaskRunner, Worker; print('structlog' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"  # imported with a logger's first event
