"""``TaskContext``: what a running handler knows about its run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn

from taskrunner.errors import Retry
from taskrunner.observability.logs import get_logger
from taskrunner.store.sizes import fit_progress

if TYPE_CHECKING:
    from taskrunner.client import TaskClient
    from taskrunner.models import Task


@dataclass
class TaskContext:
    """Handed to every handler. ``run_id`` is the claim's fencing token: pass it to
    your own side effects (e.g. a conditional write) so a run that lost its claim
    cannot act as the owner. ``runner`` is the runner running this task (typed
    ``TaskClient``: all of ``TaskRunner`` but running workers): publish follow-up tasks through it (``await ctx.runner.publish(...)``), so they go
    where this task came from (the worker's database and collection, or a test's
    memory store), whichever runner the handler's module defines."""

    key: str
    run_id: str
    attempt: int
    worker_id: str
    params: Any
    logger: Any = field(default=None)
    cancelled: bool = False
    _progress: dict[str, Any] | None = field(default=None, repr=False)
    runner: TaskClient = field(kw_only=True, repr=False)
    last_progress: dict[str, Any] | None = field(default=None, kw_only=True)
    """The latest ``progress`` reported, sent or not: the outcome write carries it."""
    upstream: Mapping[str, Task] = field(default_factory=lambda: MappingProxyType({}), kw_only=True)
    """The tasks this one runs after (``after``), read-only, by key, as stored when this run
    started: each one's ``state``, ``results`` and ``errors`` (a fan-in step reads its
    inputs here). Empty for a task without ``after``."""

    def __post_init__(self) -> None:
        if self.logger is None:
            self.logger = get_logger("taskrunner.task").bind(
                key=self.key, run_id=self.run_id, worker_id=self.worker_id, attempt=self.attempt
            )

    async def progress(self, fraction: float, message: str | None = None) -> None:
        """Record progress (0..1) on this run's entry; it rides on the next ping, and the
        last one on the run's outcome, so calling it often costs no round trips. A message
        is cut to fit 512 bytes as stored (``sizes.PROGRESS_BYTES``: every run's entry keeps
        its last progress)."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"progress fraction must be between 0 and 1, got {fraction}")
        self._progress = self.last_progress = fit_progress({"fraction": float(fraction), "message": message})

    def snooze(self, seconds: float) -> NoReturn:
        """End this run now and run the task again ``seconds`` from now (server time),
        without counting a failure (raises ``Retry``; works in sync handlers too)."""
        raise Retry(seconds)

    def take_progress(self) -> dict[str, Any] | None:
        """The progress not yet sent (the heartbeat calls this)."""
        progress, self._progress = self._progress, None
        return progress
