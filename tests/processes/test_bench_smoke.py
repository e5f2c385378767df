"""The benchmark scripts still run: tiny smoke runs as subprocesses (benchmarks are not tests).

Embedded only: each script starts its own embedded server; these runs check the scripts, not
the server (bench/explain.py, the one that needs a real MongoDB, runs in CI on MongoDB 8.0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import BENCH, run_bench

pytestmark = pytest.mark.embedded


def test_roundtrips_smoke(tmp_path: Path) -> None:
    """``roundtrips.py --smoke`` reports round trips per task, split by command and job."""
    result = run_bench("roundtrips.py", "--smoke", results=tmp_path / "results.jsonl")
    assert result["bench"] == "roundtrips"
    assert result["tasks"] == 10
    by_command = result["per_task_by_command"]
    # Claims and outcomes are writes: one findAndModify each, or fewer bulk updates with batching.
    assert by_command.get("findAndModify", 0) + by_command.get("update", 0) > 0
    assert result["roundtrips_per_task"] == pytest.approx(sum(by_command.values()), abs=0.01)
    assert result["roundtrips_per_task"] == pytest.approx(sum(result["per_task_by_job"].values()), abs=0.01)
    assert 0 < result["worker_writes_per_task"] <= result["roundtrips_per_task"]
    opcounters = result["server_opcounters_delta"]
    assert opcounters == "unsupported" or opcounters["clients"]["update"] >= 10  # publishing alone: 10


def test_claim_storm_smoke(tmp_path: Path) -> None:
    """``claim_storm.py --smoke`` (two workers, three tasks) reports attempts per claim under config."""
    result = run_bench("claim_storm.py", "--smoke", results=tmp_path / "results.jsonl")
    assert result["bench"] == "claim_storm"
    assert result["config"] == {"workers": 2}
    assert result["smoke"] is True
    assert result["claims"] == 3
    assert result["claim_attempts"] >= 3
    assert result["attempts_per_claim"] >= 1.0
    assert 0 < result["pickup_p50_ms"] <= result["pickup_max_ms"]


def test_claim_storm_takes_a_list_of_worker_counts(tmp_path: Path) -> None:
    """``--workers 1,2`` prints and records one line per worker count."""
    results = tmp_path / "results.jsonl"
    run_bench(
        "claim_storm.py",
        "--workers",
        "1,2",
        "--tasks",
        "2",
        "--gap",
        "0.02",
        "--settle",
        "0.3",
        results=results,
    )
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["config"] for line in lines] == [{"workers": 1}, {"workers": 2}]
    assert all(line["claims"] == 2 for line in lines)


def test_cpu_smoke(tmp_path: Path) -> None:
    """``cpu.py --smoke`` reports worker CPU per no-op task with the in-memory store."""
    result = run_bench("cpu.py", "--smoke", results=tmp_path / "results.jsonl")
    assert result["bench"] == "cpu"
    assert result["config"] == {"store": "memory", "concurrency": 10}
    assert result["tasks"] == 50
    assert result["cpu_ms_per_task"] > 0
    assert result["engine_ms_per_task"] + result["store_ms_per_task"] == pytest.approx(
        result["cpu_ms_per_task"], abs=0.01
    )
    assert result["tasks_per_s"] > 0


def test_heartbeat_smoke(tmp_path: Path) -> None:
    """``heartbeat.py --smoke`` counts task-collection writes per ping interval with two runs in flight."""
    result = run_bench("heartbeat.py", "--smoke", results=tmp_path / "results.jsonl")
    assert result["bench"] == "heartbeat"
    assert result["config"] == {"in_flight": 2, "ping_interval": 0.5}
    assert result["intervals"] == 2.0
    assert result["heartbeat_writes"] == sum(result["writes_by_command"].values())
    assert 0 < result["writes_per_interval"] <= 2 * 2  # pings of two runs, however batched
    assert result["statements"] >= result["heartbeat_writes"]


def test_pause_smoke(tmp_path: Path) -> None:
    """``pause.py --smoke`` measures how long after a pause the paused name was still claimed."""
    result = run_bench("pause.py", "--smoke", results=tmp_path / "results.jsonl")
    assert result["bench"] == "pause" and result["config"] == {"workers": 2, "rounds": 1}
    assert len(result["lags_s"]) == 1 and result["max_s"] == max(result["lags_s"]) >= 0


def test_ratelimit_smoke(tmp_path: Path) -> None:
    """``ratelimit.py --smoke`` reports, from one run, a rate case, the unlimited case, a
    live change and max_running against uncapped, each within its limit."""
    result = run_bench("ratelimit.py", "--smoke", results=tmp_path / "results.jsonl", timeout=180)
    assert result["bench"] == "ratelimit" and result["config"]["rates"] == ["10/s"]
    rate = result["rates"]["10/s"]
    assert rate["max_starts_per_window"] <= 10 and rate["achieved_share"] > 0
    assert result["unlimited_per_s"] > 0
    live = result["live"]
    assert (live["from"], live["to"]) == (4, 2) and live["starts_after_change"] > 0
    assert live["max_starts_per_window_after_change"] <= 2
    capped = result["capped"]
    assert capped["most_running_at_once"] <= 2 < capped["uncapped_most_running_at_once"]
    assert set(result["jobs_per_task"]) == {"limited", "unlimited", "capped", "uncapped"}


MACHINE = {
    "cpu": "Test CPU",
    "cores": 2,
    "memory_gib": 4.0,
    "os": "Linux",
    "python": "3.13.0",
    "pymongo": "4.20.0",
    "mongoeco": "4.11.0",
    "taskrunner": "0.1.0",
}


def synthetic_lines() -> list[dict[str, Any]]:
    """Four runs of every bench in the shapes the scripts emit (the report uses the latest three)."""
    configs: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    for workers in (1, 2, 4, 8):
        for batching in (True, False):
            configs.append(
                (
                    "roundtrips",
                    {"workers": workers, "concurrency": 10, "batching": batching},
                    {
                        "roundtrips_per_task": 2.5,
                        "worker_writes_per_task": 1.1 if batching else 1.9,
                        "per_task_by_job": {"claim_ping_finish": 1.5, "discovery": 0.5},
                    },
                )
            )
    for workers in (2, 4, 8, 16):
        configs.append(
            (
                "claim_storm",
                {"workers": workers},
                {
                    "claims": 30,
                    "claim_attempts": 36,
                    "attempts_per_claim": 1.2,
                    "pickup_p50_ms": 14.0,
                    "pickup_max_ms": 40.0,
                },
            )
        )
    for mode in ("stream", "polling", "baseline-poll-100ms"):
        configs.append(
            (
                "pickup",
                {"mode": mode},
                {
                    "p50_ms": 9.0,
                    "p90_ms": 12.0,
                    "p99_ms": 50.0,
                    "max_ms": 60.0,
                    "latencies_ms": [5.0, 9.0, 50.0],
                },
            )
        )
    for system in ("taskrunner", "baseline"):
        for workers in (1, 2):
            configs.append(
                (
                    "throughput",
                    {"system": system, "workers": workers, "concurrency": 4},
                    {"tasks_per_s": 100.0 * workers, "roundtrips_per_task": 3.0},
                )
            )
    for sig in ("SIGKILL", "SIGTERM"):
        configs.append(
            (
                "takeover",
                {"signal": sig, "ping_timeout": 3},
                {"samples": [1.0, 2.0, 3.5], "median_s": 2.0, "max_s": 3.5},
            )
        )
    for concurrency in (10, 50):
        configs.append(
            (
                "cpu",
                {"store": "memory", "concurrency": concurrency},
                {
                    "tasks": 3000,
                    "cpu_ms_per_task": 0.25,
                    "engine_ms_per_task": 0.125,
                    "store_ms_per_task": 0.125,
                    "wall_s": 2.0,
                    "tasks_per_s": 1500.0,
                },
            )
        )
    for k in (1, 10, 50):
        configs.append(
            (
                "heartbeat",
                {"in_flight": k, "ping_interval": 0.5},
                {
                    "heartbeat_writes": 8,
                    "intervals": 8.0,
                    "writes_per_interval": 1.0,
                    "statements": 8 * k,
                    "statements_per_interval": float(k),
                },
            )
        )
    for system, rate in (("taskrunner", 40.0), ("loop", 20.0)):
        configs.append(
            (
                "versus",
                {"system": system, "workers": 4, "publish": "one", "hog": False},
                {
                    "tasks_per_s": rate,
                    "pickup_p50_ms": 5.0,
                    "pickup_p95_ms": 30.0,
                    "commands_per_task": 2.0,
                    "claim_attempts_per_claim": 1.0,
                    "events_per_task_per_worker": 0.25,
                    "getmores_per_task_per_worker": 0.25,
                },
            )
        )
    configs.append(
        (
            "idle",
            {"mode": "stream", "workers": 4},
            {
                "commands_per_s_per_worker": 1.5,
                "by_job": {"registry": 1.0, "discovery": 0.5},
                "idle_claims": 0,
            },
        )
    )
    pages = ("overview", "tasks", "task", "workers", "schedules")
    render = {
        f"{page}_{kind}_ms": ms
        for page in pages
        for kind, ms in (("first", 900.0), ("p50", 12.0), ("p95", 25.0))
    } | {f"{page}_pending": 0 for page in pages}
    live = {"live_render_p50_ms": 15.0, "live_render_p95_ms": 40.0, "live_commands_per_s": 3.5}
    configs.append(
        ("dashboard", {"tasks": 10000, "tabs": 2, "rate": 10.0}, render | live | {"change_streams_opened": 1})
    )
    return [
        {
            "bench": bench,
            "config": config,
            **figures,
            "smoke": False,
            "machine": MACHINE,
            "when": f"2026-11-22T08:0{run}:00",
        }
        for run in range(4)
        for bench, config, figures in configs
    ]


def render_report(results: Path, out: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCH / "report.py"), "--results", str(results), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out.read_text()


def test_report_renders_every_bench(tmp_path: Path) -> None:
    """``report.py`` renders a section, table and plot per bench; smoke and config-less lines are ignored."""
    results = tmp_path / "results.jsonl"
    old = {"bench": "claim_storm", "workers": 16, "attempts_per_claim": 987.6, "when": "2026-11-22T09:00:00"}
    smoke = {
        "bench": "cpu",
        "config": {"store": "memory", "concurrency": 10},
        "cpu_ms_per_task": 765.4,
        "smoke": True,
        "when": "2026-11-22T09:00:00",
    }
    lines = [old, *synthetic_lines(), smoke]
    results.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    text = render_report(results, tmp_path / "docs" / "benchmarks.md")
    for heading in (
        "## Targets",
        "## Side by side",
        "## Idle cost",
        "## Round trips per task",
        "## Claim attempts per claim",
        "## Pickup latency",
        "## Throughput",
        "## Takeover time",
        "## Worker CPU per task",
        "## Heartbeat writes",
        "## Dashboard render time",
        "## Machine and dates",
    ):
        assert heading in text
    assert "Not run yet" not in text
    assert "987.6" not in text and "765.4" not in text  # the old-format line and the smoke line
    assert "| claim attempts per claim ≤ 1.3 with 16 workers | 1.2 | yes |" in text
    assert "| 16 | 1.2 | 30 | 14 | 40 | 3 |" in text  # latest 3 of 4 runs
    assert "Test CPU" in text and "2026-11-22T08:01:00" in text and "2026-11-22T08:00:00" not in text
    assert "| one | no | 4 | 40 | 20 | 2 | 5 / 30 |" in text  # the ratio within each round
    assert "| tasks | 900 | 12 | 25 | 0 |" in text and "while publishing, p50 / p95 ms: 15 / 40" in text
    plots = tmp_path / "docs" / "benchmarks"
    for name in ("versus", "roundtrips", "claim_storm", "pickup", "throughput", "takeover", "heartbeat"):
        assert (plots / f"{name}.png").read_bytes().startswith(b"\x89PNG")
        assert f"](benchmarks/{name}.png)" in text
    used = [json.loads(line) for line in (plots / "results.jsonl").read_text().splitlines()]
    assert used and all(not line.get("smoke") and "config" in line for line in used)  # the lines reported


def test_report_without_results_says_not_run_yet(tmp_path: Path) -> None:
    """Missing benches render as "not run yet" instead of failing."""
    text = render_report(tmp_path / "missing.jsonl", tmp_path / "benchmarks.md")
    assert text.count("Not run yet") == 10
    assert ".png)" not in text


def test_dashboard_smoke(tmp_path: Path) -> None:
    """``dashboard.py --smoke`` times every page over HTTP (first fetch and repeats), all answering 200."""
    result = run_bench(
        "dashboard.py", "--smoke", "--tabs", "0", results=tmp_path / "results.jsonl", timeout=180
    )
    assert result["bench"] == "dashboard" and result["config"]["tasks"] == 200
    for page in ("overview", "tasks", "tasks_filtered", "task", "workers", "schedules"):
        assert 0 < result[f"{page}_p50_ms"] <= result[f"{page}_p95_ms"], page
        assert result[f"{page}_first_ms"] > 0, page
    assert result["worst_p95_ms"] == max(v for k, v in result.items() if k.endswith("_p95_ms"))


def test_explain_without_a_real_mongodb_says_so(tmp_path: Path) -> None:
    """``explain.py`` without ``TASKRUNNER_BENCH_MONGO_URI`` exits 0 and explains why."""
    env = {k: v for k, v in os.environ.items() if k != "TASKRUNNER_BENCH_MONGO_URI"}
    done = subprocess.run(
        [sys.executable, str(BENCH / "explain.py"), "--results", str(tmp_path / "r.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0
    assert "needs a real MongoDB" in done.stdout
    assert not (tmp_path / "r.jsonl").exists()


def test_embedded_inserts_smoke(tmp_path: Path) -> None:
    """``embedded_inserts.py --smoke`` reports seconds per 1,000 inserts at each size and their ratios."""
    result = run_bench("embedded_inserts.py", "--smoke", results=tmp_path / "results.jsonl")
    assert result["bench"] == "embedded_inserts"
    assert result["config"] == {"batch": 100}
    assert set(result["seconds_per_1000"]) == set(result["ratio_to_first"]) == {"200", "1000"}
    assert result["ratio_to_first"]["200"] == 1.0


def test_faults_smoke(tmp_path: Path) -> None:
    """``faults.py --smoke`` runs each fault scenario once, small, and records one line per
    scenario: every task SUCCESS, no failure counted, a pickup recovery time and exit time."""
    results = tmp_path / "results.jsonl"
    last = run_bench("faults.py", "--smoke", results=results, timeout=240)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert lines[-1] == last
    assert [line["config"]["scenario"] for line in lines] == ["ends", "stepdown", "lose", "none"]
    for line in lines:
        assert line["bench"] == "faults" and line["smoke"] is True and line["rounds"] == 1
        assert line["success"] == 12 + 4 + 1  # the backlog, the long tasks, the probe
        assert (line["fail"], line["unfinished"], line["failures_counted"], line["claimed_twice"]) == (
            0,
            0,
            0,
            0,
        )
        assert line["recovery_median_s"] == line["recovery_s"][0] >= 0
        assert line["exit_max_s"] > 0


def test_cli_startup_smoke(tmp_path: Path) -> None:
    """``cli_startup.py --smoke`` reports the CPU of `--help`, `show` and their baselines, and the margins."""
    result = run_bench("cli_startup.py", "--smoke", results=tmp_path / "results.jsonl", timeout=120)
    assert result["bench"] == "cli_startup" and result["config"] == {"repeat": 2}
    for name in ("typer", "libraries", "used", "show_imports", "help", "show"):
        assert len(result["runs"][name]) == 2 and result[f"{name}_cpu_s"] > 0
    assert result["help_over_typer_s"] == pytest.approx(
        result["help_cpu_s"] - result["typer_cpu_s"], abs=1e-3
    )
    assert result["show_over_libraries_s"] == pytest.approx(
        result["show_cpu_s"] - result["libraries_cpu_s"], abs=1e-3
    )
    assert result["show_over_used_s"] == pytest.approx(result["show_cpu_s"] - result["used_cpu_s"], abs=1e-3)
    assert isinstance(result["help_within_margin"], bool) and isinstance(result["show_within_margin"], bool)


def test_workflows_smoke(tmp_path: Path) -> None:
    """``workflows.py --smoke`` runs the control, a fan-out, a fan-in and 1 -> 10 -> 1 graphs
    (N = 24) with in-process workers, then with worker processes, and reports each case's
    time and commands per task, and their ratios to the control's."""
    results = tmp_path / "results.jsonl"
    run_bench("workflows.py", "--smoke", results=results, timeout=300)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["config"]["mode"] for line in lines] == ["inprocess", "processes"]
    for line in lines:
        assert line["bench"] == "workflows" and line["smoke"] is True
        assert line["config"] | {"mode": None} == {"mode": None, "workers": 1, "concurrency": 10, "tasks": 24}
        cases = line["cases"]
        assert {name: case["tasks"] for name, case in cases.items()} == {
            "control": 24,
            "fan_out": 25,
            "fan_in": 25,
            "diamonds": 24,
        }
        for case in cases.values():
            assert case["seconds"] > 0 and case["publish_s"] > 0
            assert case["ms_per_task"] == pytest.approx(1000 * case["seconds"] / case["tasks"], abs=0.01)
            total = case["worker_commands_per_task"] + case["publisher_commands_per_task"]
            assert case["commands_per_task"] == pytest.approx(total, abs=0.01)
            assert case["worker_commands_per_task"] == pytest.approx(
                sum(case["worker_commands_per_task_by_command"].values()), abs=0.05
            )
        control = cases["control"]
        assert control["ratio_ms"] == control["ratio_commands"] == 1.0
        for name in ("fan_out", "fan_in", "diamonds"):  # publishing them also links upstreams
            assert cases[name]["publisher_commands_per_task"] > control["publisher_commands_per_task"]
            assert cases[name]["ratio_commands"] == pytest.approx(
                cases[name]["commands_per_task"] / control["commands_per_task"], abs=0.01
            )


