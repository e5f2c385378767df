"""Prometheus metrics: the observer's arithmetic, the missing extra, and a real worker's /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from workers import TESTS_DIR, WorkerPool

from taskrunner import TaskRunner, TaskSpec
from taskrunner.models import Task, WorkerEntry
from taskrunner.observability.metrics import PrometheusObserver, serve_metrics
from taskrunner.testing import wait_for

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def make_task(name: str = "resize", *, run_at: datetime = T0) -> Task:
    return Task.model_validate(
        {
            "key": f"{name}-1",
            "name": name,
            "params": {},
            "priority": 0,
            "created_at": T0,
            "updated_at": T0,
            "run_at": run_at,
            "options": {},
            "workers": [],
            "state": "RUNNING",
        }
    )


def make_entry(claimed_at: datetime, *, took_over: list[str] | None = None) -> WorkerEntry:
    return WorkerEntry(
        worker_id="w1",
        run_id="r1",
        state="RUNNING",
        claimed_at=claimed_at,
        ping_at=claimed_at,
        expires_at=claimed_at + timedelta(seconds=30),
        took_over=took_over or [],
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_observer_counts_every_outcome_per_task() -> None:
    """Claims, takeovers and each outcome increment their own counter under the task's label."""
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    task, other = make_task("resize"), make_task("email")
    observer.claimed(task, make_entry(T0))
    observer.claimed(task, make_entry(T0, took_over=["dead-worker"]))
    observer.claimed(other, make_entry(T0))
    for outcome in ("success", "success", "failure", "lost", "released"):
        observer.finished(task, outcome, 0.5)
    observer.finished(other, "failure", 0.1)
    counts = {
        name: sample(registry, f"taskrunner_{name}_total", task="resize")
        for name in ("claims", "takeovers", "successes", "failures", "lost_claims", "releases")
    }
    assert counts == {
        "claims": 2,
        "takeovers": 1,
        "successes": 2,
        "failures": 1,
        "lost_claims": 1,
        "releases": 1,
    }
    assert sample(registry, "taskrunner_claims_total", task="email") == 1
    assert sample(registry, "taskrunner_failures_total", task="email") == 1
    assert sample(registry, "taskrunner_successes_total", task="email") is None


def test_observer_counts_snoozes_and_schedule_ticks() -> None:
    """Snoozed runs count per task; tasks published for schedule ticks count per schedule."""
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    observer.finished(make_task("resize"), "snoozed", 0.1)
    observer.fired("nightly", 1)
    observer.fired("nightly", 3)  # a catch-up of three ticks
    assert sample(registry, "taskrunner_snoozes_total", task="resize") == 1
    assert sample(registry, "taskrunner_schedule_ticks_total", schedule="nightly") == 4


def test_observer_histograms_and_in_flight_gauge() -> None:
    """Pickup is claimed_at minus run_at (takeovers skipped), run time is the handler's, in_flight is set."""
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    delayed = make_task(run_at=T0 + timedelta(minutes=5))  # e.g. a retry backoff moved run_at
    observer.claimed(delayed, make_entry(T0 + timedelta(minutes=5, milliseconds=20)))
    observer.claimed(delayed, make_entry(T0 + timedelta(hours=1), took_over=["w0"]))
    observer.claimed(make_task(), make_entry(T0 - timedelta(milliseconds=1)))  # clocks round: clamp to 0
    observer.finished(delayed, "success", 2.0)
    observer.in_flight(3)
    assert sample(registry, "taskrunner_pickup_latency_seconds_count", task="resize") == 2
    assert sample(registry, "taskrunner_pickup_latency_seconds_sum", task="resize") == pytest.approx(0.02)
    assert sample(registry, "taskrunner_pickup_latency_seconds_bucket", task="resize", le="0.005") == 1
    assert sample(registry, "taskrunner_pickup_latency_seconds_bucket", task="resize", le="0.025") == 2
    assert sample(registry, "taskrunner_run_seconds_count", task="resize") == 1
    assert sample(registry, "taskrunner_run_seconds_sum", task="resize") == 2.0
    assert sample(registry, "taskrunner_in_flight") == 3
    observer.in_flight(0)
    assert sample(registry, "taskrunner_in_flight") == 0


