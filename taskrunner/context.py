"""``TaskContext``: what a running handler knows about its run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog


@dataclass
class TaskContext:
    """Handed to every handler. ``run_id`` is the claim's fencing token: pass it to
    your own side effects (e.g. a conditional write) so a run that lost its claim
    cannot act as the owner."""

    key: str
    run_id: str
    attempt: int
    worker_id: str
    params: Any
    logger: Any = field(default=None)
    cancelled: bool = False

    def __post_init__(self) -> None:
        if self.logger is None:
            self.logger = structlog.get_logger("taskrunner.task").bind(
                key=self.key, run_id=self.run_id, worker_id=self.worker_id, attempt=self.attempt
            )
