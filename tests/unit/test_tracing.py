"""Tracing (docs/observability.md): publish and retry spans, the context stored in the task,
run spans as its children, the log fields, and taskrunner without OpenTelemetry."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import BaseModel

from taskrunner import Fail, MemoryStore, Retry, TaskContext, TaskRunner, TaskSpec, TaskState
from taskrunner.engine.worker import Worker
from taskrunner.observability import tracing
from taskrunner.observability.logs import add_trace_context
from taskrunner.schedules.scheduler import Scheduler
from taskrunner.store import fields as f
from taskrunner.testing import wait_for

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
handler_tracer = TracerProvider().get_tracer("app")  # replaced per test: see ``spans``


class Item(BaseModel):
    n: int = 0


def app() -> TaskRunner:
    runner = TaskRunner(store=MemoryStore())

    @runner.task()
    async def work(params: Item, ctx: TaskContext) -> int:
        with handler_tracer.start_as_current_span("handler work"):
            await asyncio.sleep(0)
        return params.n

    @runner.task(local_retries=1, retry_backoff=0)
    def sync_work(params: Item) -> list[str]:
        """Sync, in the executor's thread; fails its first attempt (a local retry)."""
        span = trace.get_current_span()
        seen.append(trace.format_span_id(span.get_span_context().span_id))
        if len(seen) == 1:
            raise RuntimeError("first attempt")
        return seen

    @runner.task()
    async def broken(params: Item) -> None:
        raise ValueError(f"broken {params.n}")

    @runner.task()
    async def later(params: Item) -> None:
        raise Retry(delay=60)

    @runner.task()
    async def final(params: Item) -> None:
        raise Fail("no")

    return runner


seen: list[str] = []


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """An SDK provider of the test's own (the global one can be set once per process)."""
    global handler_tracer
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("taskrunner"))
    monkeypatch.setattr(sys.modules[__name__], "handler_tracer", provider.get_tracer("app"))
    seen.clear()
    yield exporter
    provider.shutdown()


@pytest.fixture
async def runner() -> AsyncIterator[TaskRunner]:
    runner = app()
    yield runner
    await runner.close()


async def run_until(runner: TaskRunner, key: str, *, done: Any = None) -> None:
    """Run a worker until ``key`` is finished (or ``done(task)``)."""
    worker = Worker(runner, worker_id="w1")
    running = asyncio.create_task(worker.run())

    async def finished() -> bool:
        task = await runner.get(key)
        return bool(done(task)) if done is not None else task.state.finished

    try:
        await wait_for(finished, 30, f"{key} to finish")
    finally:
        worker.stop()
        await running


def stored(runner: TaskRunner, key: str) -> dict[str, Any]:
    store = runner.store
    assert isinstance(store, MemoryStore)
    return store._docs[key]


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def ids(span: ReadableSpan) -> tuple[int, int]:
    assert span.context is not None
    return span.context.trace_id, span.context.span_id


async def test_a_run_span_is_the_child_of_the_publish_span(
    spans: InMemorySpanExporter, runner: TaskRunner
) -> None:
    """publish opens a PRODUCER span whose W3C context the task stores; the run is a CONSUMER
    span, its child, with the messaging attributes; the handler's own span nests under it."""
    with handler_tracer.start_as_current_span("web request") as request:
        task = await runner.publish("work", {"n": 3}, key="k1")
    [publish] = named(spans, "publish work")
    assert publish.kind is SpanKind.PRODUCER
    assert publish.parent is not None and publish.parent.span_id == request.get_span_context().span_id
    assert dict(publish.attributes or {}) == {
        "messaging.system": "taskrunner",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": "work",
        "messaging.message.id": "k1",
    }
    trace_id, span_id = ids(publish)
    assert task.trace == stored(runner, "k1")[f.TRACE]
    assert task.trace is not None and list(task.trace) == ["traceparent"]
    assert task.trace["traceparent"].startswith(f"00-{trace_id:032x}-{span_id:016x}-")

    await run_until(runner, "k1")
    [run] = named(spans, "process work")
    assert run.kind is SpanKind.CONSUMER
    assert ids(run)[0] == trace_id and run.parent is not None and run.parent.span_id == span_id
    entry = (await runner.get("k1")).workers[0]
    assert dict(run.attributes or {}) == {
        "messaging.system": "taskrunner",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "work",
        "messaging.message.id": "k1",
        "taskrunner.run_id": entry.run_id,
        "taskrunner.attempt": 1,
        "taskrunner.worker_id": "w1",
        "taskrunner.outcome": "success",
    }
    assert run.status.status_code is StatusCode.UNSET
    [handler] = named(spans, "handler work")
    assert handler.parent is not None and handler.parent.span_id == ids(run)[1]
    assert run.start_time is not None and run.end_time is not None and handler.start_time is not None
    assert run.start_time <= handler.start_time and handler.end_time is not None
    assert handler.end_time <= run.end_time


