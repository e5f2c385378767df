"""What a run's ``ctx.upstream`` is read from: the store, through a worker's cache of the
upstreams that succeeded.

A task that succeeded does not change again (publishing its key afresh makes a new task,
which its old dependents no longer wait on), so a worker keeps the last ones it read: the
10,000 dependents of one task read it once per worker, not once per run. Upstreams in any
other state are read fresh, as stored when the run starts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from taskrunner.models import Task, TaskState
from taskrunner.store.base import FlowStore

CACHED = 1000
"""Succeeded upstreams a worker keeps, the last read."""


class Upstreams:
    """Reads the tasks a run runs after (``read``), keeping the succeeded ones."""

    def __init__(self, store: FlowStore, size: int = CACHED) -> None:
        self.store, self.size = store, size
        self._kept: OrderedDict[str, Task] = OrderedDict()

    async def read(self, after: Sequence[str]) -> Mapping[str, Task]:
        """The tasks of ``after`` that exist, by key in ``after`` order, read-only."""
        if not after:
            return MappingProxyType({})
        missing = [key for key in after if key not in self._kept]
        found = {t.key: t for t in await self.store.get_many(missing)} if missing else {}
        for task in found.values():
            if task.state is TaskState.SUCCESS:
                self._keep(task)
        tasks = {key: self._kept.get(key) or found.get(key) for key in after}
        return MappingProxyType({key: task for key, task in tasks.items() if task is not None})

    def _keep(self, task: Task) -> None:
        self._kept[task.key] = task
        self._kept.move_to_end(task.key)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
