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
from collections.abc import Mapping
from typing import Any

from pymongo import monitoring

from taskrunner.store import fields as f

ENV_VAR = "TASKRUNNER_COUNT_ROUNDTRIPS"
JOBS = ("claim", "run_writes", "discovery", "registry", "clock", "gates", "limits", "other")
"""What a worker's command was for: ``claim`` (claims and their read-backs), ``run_writes``
(lease renewals, outcomes, releases), ``discovery`` (change stream and scans), ``registry``
(beats and the peer list), ``clock`` (server time), ``gates`` (fleet-wide limits' permits),
``limits`` (pause and limit documents)."""


_BULK = {"insert": "documents", "update": "updates", "delete": "deletes"}


def _opcounter(name: str) -> str:
    if name in _BULK:
        return name
    return {"find": "query", "getMore": "getmore"}.get(name, "command")


def _statements(name: str, command: Mapping[str, Any]) -> int:
    field = _BULK.get(name)
    return len(command.get(field) or []) if field else 1


def job_of(name: str, command: Mapping[str, Any]) -> str:
    """The worker job a command belongs to, from its name and body (see ``JOBS``)."""
    target = command.get("collection" if name == "getMore" else name)
    if isinstance(target, str):
        for suffix, job in (
            (f.REGISTRY_SUFFIX, "registry"),
            (f.GATES_SUFFIX, "gates"),
            (f.LIMITS_SUFFIX, "limits"),
        ):
            if target.endswith(f".{suffix}"):
                return job
    if name == "hello":
        return "clock"
    if name in {"getMore", "aggregate", "killCursors"}:
        return "discovery"
    if name == "findAndModify":
        return "claim" if "$expr" in command.get("query", {}) else "run_writes"
    if name == "update":
        updates = command.get("updates") or [{}]
        return "claim" if "$expr" in updates[0].get("q", {}) else "run_writes"
    if name == "find":
        query = command.get("filter", {})
        if f"{f.WORKERS}.{f.RUN_ID}" in query:
            return "claim"  # a batched claim reading back what it took
        return "run_writes" if command.get("projection") else "discovery"
    return "other"


def enabled() -> bool:
    """Whether ``TASKRUNNER_COUNT_ROUNDTRIPS`` asks for counting."""
    return os.environ.get(ENV_VAR, "").strip().lower() in {"1", "true", "yes", "on"}


class RoundTripCounter(monitoring.CommandListener):
    """Counts started commands by name (``findAndModify``, ``getMore``, ...) and collection; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._targets: Counter[tuple[str, str]] = Counter()
        self._jobs: Counter[str] = Counter()
        self._statements: Counter[str] = Counter()
        self._events = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        name = event.command_name
        target = event.command.get("collection" if name == "getMore" else name)
        job = job_of(name, event.command)
        with self._lock:
            self._counts[name] += 1
            self._targets[name, target if isinstance(target, str) else ""] += 1
            self._jobs[job] += 1
            self._statements[_opcounter(name)] += _statements(name, event.command)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name not in {"getMore", "aggregate"}:
            return
        cursor = event.reply.get("cursor")
        batch = (
            (cursor.get("nextBatch") or cursor.get("firstBatch") or []) if isinstance(cursor, dict) else []
        )
        events = sum(isinstance(doc, Mapping) and "operationType" in doc for doc in batch)
        if events:
            with self._lock:
                self._events += events

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

    def by_job(self) -> dict[str, int]:
        """Counts by worker job (see ``JOBS``)."""
        with self._lock:
            return dict(sorted(self._jobs.items()))

    def statements(self) -> dict[str, int]:
        """Operations as the server's ``serverStatus.opcounters`` count them: one per
        statement of a bulk write (insert/update/delete), ``query`` per find, ``getmore``,
        ``command`` for the rest (findAndModify, aggregate, hello, ...)."""
        with self._lock:
            return dict(sorted(self._statements.items()))

    def events(self) -> int:
        """Change events received (documents in change-stream batches)."""
        with self._lock:
            return self._events

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def reset(self) -> dict[str, int]:
        """Return the counts so far and start again from zero."""
        with self._lock:
            counts = dict(sorted(self._counts.items()))
            self._counts.clear()
            self._targets.clear()
            self._jobs.clear()
            self._statements.clear()
            self._events = 0
            return counts
