"""What a `taskrunner` command costs to start: CPU time of whole processes, against the libraries it uses.

Each command runs as a subprocess, ``--repeat`` times, interleaved with its baselines so
a busy moment hits all of them alike; a run's CPU time (user + system) is the child's own
rusage from ``os.wait4``. Each command runs once first, which writes the byte-code caches
a user's machine has (``PYTHONDONTWRITEBYTECODE`` is dropped for the runs). Reports the median of each, and the margins the commands are
held to (docs/cli.md, "Start-up"):

    help_over_typer_s        `taskrunner --help`  minus  `python -c "import typer"`     (at most 0.1 s)
    show_over_libraries_s    `taskrunner show KEY` minus `python -c "import pymongo, pydantic, typer"`
    show_over_used_s         `taskrunner show KEY` minus importing what it uses of them and rich
                             (AsyncMongoClient, pydantic.BaseModel, typer, rich's Console and Table)
                                                                                           (at most 0.2 s)
    show_imports_over_used_s the modules `show` imports, without running it, minus the same

``show`` reads a task from a dev server this script starts (its CPU is not the
command's). The interpreter is this script's (the project's virtualenv); ``taskrunner``
is ``python -m taskrunner`` so no launcher is measured.

    uv run python bench/cli_startup.py [--repeat 15] [--smoke] [--results PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from common import add_common_args, emit
from processes import dev_server

from taskrunner import TaskRunner

KEY = "cli-startup:1"
USED = (
    "import asyncio, typer; from pymongo import AsyncMongoClient; from pydantic import BaseModel; "
    "from rich.console import Console; from rich.table import Table"
)
SHOW_IMPORTS = "import taskrunner.cli, taskrunner.cli.render, taskrunner.runner, taskrunner.store.mongo"
HELP_MARGIN_S = 0.1
STORE_MARGIN_S = 0.2


def commands(uri: str) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "typer": [python, "-c", "import typer"],
        "libraries": [python, "-c", "import pymongo, pydantic, typer"],
        # What `show` uses of them, and rich: ``import pydantic`` alone loads none of its
        # models' machinery (its names are lazy), which every command reading a task needs.
        "used": [python, "-c", USED],
        # The modules `show` imports, without connecting, reading or printing.
        "show_imports": [python, "-c", SHOW_IMPORTS],
        "help": [python, "-m", "taskrunner", "--help"],
        "show": [python, "-m", "taskrunner", "show", KEY, "--mongo-uri", uri],
    }


def cpu_seconds(command: list[str], env: Mapping[str, str]) -> float:
    """User + system CPU of one run of ``command`` (which must exit 0), from its own rusage."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.stderr is not None
    errors = process.stderr.read().decode(errors="replace")
    process.stderr.close()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {process.returncode}: {errors[-2000:]}")
    return float(usage.ru_utime + usage.ru_stime)


async def publish(uri: str) -> None:
    async with TaskRunner(uri) as runner:
        await runner.publish("resize", {"image": "a.png"}, key=KEY)


def measure(uri: str, repeat: int) -> dict[str, list[float]]:
    # Byte-code caches as a user's machine has them: the first run of each command writes them.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    env.pop("TASKRUNNER_MONGO_URI", None)
    runs: dict[str, list[float]] = {name: [] for name in commands(uri)}
    for command in commands(uri).values():  # once each first: byte-code caches, page cache
        cpu_seconds(command, env)
    for _ in range(repeat):
        for name, command in commands(uri).items():
            runs[name].append(cpu_seconds(command, env))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="runs of each command (median reported)")
    add_common_args(parser)
    args = parser.parse_args()
    repeat = 2 if args.smoke else args.repeat
    with dev_server() as uri:
        asyncio.run(publish(uri))
        runs = measure(uri, repeat)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    figures: dict[str, Any] = {f"{name}_cpu_s": round(value, 4) for name, value in medians.items()}
    figures["help_over_typer_s"] = round(medians["help"] - medians["typer"], 4)
    figures["show_over_libraries_s"] = round(medians["show"] - medians["libraries"], 4)
    figures["show_over_used_s"] = round(medians["show"] - medians["used"], 4)
    figures["show_imports_over_used_s"] = round(medians["show_imports"] - medians["used"], 4)
    figures["help_within_margin"] = figures["help_over_typer_s"] <= HELP_MARGIN_S
    figures["show_within_margin"] = figures["show_over_used_s"] <= STORE_MARGIN_S
    figures["runs"] = {name: [round(v, 4) for v in values] for name, values in runs.items()}
    emit("cli_startup", {"repeat": repeat}, figures, results=args.results, smoke=args.smoke)


if __name__ == "__main__":
    main()
