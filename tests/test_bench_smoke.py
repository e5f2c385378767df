"""The benchmark scripts still run: tiny smoke runs as subprocesses (benchmarks are not tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.embedded
BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_bench(script: str, *args: str, results: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``bench/<script>`` with ``--results`` in a tmp file; return its one JSON line."""
    pytest.importorskip("mongoeco")
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--results", str(results)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert results.read_text().strip().splitlines()[-1] == line
    result: dict[str, Any] = json.loads(line)
    return result


def test_roundtrips_smoke(tmp_path: Path) -> None:
    """``roundtrips.py --smoke`` reports round trips per task, split by command and job."""
    result = run_bench("roundtrips.py", "--smoke", results=tmp_path / "results.jsonl")
    assert result["bench"] == "roundtrips"
    assert result["tasks"] == 10
    assert result["per_task_by_command"]["findAndModify"] >= 2.0  # one claim and one finish per task
    assert result["roundtrips_per_task"] == pytest.approx(
        sum(result["per_task_by_command"].values()), abs=0.01
    )
    assert set(result["per_task_by_job"]) >= {"claim_ping_finish"}
    assert (
        result["server_opcounters_delta"] == "unsupported" or "command" in result["server_opcounters_delta"]
    )


def test_claim_storm_smoke(tmp_path: Path) -> None:
    """``claim_storm.py`` with two workers and three tasks reports attempts per claim."""
    result = run_bench(
        "claim_storm.py",
        "--workers",
        "2",
        "--tasks",
        "3",
        "--gap",
        "0.05",
        results=tmp_path / "results.jsonl",
    )
    assert result["bench"] == "claim_storm"
    assert result["claims"] == 3
    assert result["attempts_per_claim"] >= 1.0


def test_explain_without_a_real_mongodb_says_so(tmp_path: Path) -> None:
    """``explain.py`` without ``TASKRUNNER_BENCH_MONGO_URI`` exits 0 and explains why."""
    env = {k: v for k, v in os.environ.items() if k != "TASKRUNNER_BENCH_MONGO_URI"}
    done = subprocess.run(
        [sys.executable, str(BENCH / "explain.py"), "--results", str(tmp_path / "r.jsonl")],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0
    assert "needs a real MongoDB" in done.stdout
    assert not (tmp_path / "r.jsonl").exists()
