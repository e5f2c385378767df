"""``SyncTaskRunner``: the publish API for code without an event loop (Django, Flask).

PyMongo's async client belongs to one event loop, so the facade runs a private
loop in a daemon thread and forwards each call to it, with the same semantics
and the same handlers as the ``TaskRunner`` it was made from.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from taskrunner.errors import WaitTimeout
from taskrunner.models import Task
from taskrunner.preflight import ServerCheck
from taskrunner.store.memory import MemoryStore

if TYPE_CHECKING:
    from taskrunner.runner import TaskRunner

T = TypeVar("T")


class SyncTaskRunner:
    """``TaskRunner``'s publish and inspection methods, blocking (``runner.sync()``).

    In blocking code wait with ``sync_runner.wait(task.key, timeout)``: ``Task.wait`` is a
    coroutine, awaited in async code; on a task this facade returned it works from any
    event loop (the wait runs on the facade's own loop).
    """

    def __init__(self, runner: TaskRunner) -> None:
        # A store's client belongs to the loop that made it, so the facade gets its own
        # (the in-memory store has no client and is shared, keeping one set of tasks).
        memory = runner.store if isinstance(runner._store, MemoryStore) else None
        self._runner = runner.copy(store=memory)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="taskrunner-sync", daemon=True)
        self._thread.start()
        self._waiter = _OnLoop(self._runner, self._loop)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _task(self, coro: Coroutine[Any, Any, Task]) -> Task:
        """Run ``coro`` on the facade's loop; the task it returns waits through the facade."""
        with _rebinding(self._waiter):
            return self._call(coro).bound(self._waiter)

    def publish(self, name: str, params: Any = None, **kwargs: Any) -> Task:
        """``TaskRunner.publish``, blocking."""
        return self._task(self._runner.publish(name, params, **kwargs))

    def publish_many(self, tasks: Iterable[Mapping[str, Any]], **kwargs: Any) -> list[Task]:
        """``TaskRunner.publish_many``, blocking."""
        published = self._call(self._runner.publish_many(list(tasks), **kwargs))
        return [task.bound(self._waiter) for task in published]

    def get(self, key: str) -> Task:
        """``TaskRunner.get``, blocking."""
        return self._task(self._runner.get(key))

    def init(self, *, validator: bool = False) -> ServerCheck:
        """``TaskRunner.init``, blocking."""
        return self._call(self._runner.init(validator=validator))

    def wait(self, key: str, timeout: float | None = None, *, poll_interval: float = 1.0) -> Task:
        """``TaskRunner.wait``, blocking: the finished task, or ``WaitTimeout``."""
        return self._task(self._runner.wait(key, timeout, poll_interval=poll_interval))

    def cancel(self, key: str) -> Task:
        """``TaskRunner.cancel``, blocking."""
        return self._task(self._runner.cancel(key))

    def retry(self, key: str) -> Task:
        """``TaskRunner.retry``, blocking."""
        return self._task(self._runner.retry(key))

    def close(self) -> None:
        """Close the connection and stop the facade's loop (idempotent)."""
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


class _OnLoop:
    """``Task.wait`` for the facade's tasks: awaits, from any event loop, a wait that runs
    on the facade's loop (where its store's client lives)."""

    def __init__(self, runner: TaskRunner, loop: asyncio.AbstractEventLoop) -> None:
        self._runner, self._loop = runner, loop

    async def wait(self, key: str, timeout: float | None = None) -> Task:  # noqa: ASYNC109
        future = asyncio.run_coroutine_threadsafe(self._runner.wait(key, timeout), self._loop)
        with _rebinding(self):
            return (await asyncio.wrap_future(future)).bound(self)


@contextmanager
def _rebinding(waiter: _OnLoop) -> Iterator[None]:
    """A ``WaitTimeout`` leaving the block carries the last task seen bound to ``waiter``."""
    try:
        yield
    except WaitTimeout as exc:
        if isinstance(exc.task, Task):
            exc.task = exc.task.bound(waiter)
        raise
