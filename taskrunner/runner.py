"""``TaskRunner``: register handlers, publish tasks and run workers (the services' API)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from taskrunner.client import TaskClient

if TYPE_CHECKING:
    from pymongo import MongoClient

    from taskrunner.engine.observe import WorkerObserver
    from taskrunner.sync import SyncTaskRunner
    from taskrunner.worker_options import WorkerOptions


class TaskRunner(TaskClient):
    """Handlers plus a store. Services publish through it; workers run it.

    ``mongo_uri`` defaults to ``$TASKRUNNER_MONGO_URI`` or ``mongodb://localhost:27017``;
    pass ``store=MemoryStore()`` to run without MongoDB (tests). Everything but running
    workers comes from ``TaskClient``.
    """

    async def run_worker(
        self,
        options: WorkerOptions | None = None,
        *,
        observer: WorkerObserver | None = None,
        **fields: Any,
    ) -> None:
        """Run a worker for this runner's handlers until it is cancelled or stopped or,
        with ``drain=True``, until nothing runs and nothing is claimable now.

        ``options`` configures it (``WorkerOptions``); ``fields`` override single options,
        as in ``run_worker(concurrency=4)``; ``observer`` receives its events (metrics).
        Cancellation shuts down gracefully: running handlers get ``shutdown_timeout``
        seconds, then are cancelled and their claims released. Under ``asyncio.run``,
        Ctrl-C is that cancellation; SIGINTs within a second of the first (``uv run``
        forwards the terminal's) are the same request, not a ``KeyboardInterrupt`` in the
        middle of giving claims back.
        """
        # Imported here: the `taskrunner` command imports this module for every command, and
        # most never run a worker.
        from taskrunner.engine.interrupts import sigint_once
        from taskrunner.engine.worker import Worker

        worker = Worker(self, options, observer=observer, **fields)
        runner = asyncio.create_task(worker.run())
        with sigint_once():  # under asyncio.run, one Ctrl-C that arrives twice is one stop
            try:
                await asyncio.shield(runner)
            except asyncio.CancelledError:
                worker.stop()
                await runner
                raise

    def sync(self, *, client: MongoClient[Any] | None = None) -> SyncTaskRunner:
        """A blocking facade with the same semantics, for non-async code; on the
        application's own ``MongoClient`` if given (its sessions then take ``session=``)."""
        from taskrunner.sync import SyncTaskRunner

        return SyncTaskRunner(self, client=client)
