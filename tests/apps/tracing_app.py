"""The app of the tracing process test (tests/faults/test_tracing_processes.py): a handler
that opens a span of its own, and one that fails."""

from __future__ import annotations

from opentelemetry import trace

from taskrunner import TaskContext, TaskRunner

runner = TaskRunner()


@runner.task()
async def traced(params: dict[str, int], ctx: TaskContext) -> int:
    with trace.get_tracer("tracing_app").start_as_current_span("handler step") as span:
        span.set_attribute("app.n", params.get("n", 0))
        return params.get("n", 0)


@runner.task()
async def broken(params: dict[str, int]) -> None:
    raise ValueError("broken on purpose")
