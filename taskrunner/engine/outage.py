"""Quiet, jittered retries of a failing server call: one log line when it starts, one when it ends."""

from __future__ import annotations

import random
import time
from typing import Any

from taskrunner.observability.redact import redact


class Outage:
    """Tracks one kind of call that may fail while the server is away.

    ``failed()`` logs ``event`` at ``level`` on the first failure of an outage (debug
    after that) and returns the next retry delay: exponential from ``base``, capped at
    ``cap``, with jitter (times 0.5 to 1.0) so workers do not retry in lockstep. ``ok()`` logs
    ``recovered`` (info) once when a call succeeds again.
    """

    def __init__(
        self,
        log: Any,
        event: str,
        recovered: str,
        *,
        level: str = "warning",
        base: float = 0.5,
        cap: float = 5.0,
    ) -> None:
        self.log, self.event, self.recovered, self.level = log, event, recovered, level
        self.base, self.cap = base, cap
        self.failures = 0
        self.since = 0.0

    def failed(self, exc: BaseException, **fields: Any) -> float:
        self.failures += 1
        error = redact(str(exc)) or type(exc).__name__
        if self.failures == 1:
            self.since = time.monotonic()
            getattr(self.log, self.level)(self.event, error=error, **fields)
        else:
            self.log.debug(self.event, error=error, failures=self.failures, **fields)
        return min(self.cap, self.base * 2.0 ** min(self.failures - 1, 16)) * random.uniform(0.5, 1.0)

    def ok(self, **fields: Any) -> None:
        if self.failures:
            seconds = round(time.monotonic() - self.since, 1)
            self.log.info(self.recovered, failures=self.failures, seconds=seconds, **fields)
            self.failures = 0