def test_named_tasks_start_at_zero_and_serve_metrics_exposes_them() -> None:
    """Series for the given task names exist at 0 before any event, and serve_metrics serves them."""
    registry = CollectorRegistry()
    PrometheusObserver(registry, tasks=["resize"])
    assert sample(registry, "taskrunner_successes_total", task="resize") == 0
    server, thread = serve_metrics(0, registry, host="127.0.0.1")
    try:
        text = scrape(server.server_port)
    finally:
        server.shutdown()
        thread.join(5)
    assert metric_values(text)[("taskrunner_claims_total", (("task", "resize"),))] == 0


def test_core_imports_and_cli_fails_clearly_without_prometheus_client(tmp_path: Path) -> None:
    """Without prometheus-client the core imports, and --metrics-port exits 1 naming taskrunner[metrics]."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import taskrunner, taskrunner.cli, taskrunner.engine.worker\n"
        "sys.argv = ['taskrunner', 'worker', '--app', 'apps.acceptance_app:runner', '--metrics-port', '0']\n"
        "taskrunner.cli.main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR), "TASKRUNNER_MONGO_URI": "mongodb://127.0.0.1:9"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 1, result.stderr
    assert "install taskrunner[metrics]" in result.stderr


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body: bytes = response.read()
    return body.decode()


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.mongo
async def test_worker_process_serves_metrics_of_its_runs(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A real worker started with --metrics-port counts its successes and failures and fills both histograms."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        worker = pool.start("m1", "--metrics-port", "0", "--metrics-host", "127.0.0.1")
        serving = await wait_for(lambda: worker.find("serving metrics"), 60, "the metrics endpoint")
        port = int(serving[0]["port"])
        await wait_for(lambda: worker.find("worker started"), 60, "the worker to start")
        quick: list[TaskSpec] = [{"name": "quick", "key": f"ok-{i}"} for i in range(3)]
        failing: list[TaskSpec] = [
            {"name": "fails_fast", "key": f"bad-{i}", "max_failures": 1} for i in range(2)
        ]
        await runner.publish_many(quick + failing)

        def settled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            values = metric_values(scrape(port))
            done = (
                values.get(("taskrunner_successes_total", (("task", "quick"),))) == 3
                and values.get(("taskrunner_failures_total", (("task", "fails_fast"),))) == 2
            )
            return values if done and values.get(("taskrunner_in_flight", ())) == 0 else None

        values = await wait_for(settled, 60, "the counters to reach 3 successes and 2 failures", interval=0.2)

    def value(name: str, **labels: str) -> Any:
        return values.get((name, tuple(sorted(labels.items()))))

    assert value("taskrunner_claims_total", task="quick") == 3
    assert value("taskrunner_claims_total", task="fails_fast") == 2
    assert value("taskrunner_failures_total", task="quick") == 0  # pre-created from the app's names
    assert value("taskrunner_successes_total", task="fails_fast") == 0
    assert value("taskrunner_takeovers_total", task="quick") == 0
    assert value("taskrunner_lost_claims_total", task="quick") == 0
    assert value("taskrunner_releases_total", task="quick") == 0
    for task, runs in (("quick", 3), ("fails_fast", 2)):
        assert value("taskrunner_pickup_latency_seconds_count", task=task) == runs
        assert value("taskrunner_run_seconds_count", task=task) == runs
        assert value("taskrunner_pickup_latency_seconds_bucket", task=task, le="+Inf") == runs
        assert 0 <= value("taskrunner_pickup_latency_seconds_sum", task=task) < 60 * runs
