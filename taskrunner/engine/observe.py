"""What a worker reports as it works, for metrics (``taskrunner.observability.metrics``) or your own hooks."""

from __future__ import annotations

from typing import Literal, Protocol

from taskrunner.models import Task, WorkerEntry

Outcome = Literal["success", "failure", "lost", "released", "snoozed"]
"""How a run ended: its own result or error, its claim lost (or self-fenced), released, or
snoozed (``Retry``: run again later, no failure counted)."""


class WorkerObserver(Protocol):
    def claimed(self, task: Task, entry: WorkerEntry) -> None:
        """A claim succeeded; ``entry.took_over`` is non-empty for a takeover."""

    def finished(self, task: Task, outcome: Outcome, seconds: float) -> None:
        """A run ended after ``seconds`` of handler time."""

    def in_flight(self, count: int) -> None:
        """The number of runs in progress changed."""

    def fired(self, schedule_id: str, count: int) -> None:
        """This worker fired a schedule's tick, publishing ``count`` new tasks."""

    def throttled(self, names: list[str]) -> None:
        """Due tasks of these names (one item each) waited for their gate's permit."""


class NullObserver:
    def claimed(self, task: Task, entry: WorkerEntry) -> None:
        return None

    def finished(self, task: Task, outcome: Outcome, seconds: float) -> None:
        return None

    def in_flight(self, count: int) -> None:
        return None

    def fired(self, schedule_id: str, count: int) -> None:
        return None

    def throttled(self, names: list[str]) -> None:
        return None
