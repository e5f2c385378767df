"""Prometheus metrics for workers: a ``WorkerObserver`` and a scrape endpoint (docs/metrics.md).

Needs the ``metrics`` extra (``pip install 'taskrunner[metrics]'``); importing this
module without prometheus-client raises ``ImportError`` saying so. The rest of
taskrunner never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from threading import Thread
from wsgiref.simple_server import WSGIServer

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "Prometheus metrics need prometheus-client: install taskrunner[metrics] "
        "(pip install 'taskrunner[metrics]')"
    ) from exc

from taskrunner.engine.observe import Outcome
from taskrunner.models import Task, WorkerEntry

__all__ = ["PICKUP_BUCKETS", "RUN_BUCKETS", "PrometheusObserver", "serve_metrics"]

DEFAULT_HOST = "0.0.0.0"
"""Prometheus scrapes from another machine, so the endpoint listens on every interface."""

PICKUP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RUN_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)


class PrometheusObserver:
    """A ``WorkerObserver`` that keeps Prometheus metrics, labelled by task name (``task``).

    ``registry`` defaults to prometheus-client's global ``REGISTRY`` (which also exports
    the process and Python collectors); one registry holds one observer's metrics.
    ``tasks`` pre-creates every counter's series at 0 so ``rate()`` sees the first event.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, tasks: Iterable[str] = ()) -> None:
        reg = REGISTRY if registry is None else registry
        label = ["task"]
        self.claims = Counter("taskrunner_claims", "Claims this worker made.", label, registry=reg)
        self.successes = Counter("taskrunner_successes", "Runs that ended in success.", label, registry=reg)
        self.failures = Counter(
            "taskrunner_failures", "Runs that ended in failure (after local retries).", label, registry=reg
        )
        self.lost = Counter(
            "taskrunner_lost_claims",
            "Runs stopped because the claim was lost or could not be confirmed (self-fenced).",
            label,
            registry=reg,
        )
        self.takeovers = Counter(
            "taskrunner_takeovers", "Claims that dropped other workers' expired leases.", label, registry=reg
        )
        self.releases = Counter(
            "taskrunner_releases",
            "Runs stopped and handed back (shutdown, task canceled, worker_ids changed).",
            label,
            registry=reg,
        )
        self.snoozes = Counter(
            "taskrunner_snoozes",
            "Runs that asked to run again later without a failure (Retry, ctx.snooze, RateLimited).",
            label,
            registry=reg,
        )
        self.throttles = Counter(
            "taskrunner_throttled_claims",
            "Due tasks of a limited name held back to wait for their gate's permit (each time).",
            label,
            registry=reg,
        )
        self.ticks = Counter(
            "taskrunner_schedule_ticks",
            "Tasks this worker published for schedule ticks (backups that found the tick done publish none).",
            ["schedule"],
            registry=reg,
        )
        self.running = Gauge("taskrunner_in_flight", "Runs in progress in this worker.", registry=reg)
        self.pickup = Histogram(
            "taskrunner_pickup_latency_seconds",
            "Server time from when a task became claimable (run_at) to its claim; takeovers excluded.",
            label,
            buckets=PICKUP_BUCKETS,
            registry=reg,
        )
        self.run_seconds = Histogram(
            "taskrunner_run_seconds",
            "Handler time of a run, whatever its outcome.",
            label,
            buckets=RUN_BUCKETS,
            registry=reg,
        )
        self._by_outcome: dict[Outcome, Counter] = {
            "success": self.successes,
            "failure": self.failures,
            "lost": self.lost,
            "released": self.releases,
            "snoozed": self.snoozes,
        }
        for name in tasks:
            for counter in (self.claims, self.takeovers, *self._by_outcome.values()):
                counter.labels(task=name)

    def claimed(self, task: Task, entry: WorkerEntry) -> None:
        self.claims.labels(task=task.name).inc()
        if entry.took_over:
            # The lease it replaces ran and expired after run_at: not a pickup delay.
            self.takeovers.labels(task=task.name).inc()
            return
        waited = (entry.claimed_at - task.run_at).total_seconds()
        self.pickup.labels(task=task.name).observe(max(waited, 0.0))

    def finished(self, task: Task, outcome: Outcome, seconds: float) -> None:
        self._by_outcome[outcome].labels(task=task.name).inc()
        self.run_seconds.labels(task=task.name).observe(seconds)

    def in_flight(self, count: int) -> None:
        self.running.set(count)

    def fired(self, schedule_id: str, count: int) -> None:
        self.ticks.labels(schedule=schedule_id).inc(count)

    def throttled(self, names: list[str]) -> None:
        for name in names:
            self.throttles.labels(task=name).inc()


def serve_metrics(
    port: int, registry: CollectorRegistry | None = None, *, host: str = DEFAULT_HOST
) -> tuple[WSGIServer, Thread]:
    """Serve ``/metrics`` for ``registry`` (default: the global one) from a daemon thread.

    ``port`` 0 picks a free port (``server.server_port``). Stop it with
    ``server.shutdown()``; raises ``OSError`` when the address cannot be bound.
    """
    return start_http_server(port, addr=host, registry=REGISTRY if registry is None else registry)
