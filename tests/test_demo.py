"""`taskrunner demo` as a user runs it: a subprocess with its own server and worker processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from taskrunner.dev.demo import SAMPLES, VICTIM_KEY

pytest.importorskip("mongoeco", reason="the demo's embedded server needs mongoeco (Python >= 3.13)")
pytestmark = pytest.mark.embedded


def run_demo_command() -> subprocess.CompletedProcess[str]:
    # Its own session, so a hung demo is killed together with its workers.
    proc = subprocess.Popen([sys.executable, "-m", "taskrunner", "demo"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_demo_takes_over_the_killed_workers_task_and_every_task_succeeds() -> None:
    """The demo exits 0, reports the takeover of the killed worker's task and every task SUCCESS."""
    result = run_demo_command()
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.split("Final summary", 1)[1]
    takeover = re.search(
        rf"takeover: {VICTIM_KEY} was running on (demo-w\d) \(killed\), taken over by (demo-w\d) after [\d.]+ s",
        summary,
    )
    assert takeover and takeover[1] != takeover[2], summary
    for sample in SAMPLES:
        row = next(line for line in summary.splitlines() if f" {sample.key} " in line)
        assert "SUCCESS" in row, row
    assert f"all {len(SAMPLES)} tasks SUCCESS" in summary
    logs = re.search(r"worker logs \(JSON lines\): (\S+)", summary)
    assert logs, summary
    os.remove(logs[1])
