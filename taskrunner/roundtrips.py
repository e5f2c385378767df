"""Opt-in round-trip counting: a PyMongo command listener that counts commands by name.

Attach it with ``MongoStore.connect(uri, event_listeners=[counter])`` or, for the
worker CLI, ``TASKRUNNER_COUNT_ROUNDTRIPS=1`` (the worker logs a ``round trips``
event with the counts when it stops). Without it PyMongo publishes no command
events, so the hot path pays nothing.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

from pymongo import monitoring

ENV_VAR = "TASKRUNNER_COUNT_ROUNDTRIPS"


def enabled() -> bool:
    """Whether ``TASKRUNNER_COUNT_ROUNDTRIPS`` asks for counting."""
    return os.environ.get(ENV_VAR, "").strip().lower() in {"1", "true", "yes", "on"}


class RoundTripCounter(monitoring.CommandListener):
    """Counts started commands by name (``findAndModify``, ``getMore``, ...) and collection; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._targets: Counter[tuple[str, str]] = Counter()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        name = event.command_name
        target = event.command.get("collection" if name == "getMore" else name)
        with self._lock:
            self._counts[name] += 1
            self._targets[name, target if isinstance(target, str) else ""] += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        return None

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        return None

    def snapshot(self) -> dict[str, int]:
        """Counts so far by command name, sorted by name."""
        with self._lock:
            return dict(sorted(self._counts.items()))

    def by_target(self) -> dict[tuple[str, str], int]:
        """Counts by (command name, collection), e.g. ``("findAndModify", "tasks.workers")``."""
        with self._lock:
            return dict(sorted(self._targets.items()))

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def reset(self) -> dict[str, int]:
        """Return the counts so far and start again from zero."""
        with self._lock:
            counts = dict(sorted(self._counts.items()))
            self._counts.clear()
            self._targets.clear()
            return counts
