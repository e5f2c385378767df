"""When a failed task runs again: the backoff policies (docs/retries.md).

The worker that records a failure computes the delay (it knows how many failures the
task had) and the server adds it to its own clock: ``run_at = $$NOW + delay``, so the
next attempt's time is in the document and no worker's clock decides it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from taskrunner.models import TaskOptions


def delay(options: TaskOptions, failures: int, draw: Callable[[], float] | None = None) -> float:
    """Seconds to wait after the ``failures``-th failure (1 for the first).

    ``"exponential"`` is AWS's *full jitter*: uniform in ``[0, min(cap, base *
    factor ** (failures - 1))]``, so many tasks failing together (an outage) come
    back spread out instead of in lockstep.
    """
    if options.backoff == "fixed":
        return options.retry_backoff
    if isinstance(options.backoff, float):
        return options.backoff
    try:
        ceiling = options.retry_backoff * options.backoff_factor ** max(failures - 1, 0)
    except OverflowError:
        ceiling = options.backoff_cap
    return (draw or random.random)() * min(options.backoff_cap, ceiling)
