"""Real ``taskrunner worker`` processes for tests, their JSON logs, and waiting helpers.

The API, kept small for every test module that needs worker processes::

    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        w1, w2 = pool.start_many(["w1", "w2"], "--concurrency", "2")
        await wait_for(lambda: w1.find("worker started"), 30, "w1 to start")
        ...
        w1.kill()                    # SIGKILL; also terminate() (SIGTERM), pause() (SIGSTOP), resume()
        w1.find("claimed", key="k")  # JSON log events of that worker matching the fields
        pool.marks(key="k")          # handler start/finish marks of tests/apps/acceptance_app.py

    async with ChangeRecorder(mongo_uri, collection_name) as changes:   # open before publishing
        ...
        changes.documents           # (monotonic receive time, fullDocument) of every event

Workers run ``python -m taskrunner worker --app APP --worker-id ID --log-format json``
(started by taskrunner/dev/processes.py, as the demo's and the benchmarks' are)
with ``tests/`` on ``PYTHONPATH`` (so ``apps.acceptance_app:runner`` imports), the
URI and collection in ``TASKRUNNER_MONGO_URI``/``TASKRUNNER_COLLECTION``, and
``ACCEPTANCE_MARKS`` pointing at the pool's marks directory. Leaving the pool
resumes and SIGKILLs whatever still runs, and prints each worker's log tail when the
block raised (pytest shows it with the failure).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from pymongo import AsyncMongoClient

from taskrunner import Task, TaskRunner
from taskrunner.dev.processes import LoggedProcess, ProcessGroup, dev_server, worker_env
from taskrunner.testing import wait_for

__all__ = [
    "ChangeRecorder",
    "WorkerPool",
    "WorkerProcess",
    "dev_server",
    "finished",
    "peers_known",
    "wait_exit",
    "wait_for",
]

TESTS_DIR = Path(__file__).resolve().parent
ACCEPTANCE_APP = "apps.acceptance_app:runner"
T = TypeVar("T")
Doc = dict[str, Any]


# A worker process of the tests: taskrunner.dev.processes starts the demo's and benchmarks' too.
WorkerProcess = LoggedProcess


class WorkerPool:
    """Starts worker processes on one collection and always cleans them up."""

    def __init__(
        self,
        uri: str,
        collection: str,
        tmp_path: Path,
        *,
        app: str = ACCEPTANCE_APP,
        database: str = "taskrunner",
        env: dict[str, str] | None = None,
    ) -> None:
        self.app = app
        self.marks_dir = tmp_path / "marks"
        self.marks_dir.mkdir(parents=True, exist_ok=True)
        extra = {"ACCEPTANCE_MARKS": str(self.marks_dir), **(env or {})}
        env = worker_env(uri, collection=collection, database=database, python_path=[TESTS_DIR], extra=extra)
        self.group = ProcessGroup(tmp_path, env)

    @property
    def workers(self) -> list[WorkerProcess]:
        return list(self.group.processes.values())

    def start(self, worker_id: str, *args: str) -> WorkerProcess:
        """Start ``taskrunner worker`` with this id; ``args`` are extra CLI options."""
        return self.group.worker(worker_id, self.app, *args)

    def start_many(self, worker_ids: list[str], *args: str) -> list[WorkerProcess]:
        return [self.start(worker_id, *args) for worker_id in worker_ids]

    def marks(self, **fields: Any) -> list[Doc]:
        """Handler marks (see tests/apps/acceptance_app.py) of every worker, by time."""
        lines = [line for path in self.marks_dir.glob("*.jsonl") for line in path.read_text().splitlines()]
        marks = [json.loads(line) for line in lines if line.endswith("}")]  # not a line being written
        return sorted(
            (m for m in marks if all(m.get(k) == v for k, v in fields.items())), key=lambda m: m["t"]
        )

    def stop_all(self) -> None:
        self.group.kill_all()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.group.kill_all()
        if exc is not None:
            for worker in self.workers:
                print(f"--- {worker.worker_id} (exit {worker.returncode}) ---", worker.tail(40), sep="\n")


async def finished(runner: TaskRunner, *keys: str) -> list[Task] | None:
    """The tasks, once every one of them is SUCCESS, FAIL or CANCELED (for ``wait_for``)."""
    tasks = [await runner.get(key) for key in keys]
    return tasks if all(t.state.finished for t in tasks) else None


async def peers_known(runner: TaskRunner, worker_ids: list[str], within: float = 60) -> None:
    """Wait until each of ``worker_ids`` has read a registry holding all of them: every one is
    registered, and each has beaten since the last of them registered (a worker reads the
    registry right after writing its beat)."""

    async def registered() -> datetime | None:
        beats = {w.worker_id: w.beat_at for w in await runner.workers()}
        if not set(worker_ids) <= set(beats) or any(beats[w] is None for w in worker_ids):
            return None
        return max(beat for w in worker_ids if (beat := beats[w]) is not None)

    async def beaten_since(moment: datetime) -> bool:
        beats = {w.worker_id: w.beat_at for w in await runner.workers()}
        return all((beat := beats.get(w)) is not None and beat > moment for w in worker_ids)

    last = await wait_for(registered, within, "every worker to register")
    await wait_for(lambda: beaten_since(last), within, "every worker to read the registry again")


async def wait_exit(worker: WorkerProcess, within: float) -> int:
    """The worker's exit code, waiting without blocking the event loop."""
    try:
        return await worker.exited(within)
    except TimeoutError:
        raise AssertionError(f"timed out after {within}s waiting for {worker.worker_id} to exit") from None


class ChangeRecorder:
    """Records every change event's ``fullDocument`` (updateLookup) with its receive time.

    Open it before publishing: the stream starts when ``__aenter__`` returns.
    """

    def __init__(self, uri: str, collection: str, *, database: str = "taskrunner") -> None:
        self.client: AsyncMongoClient[Doc] = AsyncMongoClient(uri, tz_aware=True)
        self.collection = self.client[database][collection]
        self.documents: list[tuple[float, Doc]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ChangeRecorder:
        stream = await self.collection.watch(full_document="updateLookup", max_await_time_ms=200)

        async def follow() -> None:
            async with stream:
                async for change in stream:
                    if change.get("fullDocument") is not None:
                        self.documents.append((time.monotonic(), change["fullDocument"]))

        self._task = asyncio.create_task(follow())
        return self

    async def __aexit__(self, *exc: object) -> None:
        failed = self._task is not None and self._task.done() and not self._task.cancelled()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.close()
        if failed:  # the stream died: the recorded events are incomplete
            assert self._task is not None
            raise AssertionError("the change stream failed") from self._task.exception()

    def of(self, key: str) -> list[tuple[float, Doc]]:
        return [(t, doc) for t, doc in self.documents if doc.get("key") == key]
