"""`taskrunner demo` as a user runs it: a subprocess with its own server and worker processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from taskrunner.dev.demo import SAMPLES, VICTIM_KEY, Observed, _workers_cell, timeline
from taskrunner.models import Task

pytestmark = pytest.mark.embedded


def run_demo_command(tmp_dir: Path) -> subprocess.CompletedProcess[str]:
    # Its own session, so a hung demo is killed together with its workers.
    env = {**os.environ, "COLUMNS": "200", "TMPDIR": str(tmp_dir)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "taskrunner", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_demo_takes_over_the_killed_workers_task_and_every_task_succeeds(tmp_path: Path) -> None:
    """The demo exits 0, reports the takeover and every task SUCCESS, and leaves no log files behind."""
    pytest.importorskip("mongoeco", reason="the demo's embedded server needs mongoeco (Python >= 3.13)")
    result = run_demo_command(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.split("Final summary", 1)[1]
    takeover = re.search(
        rf"takeover: {VICTIM_KEY} was running on (demo-w\d) \(killed\), taken over by (demo-w\d) after ([\d.]+) s",
        summary,
    )
    assert takeover and takeover[1] != takeover[2], summary
    print(f"takeover of {VICTIM_KEY} after {takeover[3]} s")
    for sample in SAMPLES:
        row = next(line for line in summary.splitlines() if f" {sample.key} " in line)
        assert "SUCCESS" in row, row
    assert f"all {len(SAMPLES)} tasks SUCCESS" in summary
    assert list(tmp_path.iterdir()) == [], "the demo left files in its temporary directory"


def _pair(first: tuple[float, float], second: tuple[float, float]) -> Task:
    """A concurrency-2 task whose two runs were claimed and finished at these seconds."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    runs = [
        {
            "worker_id": f"demo-w{i}",
            "run_id": f"run-{i}",
            "state": "SUCCESS",
            "attempt": i,
            "claimed_at": t0 + timedelta(seconds=start),
            "ping_at": t0,
            "expires_at": t0 + timedelta(seconds=60),
            "finished_at": t0 + timedelta(seconds=end),
        }
        for i, (start, end) in enumerate((first, second), 1)
    ]
    return Task.model_validate(
        {
            "key": "pair",
            "name": "sleep",
            "params": {},
            "priority": 0,
            "created_at": t0,
            "updated_at": t0,
            "run_at": t0,
            "options": {"concurrency": 2},
            "workers": runs,
            "state": "SUCCESS",
        }
    )


def _bars(task: Task) -> list[set[int]]:
    observed = Observed(tasks={task.key: task})
    lines = _workers_cell(task, observed).plain.splitlines()
    return [{i for i, char in enumerate(line) if char == "━"} for line in lines]


def test_concurrent_runs_show_side_by_side_and_sequential_ones_one_after_the_other() -> None:
    """Each run is a bar on the demo's timeline: concurrent runs overlap, a later run starts after."""
    together = _bars(_pair((0.0, 1.5), (0.1, 1.6)))
    assert len(together) == 2 and together[0] & together[1]
    apart = _bars(_pair((0.0, 1.0), (2.0, 3.0)))
    assert not apart[0] & apart[1] and min(apart[1]) > max(apart[0])


def test_timeline_bars_stay_within_their_width() -> None:
    """A bar covers its share of the span, at least one character, never past the width."""
    assert timeline(0, 10, 10, width=10) == "━" * 10
    assert timeline(5, 5, 10, width=10) == " " * 5 + "━" + " " * 4
    assert len(timeline(9.99, 30, 10, width=10)) == 10
