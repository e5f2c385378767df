"""``SyncTaskRunner``: the publish API for code without an event loop (Django, Flask).

PyMongo's async client belongs to one event loop, so the facade runs a private
loop in a daemon thread and forwards each call to it, with the same semantics
and the same handler registry as the ``TaskRunner`` it was made from.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from taskrunner.models import Task
from taskrunner.store.memory import MemoryStore

if TYPE_CHECKING:
    from taskrunner.runner import TaskRunner

T = TypeVar("T")


class SyncTaskRunner:
    """A blocking facade over a ``TaskRunner`` for synchronous code (``runner.sync()``): the same
    methods and semantics, run on a private event loop in a daemon thread."""

    def __init__(self, runner: TaskRunner) -> None:
        # A store's client belongs to the loop that made it, so the facade gets its own
        # (the in-memory store has no client and is shared, keeping one set of tasks).
        memory = runner.store if isinstance(runner._store, MemoryStore) else None
        self._runner = runner.copy(store=memory)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="taskrunner-sync", daemon=True)
        self._thread.start()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def publish(self, name: str, params: Any = None, **kwargs: Any) -> Task:
        return self._call(self._runner.publish(name, params, **kwargs))

    def publish_many(self, tasks: Iterable[Mapping[str, Any]], **kwargs: Any) -> list[Task]:
        return self._call(self._runner.publish_many(list(tasks), **kwargs))

    def get(self, key: str) -> Task:
        return self._call(self._runner.get(key))

    def init(self, *, validator: bool = False) -> None:
        self._call(self._runner.init(validator=validator))

    def wait(self, key: str, timeout: float | None = None, *, poll_interval: float = 1.0) -> Task:
        return self._call(self._runner.wait(key, timeout, poll_interval=poll_interval))

    def cancel(self, key: str) -> Task:
        return self._call(self._runner.cancel(key))

    def retry(self, key: str) -> Task:
        return self._call(self._runner.retry(key))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._runner.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncTaskRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