async def test_a_sync_handler_and_its_local_retries_see_the_run_span(
    spans: InMemorySpanExporter, runner: TaskRunner
) -> None:
    """A sync handler runs in a thread with the run's span current, on every local attempt."""
    await runner.publish("sync_work", key="s1")
    await run_until(runner, "s1")
    [run] = named(spans, "process sync_work")
    assert seen == [f"{ids(run)[1]:016x}"] * 2
    assert (await runner.get("s1")).state is TaskState.SUCCESS


async def test_a_failed_run_is_an_error_with_its_exception_and_a_retry_is_not(
    spans: InMemorySpanExporter, runner: TaskRunner
) -> None:
    """A handler's exception (or ``Fail``) makes the run span ERROR with an exception event;
    a ``Retry`` (snooze) is an outcome, not an error."""
    await runner.publish("broken", {"n": 7}, key="b1", max_failures=1)
    await runner.publish("final", key="f1")
    await runner.publish("later", key="l1")
    await run_until(runner, "b1")
    await run_until(runner, "f1")
    await run_until(runner, "l1", done=lambda task: task.snoozes == 1)
    [broken] = named(spans, "process broken")
    assert broken.status.status_code is StatusCode.ERROR
    assert broken.status.description == "ValueError: broken 7"
    [event] = broken.events
    assert event.name == "exception" and event.attributes is not None
    assert event.attributes["exception.type"] == "ValueError"
    assert (broken.attributes or {})["taskrunner.outcome"] == "failure"
    [final] = named(spans, "process final")
    assert final.status.status_code is StatusCode.ERROR
    [later] = named(spans, "process later")
    assert later.status.status_code is StatusCode.UNSET and not later.events
    assert (later.attributes or {})["taskrunner.outcome"] == "snoozed"


async def test_publish_many_is_one_span_for_the_batch(
    spans: InMemorySpanExporter, runner: TaskRunner
) -> None:
    """One span per publish_many call, counting its tasks; every task carries its context."""
    items: list[TaskSpec] = [{"name": "work", "key": f"m{i}"} for i in range(3)]
    await runner.publish_many([*items, {"name": "broken"}])
    [batch] = spans.get_finished_spans()
    assert batch.name == "publish"
    attributes = dict(batch.attributes or {})
    assert attributes["messaging.batch.message_count"] == 4
    assert "messaging.destination.name" not in attributes and "messaging.message.id" not in attributes
    carriers = {json.dumps(stored(runner, k)[f.TRACE]) for k in ("m0", "m1", "m2")}
    assert len(carriers) == 1 and f"{ids(batch)[1]:016x}" in carriers.pop()


async def test_an_existing_key_keeps_its_context(spans: InMemorySpanExporter, runner: TaskRunner) -> None:
    """Publishing a key that exists returns it untouched: its runs stay the first publish's children."""
    first = await runner.publish("work", key="k")
    again = await runner.publish("work", key="k")
    assert not again.created and again.trace == first.trace
    assert len(named(spans, "publish work")) == 2


async def test_nothing_is_stored_when_tracing_is_off_or_sampled_out(
    monkeypatch: pytest.MonkeyPatch, runner: TaskRunner
) -> None:
    """Without a tracer provider, or with a span that does not record, the document has no ``trace``."""
    tracing.reset()
    assert tracing.tracer() is None  # no SDK provider set in this process
    await runner.publish("work", key="off")
    provider = TracerProvider(sampler=ALWAYS_OFF)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("taskrunner"))
    await runner.publish("work", key="sampled-out")
    assert f.TRACE not in stored(runner, "off") and f.TRACE not in stored(runner, "sampled-out")
    assert (await runner.get("off")).trace is None


@pytest.mark.parametrize(
    "value", ["garbage", {"traceparent": "00-nothex-0000-01"}, {"traceparent": 5}, [], {}]
)
async def test_a_malformed_stored_context_is_ignored(
    spans: InMemorySpanExporter, runner: TaskRunner, value: Any
) -> None:
    """A hand-written ``trace`` that does not read leaves the task readable; its run is a root span."""
    tracing.reset()
    await runner.publish("work", key="hand")
    stored(runner, "hand")[f.TRACE] = value
    task = await runner.get("hand")
    assert task.unreadable is None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tracing, "_tracer", handler_tracer)
        await run_until(runner, "hand")
    [run] = named(spans, "process work")
    assert run.parent is None
    assert (await runner.get("hand")).state is TaskState.SUCCESS


async def test_a_retry_is_the_parent_of_the_runs_it_causes(
    spans: InMemorySpanExporter, runner: TaskRunner
) -> None:
    """runner.retry opens a PRODUCER span and stores its context: the next run is its child."""
    await runner.publish("broken", key="r", max_failures=1)
    await run_until(runner, "r")
    await runner.retry("r")
    [retry] = [s for s in named(spans, "publish broken") if (s.attributes or {}).get("taskrunner.retry")]
    assert retry.kind is SpanKind.PRODUCER
    assert stored(runner, "r")[f.TRACE]["traceparent"].split("-")[2] == f"{ids(retry)[1]:016x}"
    await run_until(runner, "r", done=lambda task: task.state is TaskState.FAIL and task.failures == 1)
    first, second = named(spans, "process broken")
    assert second.parent is not None and second.parent.span_id == ids(retry)[1]
    assert first.parent is not None and first.parent.span_id != ids(retry)[1]


