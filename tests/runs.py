"""One run's fenced writes for tests, over ``Store.write_runs`` (what workers use).

Each helper writes for the worker that holds ``run_id``'s RUNNING entry and returns the
task as stored after it; a write for a run that holds none, or that does not land, raises
``ClaimLost``, as a worker would stop.
"""

from __future__ import annotations

from typing import Any

from taskrunner.errors import ClaimLost, StoreError
from taskrunner.models import EntryState, Task, TaskError
from taskrunner.store.base import Failure, RunStatus, RunWrite, RunWriteKind, Store


async def ping(store: Store, key: str, run_id: str, *, progress: Any = None) -> Task:
    """Renew the run's lease to server now plus ``ping_timeout``."""
    return await _write(store, "ping", key, run_id, progress)


async def succeed(store: Store, key: str, run_id: str, result: Any = None) -> Task:
    """Record the run's success with ``result``."""
    return await _write(store, "success", key, run_id, result)


async def fail(
    store: Store,
    key: str,
    run_id: str,
    error: TaskError,
    *,
    retry_in: float | None = None,
    final: bool = False,
) -> Task:
    """Record the run's failure (see ``Failure``)."""
    return await _write(store, "failure", key, run_id, Failure(error, retry_in, final))


async def _write(store: Store, kind: RunWriteKind, key: str, run_id: str, value: Any) -> Task:
    entry = (await store.get(key)).entry(run_id)
    if entry is None or entry.state is not EntryState.RUNNING:
        raise ClaimLost(key, run_id)  # write_runs calls a repeated outcome DONE; a test wants it refused
    [status] = await store.write_runs([RunWrite(kind, key, run_id, entry.worker_id, value)])
    if isinstance(status, StoreError):
        raise status
    if status is not RunStatus.DONE:
        raise ClaimLost(key, run_id)
    return await store.get(key)
