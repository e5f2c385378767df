"""``SyncTaskRunner``: the publish API for code without an event loop (Django, Flask).

PyMongo's async client belongs to one event loop, so the facade runs a private
loop in a daemon thread and forwards each call to it, with the same semantics
and the same handlers as the ``TaskRunner`` it was made from. Given the application's own
``MongoClient`` (``runner.sync(client=...)``) it runs each call in the caller's thread on
that client instead, so ``session=`` can be one of the application's sessions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from pymongo import MongoClient
from pymongo.synchronous.client_session import ClientSession

from taskrunner.errors import ConfigurationError, RunnerClosed, WaitTimeout
from taskrunner.models import Duration, SyncTask, Task, UpstreamPolicy
from taskrunner.options import TaskOptionsDict, TaskSpec
from taskrunner.store.mongo import MongoStore
from taskrunner.store.preflight import ServerCheck

if TYPE_CHECKING:
    from taskrunner.client import TaskClient
    from taskrunner.workflows import Flow, FlowView

T = TypeVar("T")


class SyncTaskRunner:
    """``TaskRunner``'s publish and inspection methods, blocking (``runner.sync()``).

    The tasks it returns are ``SyncTask`` handles: ``task.wait(timeout)`` blocks, as
    ``sync_runner.wait(task.key, timeout)`` does. After ``close()`` every call raises
    ``RunnerClosed``.

    ``client``: the application's ``pymongo.MongoClient``; calls then run in the caller's
    thread on it (no thread of the facade's own), ``session=`` takes its sessions, and
    ``close`` leaves it open.
    """

    def __init__(self, runner: TaskClient, *, client: MongoClient[Any] | None = None) -> None:
        self._client = client
        # Held while a call is handed to the loop and while close() stops it: a call either
        # reaches a running loop or sees the facade closed, never waits on a stopped loop.
        self._lock = threading.Lock()
        self._closed = False
        if client is not None:
            store = MongoStore.on_sync_client(client, runner.database, runner.collection)
            self._runner = runner.copy(store=store)
            return
        self._runner = runner.for_another_loop()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="taskrunner-sync", daemon=True)
        self._thread.start()

    def _call(self, operation: str, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self._closed:
                coro.close()  # never started: no "never awaited" warning
                raise RunnerClosed(operation)
            # On the application's client the call runs here, on this thread's own loop.
            future = None if self._client is not None else asyncio.run_coroutine_threadsafe(coro, self._loop)
        return asyncio.run(coro) if future is None else future.result()

    def _session(self, session: ClientSession | None) -> ClientSession | None:
        """``session``, checked to belong to the client the facade runs on."""
        if session is not None and (self._client is None or session.client is not self._client):
            raise ConfigurationError(
                "session= takes a session of the MongoClient given to runner.sync(client=...)"
            )
        return session

    def _task(self, operation: str, coro: Coroutine[Any, Any, Task]) -> SyncTask:
        """Run ``coro`` on the facade's loop; the task it returns waits through the facade."""
        try:
            return SyncTask.of(self._call(operation, coro), self)
        except WaitTimeout as exc:
            if isinstance(exc.task, Task):
                exc.task = SyncTask.of(exc.task, self)  # the last state seen, waitable here too
            raise

    def publish(
        self,
        name: str,
        params: Any = None,
        *,
        key: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: Duration | None = None,
        after: Iterable[str] | None = None,
        on_upstream_failure: UpstreamPolicy | None = None,
        update_pending: bool = False,
        republish_finished: bool = False,
        allow_unknown: bool = False,
        session: ClientSession | None = None,
        **options: Unpack[TaskOptionsDict],
    ) -> SyncTask:
        """``TaskRunner.publish``, blocking; ``session`` is one of ``client``'s."""
        publish = self._runner.publish(
            name,
            params,
            key=key,
            priority=priority,
            run_at=run_at,
            delay=delay,
            after=after,
            on_upstream_failure=on_upstream_failure,
            update_pending=update_pending,
            republish_finished=republish_finished,
            allow_unknown=allow_unknown,
            session=self._session(session),
            **options,
        )
        return self._task("publish", publish)

    def publish_many(
        self,
        tasks: Iterable[TaskSpec],
        *,
        update_pending: bool = False,
        republish_finished: bool = False,
        allow_unknown: bool = False,
        session: ClientSession | None = None,
    ) -> list[SyncTask]:
        """``TaskRunner.publish_many``, blocking; ``session`` is one of ``client``'s."""
        publish = self._runner.publish_many(
            list(tasks),
            update_pending=update_pending,
            republish_finished=republish_finished,
            allow_unknown=allow_unknown,
            session=self._session(session),
        )
        return [SyncTask.of(task, self) for task in self._call("publish_many", publish)]

    def get(self, key: str) -> SyncTask:
        """``TaskRunner.get``, blocking."""
        return self._task("get", self._runner.get(key))

    def init(self, *, validator: bool = False) -> ServerCheck:
        """``TaskRunner.init``, blocking."""
        return self._call("init", self._runner.init(validator=validator))

    def wait(self, key: str, timeout: float | None = None, *, poll_interval: float = 1.0) -> SyncTask:
        """``TaskRunner.wait``, blocking: the finished task, or ``WaitTimeout``."""
        return self._task("wait", self._runner.wait(key, timeout, poll_interval=poll_interval))

    def cancel(self, key: str, *, session: ClientSession | None = None) -> SyncTask:
        """``TaskRunner.cancel``, blocking; ``session`` is one of ``client``'s."""
        return self._task("cancel", self._runner.cancel(key, session=self._session(session)))

    def retry(self, key: str, *, session: ClientSession | None = None) -> SyncTask:
        """``TaskRunner.retry``, blocking; ``session`` is one of ``client``'s."""
        return self._task("retry", self._runner.retry(key, session=self._session(session)))

    def flow(self, flow_id: str) -> Flow:
        """``TaskRunner.flow``: build it (``add``, ``chain``, ``group``), then ``publish_flow``."""
        return self._runner.flow(flow_id)

    def publish_flow(self, flow: Flow, *, allow_unknown: bool = False) -> list[SyncTask]:
        """``await flow.publish()``, blocking, for a flow this facade's ``flow`` made."""
        if not flow.publishes_with(self._runner):
            raise ValueError("publish_flow takes a flow made by this SyncTaskRunner's flow()")
        published = self._call("publish_flow", flow.publish(allow_unknown=allow_unknown))
        return [SyncTask.of(task, self) for task in published]

    def get_flow(self, flow_id: str) -> FlowView:
        """``TaskRunner.get_flow``, blocking (wait for a step with ``wait(key)``)."""
        return self._call("get_flow", self._runner.get_flow(flow_id))

    def close(self) -> None:
        """Close the connection and stop the facade's loop (idempotent); an application's
        ``client`` stays open."""
        try:
            self._call("close", self._runner.close())
        except RunnerClosed:
            return
        with self._lock:
            self._closed = True
            if self._client is not None:
                return
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncTaskRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
