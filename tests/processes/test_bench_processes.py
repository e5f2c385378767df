"""The process-based benchmarks still run: each script's ``--smoke`` run, its JSON lines' shape.

Each script starts its own embedded server and worker processes; a smoke run takes
a few seconds (benchmarks are not tests: only the shape and sanity are checked).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import run_bench

pytestmark = pytest.mark.embedded


def lines(results: Path) -> list[dict[str, Any]]:
    """Every JSON line a run appended (``run_bench`` returns only the last)."""
    return [json.loads(line) for line in results.read_text().splitlines()]


def check_pickup(result: dict[str, Any], tasks: int) -> None:
    assert result["bench"] == "pickup"
    assert result["smoke"] is True
    assert result["tasks"] == len(result["latencies_ms"]) == tasks
    assert all(0 < ms < 10_000 for ms in result["latencies_ms"])
    assert 0 < result["p50_ms"] <= result["p90_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert result["max_ms"] == max(result["latencies_ms"])


def check_throughput(result: dict[str, Any], system: str) -> None:
    assert result["bench"] == "throughput"
    assert result["config"]["system"] == system
    assert set(result["config"]) == {"system", "workers", "concurrency"}
    assert result["tasks"] == 20
    assert result["seconds"] > 0
    assert result["tasks_per_s"] == pytest.approx(result["tasks"] / result["seconds"], rel=0.05)
    assert result["roundtrips_per_task"] > 0
    for split in ("roundtrips_per_task_by_command", "roundtrips_per_task_by_job"):
        assert result["roundtrips_per_task"] == pytest.approx(sum(result[split].values()), abs=0.05)


def test_pickup_stream_smoke(tmp_path: Path) -> None:
    """``pickup.py --smoke`` times five tasks published one at a time to an idle worker."""
    result = run_bench("pickup.py", "--smoke", results=tmp_path / "r.jsonl")
    check_pickup(result, 5)
    assert result["config"]["mode"] == "stream"
    assert 0 <= result["to_claim_p50_ms"] <= result["max_ms"]


def test_pickup_polling_smoke(tmp_path: Path) -> None:
    """In polling mode (no change streams) pickup waits for a scan, bounded by the interval (3 tasks)."""
    result = run_bench("pickup.py", "--smoke", "--mode", "polling", results=tmp_path / "r.jsonl")
    check_pickup(result, 3)
    assert result["config"] == {"mode": "polling", "poll_interval": 0.5}
    # One 0.5 s interval plus room for a busy host, yet below the default 5 s interval.
    assert result["max_ms"] < 500 + 3500


def test_throughput_smoke(tmp_path: Path) -> None:
    """``throughput.py --smoke``: one combination, all 20 tasks, round trips counted."""
    result = run_bench("throughput.py", "--smoke", results=tmp_path / "r.jsonl")
    check_throughput(result, "taskrunner")
    assert result["config"] == {"system": "taskrunner", "workers": 1, "concurrency": 4}


def test_baseline_smoke(tmp_path: Path) -> None:
    """``baseline.py --smoke`` writes a throughput line and a pickup line for the hand-rolled loop."""
    run_bench("baseline.py", "--smoke", results=tmp_path / "r.jsonl")
    throughput, pickup = lines(tmp_path / "r.jsonl")
    check_throughput(throughput, "baseline")
    assert throughput["roundtrips_per_task_by_command"]["findAndModify"] >= 1.0  # one claim per task
    assert throughput["roundtrips_per_task_by_job"]["claim"] >= 1.0
    check_pickup(pickup, 5)
    assert pickup["config"] == {"mode": "baseline-poll-100ms", "workers": 1}


def test_takeover_smoke(tmp_path: Path) -> None:
    """``takeover.py --smoke``: a SIGKILLed owner's task is taken over after its lease, a SIGTERMed one's sooner."""
    run_bench("takeover.py", "--smoke", results=tmp_path / "r.jsonl")
    killed, stopped = lines(tmp_path / "r.jsonl")
    assert killed["config"] == {"signal": "SIGKILL", "ping_timeout": 2.0}
    assert stopped["config"] == {"signal": "SIGTERM", "ping_timeout": 2.0}
    for result in (killed, stopped):
        assert result["bench"] == "takeover"
        assert len(result["samples"]) == 1
        assert result["median_s"] == result["max_s"] == result["samples"][0]
    # The lease runs ping_timeout past the last ping (server clock; allow a little skew); the
    # upper bound only leaves a busy host room.
    assert 1.9 <= killed["median_s"] < 2.0 + 20
    assert 0 < stopped["median_s"] < killed["median_s"]
