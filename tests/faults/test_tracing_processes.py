"""Tracing across processes (docs/observability.md): a publisher process inside a span
publishes; a ``taskrunner worker`` with ``OTEL_TRACES_EXPORTER=console`` runs the tasks; the
spans both print continue one trace, from the publisher's request to the handler's own span.

Both processes print their spans with the SDK's console exporter (one indented JSON object
per span on stdout); the worker's are exported when it stops (SIGTERM), which also shows
that stopping flushes them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from workers import TESTS_DIR, WorkerPool, finished, wait_exit

from taskrunner import TaskRunner, TaskState
from taskrunner.dev.processes import worker_env
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

APP = "apps.tracing_app:runner"
PUBLISHER = """
import asyncio, os
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from taskrunner import TaskRunner

provider = TracerProvider(resource=Resource.create({"service.name": "web"}))
provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
trace.set_tracer_provider(provider)

async def main() -> None:
    async with TaskRunner(collection=os.environ["TASKRUNNER_COLLECTION"]) as runner:
        with trace.get_tracer("web").start_as_current_span("POST /orders"):
            await runner.publish("traced", {"n": 5}, key="t1")
            await runner.publish("broken", key="b1", max_failures=2, retry_backoff=0)

asyncio.run(main())
"""


def spans_in(text: str) -> list[dict[str, Any]]:
    """The console exporter's spans in a process's output: each an indented JSON object from a
    line ``{`` to a line ``}`` (the worker's JSON log lines, one line each, are not spans)."""
    spans, block = [], None
    for line in text.splitlines():
        if line == "{":
            block = [line]
        elif block is not None:
            block.append(line)
            if line == "}":
                spans.append(json.loads("\n".join(block)))
                block = None
    return spans


def one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, f"{name}: {len(found)} spans among {[s['name'] for s in spans]}"
    return found[0]


async def test_a_run_continues_the_publishers_trace_across_processes(
    runner: TaskRunner, mongo_uri: str, runner_collection: str, tmp_path: Path
) -> None:
    """The worker's run span has the publisher's trace id and the publish span as parent, the
    handler's own span nests under it, and each failed run's span is ERROR with its exception
    (a retried task's runs are siblings under its publish span)."""
    env = worker_env(mongo_uri, collection=runner_collection, python_path=[TESTS_DIR])
    command = [sys.executable, "-c", PUBLISHER]
    published = await asyncio.to_thread(
        subprocess.run, command, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert published.returncode == 0, published.stderr
    web = spans_in(published.stdout)
    request, publish = one(web, "POST /orders"), one(web, "publish traced")
    assert publish["kind"] == "SpanKind.PRODUCER" and publish["parent_id"] == request["context"]["span_id"]
    trace_id = request["context"]["trace_id"]

    with WorkerPool(
        mongo_uri, runner_collection, tmp_path, app=APP, env={"OTEL_TRACES_EXPORTER": "console"}
    ) as pool:
        worker = pool.start("w1")
        await wait_for(lambda: finished(runner, "t1", "b1"), 60, "both tasks to finish")
        worker.terminate()
        assert await wait_exit(worker, 60) == 0
        spans = spans_in(worker.log_path.read_text())
        assert worker.find("tracing on", exporter="console")

    assert [t.state for t in await finished(runner, "t1", "b1") or []] == [TaskState.SUCCESS, TaskState.FAIL]
    run = one(spans, "process traced")
    assert run["kind"] == "SpanKind.CONSUMER"
    assert run["context"]["trace_id"] == trace_id and run["parent_id"] == publish["context"]["span_id"]
    assert run["resource"]["attributes"]["service.name"] == "taskrunner-worker"
    assert run["attributes"]["messaging.message.id"] == "t1"
    assert run["attributes"]["taskrunner.worker_id"] == "w1"
    assert run["attributes"]["taskrunner.outcome"] == "success"
    assert run["status"]["status_code"] == "UNSET"
    handler = one(spans, "handler step")
    assert handler["context"]["trace_id"] == trace_id and handler["parent_id"] == run["context"]["span_id"]

    failures = [s for s in spans if s["name"] == "process broken"]
    assert [s["attributes"]["taskrunner.attempt"] for s in failures] == [1, 2]  # sibling runs
    for failed in failures:
        assert failed["context"]["trace_id"] == trace_id
        assert failed["parent_id"] == one(web, "publish broken")["context"]["span_id"]
        assert failed["status"]["status_code"] == "ERROR"
        [event] = failed["events"]
        assert event["name"] == "exception"
        assert event["attributes"]["exception.type"] == "ValueError"
        assert event["attributes"]["exception.message"] == "broken on purpose"
        span_id = failed["context"]["span_id"][2:]
        assert worker.find("run failed", key="b1", trace_id=trace_id[2:], span_id=span_id)
