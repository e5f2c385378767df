"""taskrunner logs the same way wherever it runs: info and above, ISO UTC timestamps, on stderr."""

from __future__ import annotations

import json
import re
import subprocess
import sys

# A worker in the process, as a script using the Python API runs one (no structlog set up).
_WORKER = """
import asyncio, sys
from taskrunner import MemoryStore, TaskContext, TaskRunner

runner = TaskRunner(store=MemoryStore())

@runner.task("noop")
async def noop(params: dict, ctx: TaskContext) -> None:
    ctx.logger.debug("a handler's debug event")
    ctx.logger.info("a handler's info event")

async def main() -> None:
    if sys.argv[1] == "configured":
        import structlog
        structlog.configure(processors=[structlog.processors.JSONRenderer()],
                            logger_factory=structlog.PrintLoggerFactory(sys.stdout))
    async with runner:
        await runner.publish("noop", key="k1")
        await runner.run_worker(drain=True)

asyncio.run(main())
"""
# The CLI's line: "2026-01-02T03:04:05.678901Z [info     ] event   key=value".
CONSOLE_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z \[(?P<level>\w+) *\] (?P<event>.+)$")


def run_worker(mode: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, mode], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done


def test_an_in_process_worker_logs_like_the_cli_by_default() -> None:
    """Without a structlog configuration, a worker in a Python program logs info and above to stderr,
    each line starting with an ISO 8601 UTC timestamp, as `taskrunner worker` does; stdout stays the program's."""
    done = run_worker("default")
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    parsed = [CONSOLE_LINE.match(line) for line in lines]
    assert all(parsed), lines
    levels = {m["level"] for m in parsed if m}
    assert levels <= {"info", "warning", "error"}, lines
    events = [m["event"] for m in parsed if m]
    assert any(e.startswith("run succeeded") for e in events), lines
    assert any(e.startswith("a handler's info event") for e in events), lines
    assert not any("debug event" in e or e.startswith("swept") for e in events), lines


def test_an_application_structlog_configuration_wins() -> None:
    """An application that configures structlog gets taskrunner's events through its own configuration."""
    done = run_worker("configured")
    events = [json.loads(line)["event"] for line in done.stdout.splitlines()]
    assert "run succeeded" in events and "a handler's debug event" in events, done.stdout
    assert done.stderr == ""
