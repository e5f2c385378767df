"""taskrunner's logging: structlog, one event per line on stderr, with one default everywhere.

Wherever taskrunner runs (``taskrunner worker``, a worker or a runner in your process, the
test fixtures), its events are logged at level ``info`` and above, each line starting with
an ISO 8601 UTC timestamp, as console lines on stderr (docs/worker.md, "Log events"). An
application that configures structlog itself (``structlog.configure``) gets taskrunner's
events through its own configuration instead; ``configure_logging`` is what the CLI calls.

structlog is imported on a logger's first event or ``bind``, not with the module: importing
it loads its development console and rich tracebacks, which commands that never log
(``taskrunner show``) must not pay for.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from structlog.typing import Processor

LogFormat = Literal["json", "console"]
DEFAULT_FORMAT: LogFormat = "console"
DEFAULT_LEVEL = "info"


def configure_logging(fmt: LogFormat = DEFAULT_FORMAT, level: str = DEFAULT_LEVEL) -> None:
    """Configure structlog for the whole process: ``fmt`` ``console`` (one readable line per
    event) or ``json`` (one JSON object per line, for log stores), at ``level`` (debug, info,
    warning or error) and above, on stderr, with ISO 8601 UTC timestamps.

    Events carry ``worker_id``, ``key`` and ``run_id`` where they apply (docs/worker.md), and
    ``trace_id`` and ``span_id`` inside a recording span (docs/observability.md).
    Without this call (or a ``structlog.configure`` of your own) taskrunner logs with the
    defaults: console lines, info and above.
    """
    import structlog

    structlog.configure(
        processors=_processors(fmt),
        wrapper_class=structlog.make_filtering_bound_logger(_level(level)),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Logger:
    """taskrunner's logger ``name`` (``taskrunner.engine.worker``, ...): see the module's docstring."""
    return Logger(name)


class Logger:
    """A module's logger: each event goes through the structlog configuration of that moment
    (the application's when it has one, else taskrunner's default), as structlog's own lazy
    loggers do. ``bind`` returns structlog's bound logger, made with the configuration of
    that moment, so a worker's per-run loggers cost no more per event than structlog's.
    """

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def bind(self, **values: Any) -> Any:
        return _bound(self._name, values)

    def __getattr__(self, method: str) -> Any:
        """``debug``, ``info``, ``warning``, ``error``, ``exception``, ... of a logger bound now."""
        return getattr(_bound(self._name, {}), method)


def _bound(name: str, context: dict[str, Any]) -> Any:
    import structlog

    if structlog.is_configured():
        return structlog.get_logger(name).bind(**context)
    processors, wrapper = _default()
    return structlog.wrap_logger(
        _stderr_logger(), processors=processors, wrapper_class=wrapper, cache_logger_on_first_use=False
    ).bind(**context)


def _level(level: str) -> int:
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    return numeric


@functools.cache
def _default() -> tuple[list[Processor], type[Any]]:
    """The default's processors and level filter, made on the first event of an unconfigured process."""
    import structlog

    return _processors(DEFAULT_FORMAT), structlog.make_filtering_bound_logger(_level(DEFAULT_LEVEL))


def _processors(fmt: LogFormat) -> list[Processor]:
    import structlog

    renderer: Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    return [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_trace_context,
        structlog.processors.format_exc_info,
        renderer,
    ]


def add_trace_context(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: ``trace_id`` and ``span_id`` (hex, as trace viewers show them)
    of the current span, when one is current and recording (docs/observability.md). Add it
    to a ``structlog.configure`` of your own to keep them."""
    from taskrunner.observability.tracing import current_ids

    ids = current_ids()
    if ids is not None:
        event.setdefault("trace_id", ids[0])
        event.setdefault("span_id", ids[1])
    return event


def _stderr_logger(*_: Any) -> Any:
    """A print logger on the current ``sys.stderr`` (tests and CliRunner replace it)."""
    import structlog

    return structlog.PrintLogger(sys.stderr)
