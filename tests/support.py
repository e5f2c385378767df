"""Helpers several test modules share (test modules never import each other)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from taskrunner.engine.worker import Worker
from taskrunner.models import Task
from taskrunner.testing import wait_for

BENCH = Path(__file__).resolve().parent.parent / "bench"


async def run_until(worker: Worker, condition: Any, within: float = 20.0) -> None:
    """Run the worker until ``condition()`` holds, then stop it and wait for it to exit."""
    running = asyncio.create_task(worker.run())
    try:
        await wait_for(condition, within, "the worker to get there", interval=0.02)
    finally:
        worker.stop()
        await running


def logged(logs: Sequence[Mapping[str, Any]], event: str) -> bool:
    """Whether ``event`` is among the log entries ``structlog.testing.capture_logs`` caught."""
    return any(entry["event"] == event for entry in logs)


def run_bench(
    script: str, *args: str, results: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> dict[str, Any]:
    """Run ``bench/<script>`` with ``--results`` in a tmp file; return its one JSON line."""
    pytest.importorskip("mongoeco")
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--results", str(results)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert results.read_text().strip().splitlines()[-1] == line
    result: dict[str, Any] = json.loads(line)
    return result


def stored_task(key: str, state: str = "PENDING", **fields: Any) -> Task:
    """A task as a store reads it back: ``key`` in ``state``, minimal fields, then ``fields``."""
    now = datetime.now(UTC)
    base = {"name": "job", "params": {}, "priority": 0, "options": {}, "workers": []}
    times = {"created_at": now, "updated_at": now, "run_at": now}
    return Task.model_validate({"key": key, **base, **times, "state": state, **fields})
