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
with ``tests/`` on ``PYTHONPATH`` (so ``apps.acceptance_app:runner`` imports), the
URI and collection in ``TASKRUNNER_MONGO_URI``/``TASKRUNNER_COLLECTION``, and
``ACCEPTANCE_MARKS`` pointing at the pool's marks directory. Leaving the pool
resumes and SIGKILLs whatever still runs, and prints each worker's log tail when the
block raised (pytest shows it with the failure).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from pymongo import AsyncMongoClient

from taskrunner import Task, TaskRunner
from taskrunner.testing import wait_for

TESTS_DIR = Path(__file__).resolve().parent
ACCEPTANCE_APP = "apps.acceptance_app:runner"
T = TypeVar("T")
Doc = dict[str, Any]


class WorkerProcess:
    """One ``taskrunner worker`` process; its stderr (JSON log lines) goes to ``log_path``."""

    def __init__(self, worker_id: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.worker_id, self.popen, self.log_path = worker_id, popen, log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, signum: int) -> None:
        if self.alive():
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        """SIGTERM: stop claiming, give handlers --shutdown-timeout, release their claims."""
        self.send(signal.SIGTERM)

    def kill(self) -> None:
        self.send(signal.SIGKILL)

    def pause(self) -> None:
        self.send(signal.SIGSTOP)

    def resume(self) -> None:
        self.send(signal.SIGCONT)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def logs(self) -> list[Doc]:
        """Every log line so far; a line that is not JSON becomes ``{"event": None, "raw": line}``."""
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        out: list[Doc] = []
        for line in lines:
            try:
                parsed = json.loads(line)
            except json.JSONDecodeError:
                parsed = None
            out.append(parsed if isinstance(parsed, dict) else {"event": None, "raw": line})
        return out

    def find(self, event: str, **fields: Any) -> list[Doc]:
        """Log events named ``event`` whose fields equal ``fields``."""
        return [
            e
            for e in self.logs()
            if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
        ]

    def __repr__(self) -> str:
        return f"WorkerProcess({self.worker_id!r}, pid={self.pid})"


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
        self.uri, self.collection, self.database, self.app = uri, collection, database, app
        self.dir = tmp_path
        self.marks_dir = tmp_path / "marks"
        self.marks_dir.mkdir(parents=True, exist_ok=True)
        self.workers: list[WorkerProcess] = []
        python_path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "TASKRUNNER_MONGO_URI": uri, "TASKRUNNER_COLLECTION": collection,
                    "TASKRUNNER_DATABASE": database, "PYTHONPATH": python_path,
                    "ACCEPTANCE_MARKS": str(self.marks_dir), "PYTHONUNBUFFERED": "1", **(env or {})}  # fmt: skip

    def start(self, worker_id: str, *args: str) -> WorkerProcess:
        """Start ``taskrunner worker`` with this id; ``args`` are extra CLI options."""
        log_path = self.dir / f"{worker_id}.log"
        command = [sys.executable, "-m", "taskrunner", "worker", "--app", self.app, "--worker-id", worker_id,
                   "--log-format", "json", *args]  # fmt: skip
        with log_path.open("ab") as stderr:
            popen = subprocess.Popen(
                command, env=self.env, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr
            )
        worker = WorkerProcess(worker_id, popen, log_path)
        self.workers.append(worker)
        return worker

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
        for worker in self.workers:
            worker.resume()
            worker.kill()
        for worker in self.workers:
            worker.popen.wait(10)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()
        if exc is not None:
            for worker in self.workers:
                tail = (
                    worker.log_path.read_text(errors="replace").splitlines()[-40:]
                    if worker.log_path.exists()
                    else []
                )
                print(f"--- {worker.worker_id} (exit {worker.popen.returncode}) ---", *tail, sep="\n")


async def finished(runner: TaskRunner, *keys: str) -> list[Task] | None:
    """The tasks, once every one of them is SUCCESS, FAIL or CANCELED (for ``wait_for``)."""
    tasks = [await runner.get(key) for key in keys]
    return tasks if all(t.state.finished for t in tasks) else None


async def wait_exit(worker: WorkerProcess, within: float) -> int:
    """The worker's exit code, waiting without blocking the event loop."""
    await wait_for(lambda: not worker.alive(), within, f"{worker.worker_id} to exit")
    code = worker.popen.returncode
    assert code is not None
    return code


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


@contextmanager
def dev_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Runs `taskrunner dev-server --port 0` and yields it with the URI it printed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "taskrunner", "dev-server", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        uri = process.stdout.readline().strip()
        assert uri.startswith("mongodb://127.0.0.1:"), process.stderr and process.stderr.read()
        yield process, uri
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
