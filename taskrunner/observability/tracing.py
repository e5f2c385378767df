"""Tracing with OpenTelemetry (docs/observability.md): one trace from the code that publishes a
task to the run that handles it.

taskrunner is a library here and uses the OpenTelemetry API only (the ``otel`` extra); the
application configures the SDK (``taskrunner worker`` does, from the ``OTEL_*`` variables:
``configure_sdk``). Publishing opens a PRODUCER span ``publish <name>`` and stores its W3C
trace context in the task document's ``trace`` field; each run of the task is a CONSUMER span
``process <name>``, a child of that context, current while the handler runs.

Tracing is off, at the cost of one cached check per publish and per run, while OpenTelemetry is
not installed or no SDK tracer provider is set; a span that does not record (sampled out)
stores nothing either, so the document stays as it is without tracing.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, Self, TypeVar

from taskrunner._version import __version__

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer


class Message(Protocol):
    """A task as publishing sees it (``NewTask``, ``Task``). This module imports neither:
    the logs, which nearly every module imports, use it."""

    @property
    def key(self) -> str: ...

    @property
    def name(self) -> str: ...

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self: ...


P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
M = TypeVar("M", bound=Message)

SYSTEM = "taskrunner"
SERVICE_NAME = "taskrunner-worker"
"""``service.name`` of ``taskrunner worker``'s spans unless OTEL_SERVICE_NAME (or
``service.name`` in OTEL_RESOURCE_ATTRIBUTES) names another."""

# OpenTelemetry's messaging semantic conventions; ``send`` is the operation type the
# conventions name for publishing (their older ``publish`` is deprecated).
MESSAGING_SYSTEM = "messaging.system"
OPERATION_TYPE = "messaging.operation.type"
OPERATION_NAME = "messaging.operation.name"
DESTINATION = "messaging.destination.name"
MESSAGE_ID = "messaging.message.id"
BATCH_COUNT = "messaging.batch.message_count"
RUN_ID = "taskrunner.run_id"
ATTEMPT = "taskrunner.attempt"
WORKER_ID = "taskrunner.worker_id"
OUTCOME = "taskrunner.outcome"
SCHEDULE = "taskrunner.schedule"
RETRY = "taskrunner.retry"

FAILED = "failure"
"""The run outcome whose span has status ERROR; ``success``, ``snoozed`` (``Retry``,
``ctx.snooze``, ``RateLimited``), ``released`` and ``lost`` are not errors."""

_tracer: Tracer | None = None
_absent = False


def tracer() -> Tracer | None:
    """taskrunner's tracer, or None while tracing is off: OpenTelemetry is not importable
    (checked once), or no SDK tracer provider is set yet (the API's proxy or no-op one). A
    provider, once set, is the process's for good (the API sets it once), so it is cached."""
    global _tracer, _absent
    if _tracer is not None:
        return _tracer
    if _absent:
        return None
    try:
        from opentelemetry import trace
    except ImportError:
        _absent = True
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    _tracer = provider.get_tracer("taskrunner", __version__)
    return _tracer


def reset() -> None:
    """Forget the cached tracer (tests that set a provider of their own)."""
    global _tracer, _absent
    _tracer, _absent = None, False


# -- publishing -------------------------------------------------------------------------------
async def publish(
    new: list[M],
    write: Callable[[list[M]], Awaitable[R]],
    *,
    schedule: str | None = None,
) -> R:
    """``write(new)`` inside a PRODUCER span, each task carrying the span's context (when
    the span records). One span per call; a batch's holds its size."""
    found = tracer()
    if found is None:
        return await write(new)
    with _producer(found, new, schedule=schedule) as carrier:
        return await write(new if carrier is None else [t.model_copy(update={"trace": carrier}) for t in new])


def publishes(
    method: Callable[Concatenate[S, list[M], P], Awaitable[R]],
) -> Callable[Concatenate[S, list[M], P], Awaitable[R]]:
    """``publish`` around a method whose first argument is the tasks to write."""

    @functools.wraps(method)
    async def traced(self: S, new: list[M], /, *args: P.args, **kwargs: P.kwargs) -> R:
        if tracer() is None:
            return await method(self, new, *args, **kwargs)
        return await publish(new, lambda tasks: method(self, tasks, *args, **kwargs))

    return traced


async def retried(key: str, retry: Callable[..., Awaitable[M]]) -> M:
    """``retry(key)`` (``Store.retry``) inside a PRODUCER span whose context the retried
    task carries from now on: the runs it causes are the retry's children."""
    found = tracer()
    if found is None:
        return await retry(key)
    attributes = {**_messaging("send"), MESSAGE_ID: key, RETRY: True}
    with _span(found, "publish", "PRODUCER", attributes) as span:
        task = await retry(key, trace=_carrier(span))
        span.update_name(f"publish {task.name}")
        span.set_attribute(DESTINATION, task.name)
        return task


@contextmanager
def _producer(
    found: Tracer, new: Sequence[Message], *, schedule: str | None
) -> Iterator[dict[str, str] | None]:
    names = {task.name for task in new}
    name = names.pop() if len(names) == 1 else None
    attributes: dict[str, Any] = _messaging("send")
    if name is not None:
        attributes[DESTINATION] = name
    if len(new) == 1:
        attributes[MESSAGE_ID] = new[0].key
    else:
        attributes[BATCH_COUNT] = len(new)
    if schedule is not None:
        attributes[SCHEDULE] = schedule
    with _span(found, "publish" if name is None else f"publish {name}", "PRODUCER", attributes) as span:
        yield _carrier(span)


def _carrier(span: Span) -> dict[str, str] | None:
    """The global propagator's carrier for ``span`` (by default W3C ``traceparent`` and
    ``tracestate``), or None when the span does not record: nothing is stored then."""
    if not span.is_recording():
        return None
    from opentelemetry import propagate, trace

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier or None


# -- running ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Run:
    """What a run's span says of it: its task (name, key, stored context) and its claim."""

    name: str
    key: str
    trace: Mapping[str, str] | None
    run_id: str
    attempt: int
    worker_id: str


class RunSpan:
    """The CONSUMER span of one run, current while the run goes on (``enter``), ended with
    its outcome (``end``)."""

    def __init__(self, found: Tracer, run: Run, started_ns: int) -> None:
        from opentelemetry import trace

        attributes = {
            **_messaging("process"),
            DESTINATION: run.name,
            MESSAGE_ID: run.key,
            RUN_ID: run.run_id,
            ATTEMPT: run.attempt,
            WORKER_ID: run.worker_id,
        }
        self.span = found.start_span(
            f"process {run.name}",
            context=parent(run.trace),
            kind=trace.SpanKind.CONSUMER,
            attributes=attributes,
            start_time=min(started_ns, time.time_ns()),
        )
        self._use = trace.use_span(self.span, end_on_exit=False, record_exception=False)

    @contextmanager
    def current(self) -> Iterator[None]:
        """The span is the current one inside (tasks created inside inherit it)."""
        with self._use:
            yield

    def end(self, outcome: str | None, error: BaseException | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if outcome is not None:
            self.span.set_attribute(OUTCOME, outcome)
        if error is not None and outcome in (FAILED, None):
            self.span.record_exception(error)
        if outcome == FAILED or (outcome is None and error is not None):
            description = f"{type(error).__qualname__}: {error}" if error is not None else None
            self.span.set_status(Status(StatusCode.ERROR, description))
        self.span.end()


def run_span(run: Run, started_ns: int) -> RunSpan | None:
    """The run's span starting at ``started_ns`` (local epoch ns), or None while tracing is off."""
    found = tracer()
    return None if found is None else RunSpan(found, run, started_ns)


def parent(stored: Mapping[str, str] | None) -> Any:
    """The context a task's ``trace`` field carries: its run's parent. None (a root span)
    without one; a carrier that does not parse also gives none."""
    if not stored:
        return None
    from opentelemetry import propagate

    try:
        return propagate.extract(stored)
    except Exception:  # a third-party propagator on a hand-written value: the run goes on untraced
        return None


# -- logs -------------------------------------------------------------------------------------
def current_ids() -> tuple[str, str] | None:
    """The current span's trace and span ids in hex, when one is current and recording."""
    if tracer() is None:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    if not span.is_recording():
        return None
    context = span.get_span_context()
    return trace.format_trace_id(context.trace_id), trace.format_span_id(context.span_id)


# -- the SDK, for taskrunner worker -----------------------------------------------------------
def configure_sdk() -> Callable[[], None] | None:
    """Configure the OpenTelemetry SDK from the ``OTEL_*`` environment variables as
    ``opentelemetry-instrument`` does (the SDK's own configurator reads them: exporters,
    endpoints, sampler, resource). Nothing happens without OTEL_TRACES_EXPORTER, with
    OTEL_SDK_DISABLED=true, without the SDK installed, or when a tracer provider is set
    already (under ``opentelemetry-instrument``). Returns what flushes and shuts it down."""
    if not os.environ.get("OTEL_TRACES_EXPORTER") or _disabled():
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk._configuration import _OTelSDKConfigurator
        from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_KEY
        from opentelemetry.sdk.resources import OTELResourceDetector
    except ImportError:
        return None
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return None
    named = OTELResourceDetector().detect().attributes.get(SERVICE_KEY)
    attributes = {} if named else {SERVICE_KEY: SERVICE_NAME}
    _OTelSDKConfigurator().configure(resource_attributes=attributes)  # type: ignore[no-untyped-call]
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    return shutdown if callable(shutdown) else None


def _disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _messaging(operation: str) -> dict[str, Any]:
    return {
        MESSAGING_SYSTEM: SYSTEM,
        OPERATION_TYPE: operation,
        OPERATION_NAME: "publish" if operation == "send" else operation,
    }


@contextmanager
def _span(found: Tracer, name: str, kind: str, attributes: Mapping[str, Any]) -> Iterator[Span]:
    from opentelemetry import trace

    with found.start_as_current_span(name, kind=trace.SpanKind[kind], attributes=attributes) as span:
        yield span
