"""``WorkerOptions``: every setting of a worker, validated in one model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from taskrunner import worker_defaults as defaults
from taskrunner.errors import ConfigurationError
from taskrunner.store import sizes


class WorkerOptions(BaseModel):
    """How a worker runs: the one model behind ``Worker``, ``TaskRunner.run_worker`` and
    ``taskrunner worker``. A bad value raises ``ConfigurationError`` naming the option."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: int = Field(defaults.CONCURRENCY, ge=1)
    """Handlers that run at once in this worker (its slots)."""
    worker_id: str | None = Field(None, min_length=1)
    """The id in task entries and the worker registry; None: ``host-pid-random``, fresh per start."""
    shutdown_timeout: float = Field(defaults.SHUTDOWN_TIMEOUT, ge=0)
    """Seconds running handlers get on stop before they are cancelled and their claims released."""
    poll_interval: float = Field(defaults.POLL_INTERVAL, gt=0)
    """Seconds between sweeps when polling (``discovery="poll"``, or a server without change streams)."""
    beat_interval: float = Field(defaults.BEAT_INTERVAL, gt=0)
    """Seconds between beats into the worker registry; an entry expires five intervals after its last."""
    batch: int = Field(defaults.BATCH, ge=1)
    """Most tasks one claim round trip may take when slots are free (1: one at a time)."""
    discovery: Literal["stream", "poll"] = defaults.DISCOVERY
    """How the worker hears of new tasks: the change stream, or a sweep every ``poll_interval``."""
    queue_capacity: int = Field(defaults.QUEUE_CAPACITY, ge=1)
    """Claim-queue entries kept; past it the farthest 10 % are dropped (sweeps find them again)."""
    drain: bool = False
    """Stop gracefully once nothing runs here and nothing is claimable now: tasks due later
    (a future ``run_at``, a retry's backoff, a snooze) do not keep the worker running."""

    @field_validator("worker_id")
    @classmethod
    def _fits_an_entry(cls, worker_id: str | None) -> str | None:
        return None if worker_id is None else sizes.check_worker_id(worker_id)

    @model_validator(mode="wrap")
    @classmethod
    def _name_the_option(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # A ConfigurationError is no ValueError, so pydantic lets it through unwrapped.
        try:
            return handler(data)
        except ValidationError as exc:
            raise ConfigurationError(_problem(exc)) from None

    def merged(self, **changes: Any) -> WorkerOptions:
        """These options with ``changes`` applied (validated as a whole)."""
        if not changes:
            return self
        return WorkerOptions(**{**self.model_dump(exclude_unset=True), **changes})


def _problem(exc: ValidationError) -> str:
    error = exc.errors()[0]
    option = ".".join(str(part) for part in error["loc"]) or "options"
    if error["type"] == "extra_forbidden":
        known = ", ".join(WorkerOptions.model_fields)
        return f"unknown worker option {option!r}; known: {known}"
    return f"worker option {option}: {error['msg']}, got {error['input']!r}"