def test_tracing_smoke(tmp_path: Path) -> None:
    """``tracing.py --smoke`` runs N = 20 tasks at each tracing level (off, API only, on), in
    process and in a worker process, and reports worker CPU per task and its ratio to off's;
    in process, tracing on exports one span per run and the other levels none."""
    results = tmp_path / "results.jsonl"
    run_bench("tracing.py", "--smoke", results=results, timeout=300)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["config"]["mode"] for line in lines] == ["inprocess", "processes"]
    for line in lines:
        assert line["bench"] == "tracing" and line["smoke"] is True
        levels = line["levels"]
        assert list(levels) == ["off", "api", "on"] and levels["off"]["ratio_cpu"] in (
            1.0,
            None,
        )  # None: 0 ticks
        assert all(level["cpu_ms_per_task"] >= 0 and level["seconds"] > 0 for level in levels.values())
    assert all(level["cpu_ms_per_task"] > 0 for level in lines[0]["levels"].values())  # /proc counts ticks
    spans = {name: level["spans_per_task"] for name, level in lines[0]["levels"].items()}
    assert spans == {"off": 0.0, "api": 0.0, "on": 1.0}


def test_transactions_smoke(tmp_path: Path) -> None:
    """``transactions.py --smoke`` times each case beside its control on one server: publish
    sends one command outside a transaction and one more (the commit) inside one."""
    result = run_bench("transactions.py", "--smoke", results=tmp_path / "results.jsonl")
    cases = result["cases"]
    assert list(cases) == ["plain", "transaction", "publish", "publish_txn"]
    assert cases["publish"]["commands_per_op"] == 1.0 and cases["publish_txn"]["commands_per_op"] == 2.0
    assert cases["plain"]["commands_per_op"] == 2.0 and cases["transaction"]["commands_per_op"] == 3.0
    assert all(case["ms_per_op"] > 0 for case in cases.values())