async def test_schedule_fires_are_publish_spans(spans: InMemorySpanExporter) -> None:
    """A schedule's firing (and its trigger) publishes inside a span naming the schedule."""
    runner = app()
    runner.schedule("work", every=1, id="minutely")
    clock = [T0 + timedelta(milliseconds=500)]
    store = MemoryStore(clock=lambda: clock[0])
    scheduler = Scheduler(store, list(runner.schedules.values()), now=lambda: clock[0], rank=lambda _: 0)
    await scheduler._declare()
    clock[0] += timedelta(seconds=2)
    await scheduler.tick()
    [fired] = named(spans, "publish work")
    assert dict(fired.attributes or {})["taskrunner.schedule"] == "minutely"
    tasks = await store.find()
    assert tasks and all(t.trace and f"{ids(fired)[1]:016x}" in t.trace["traceparent"] for t in tasks)
    await runner.copy(store=store).trigger_schedule("minutely")
    assert len(named(spans, "publish work")) == 2


async def test_a_run_span_ends_after_the_follow_up_it_owes(spans: InMemorySpanExporter) -> None:
    """The releases a run's outcome causes (a task waiting on it becomes PENDING) are made
    before its span ends, so they sit inside it."""
    runner = app()
    states: list[Any] = []

    class Watch(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            if span.name == "process work":
                states.append(stored(runner, "down")[f.STATE])

    provider = TracerProvider()
    provider.add_span_processor(Watch())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tracing, "_tracer", provider.get_tracer("taskrunner"))
        await runner.publish("work", key="up")
        await runner.publish("final", key="down", after=["up"])
        await run_until(runner, "down")
    assert states[0] != "WAITING"


def test_the_log_processor_adds_the_current_span_ids(spans: InMemorySpanExporter) -> None:
    """Log events inside a recording span carry its trace and span ids; outside, none."""
    assert add_trace_context(None, "info", {"event": "x"}) == {"event": "x"}
    with handler_tracer.start_as_current_span("s") as span:
        event = add_trace_context(None, "info", {"event": "x"})
    context = span.get_span_context()
    assert event == {
        "event": "x",
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
    }
    with structlog.testing.capture_logs(processors=[add_trace_context]) as logs:
        with handler_tracer.start_as_current_span("t"):
            structlog.get_logger().info("inside")
        structlog.get_logger().info("outside")
    assert "trace_id" in logs[0] and "trace_id" not in logs[1]


WITHOUT_OTEL = """
import asyncio, sys
sys.modules["opentelemetry"] = None  # import opentelemetry raises ImportError
from taskrunner import MemoryStore, TaskRunner
from taskrunner.engine.worker import Worker
from taskrunner.observability.logs import add_trace_context
from taskrunner.observability.tracing import configure_sdk, tracer

runner = TaskRunner(store=MemoryStore())

@runner.task()
async def work(params: dict) -> int:
    return 1

async def main() -> None:
    task = await runner.publish("work", key="k")
    worker = Worker(runner, worker_id="w")
    running = asyncio.create_task(worker.run())
    done = await runner.wait("k", timeout=10)
    worker.stop()
    await running
    print(done.state, task.trace, tracer(), configure_sdk(), add_trace_context(None, "info", {}))

asyncio.run(main())
"""


def test_taskrunner_works_without_opentelemetry() -> None:
    """With opentelemetry not importable, tasks publish and run, untraced, and the worker's
    SDK setup does nothing."""
    env = {"OTEL_TRACES_EXPORTER": "console", "PATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "SUCCESS None None None {}"


def test_the_worker_configures_the_sdk_from_the_environment() -> None:
    """configure_sdk reads OTEL_* as opentelemetry-instrument does: nothing without an exporter
    or with OTEL_SDK_DISABLED, else a provider named taskrunner-worker unless OTEL_SERVICE_NAME says."""
    script = (
        "from opentelemetry import trace\n"
        "from taskrunner.observability.tracing import configure_sdk\n"
        "end = configure_sdk()\n"
        "provider = trace.get_tracer_provider()\n"
        "print(end is not None, getattr(provider, 'resource', None) and provider.resource.attributes['service.name'])\n"
    )
    base = {"PATH": ""}
    cases = [
        ({}, "False None"),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, "False None"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "True taskrunner-worker"),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "billing"}, "True billing"),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_RESOURCE_ATTRIBUTES": "service.name=b2"}, "True b2"),
    ]
    for env, expected in cases:
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            env={**base, **env},
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected, env
