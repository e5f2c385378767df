"""Process plumbing the benchmark scripts share: the dev server and worker processes.

``dev_server()`` runs ``taskrunner dev-server --port 0`` as a subprocess and yields its
URI; ``Processes`` starts ``taskrunner worker`` (or any other subprocess) with logs to
files in a tmp dir and always SIGKILLs what is left at the end; ``wait_until`` polls a
condition. Both build on taskrunner/dev/processes.py, the spawner the demo and tests use.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from taskrunner.dev import processes
from taskrunner.dev.processes import ProcessGroup

BENCH_DIR = Path(__file__).resolve().parent
APP = "apps:app"


@contextmanager
def dev_server() -> Iterator[str]:
    """Run ``taskrunner dev-server --port 0`` and yield the URI it prints first."""
    with processes.dev_server() as (_, uri):
        yield uri


class Processes:
    """Subprocesses whose stdout+stderr go to one file each (in a tmp dir); all SIGKILLed on exit."""

    def __init__(self, uri: str, collection: str, env: Mapping[str, str] | None = None) -> None:
        env = processes.worker_env(uri, collection=collection, python_path=[BENCH_DIR], extra=env)
        self.group = ProcessGroup(Path(tempfile.mkdtemp(prefix="bench-")), env)

    @property
    def names(self) -> list[str]:
        """Every process started, by name."""
        return list(self.group.processes)

    def start(self, name: str, command: list[str], env: Mapping[str, str] | None = None) -> None:
        self.group.start(name, command, env)

    def worker(self, worker_id: str, *args: str, env: Mapping[str, str] | None = None) -> None:
        """Start ``taskrunner worker --app apps:app --worker-id ID --log-format json ARGS``."""
        self.group.worker(worker_id, APP, *args, env=env)

    def events(self, name: str, event: str) -> list[dict[str, Any]]:
        """JSON log lines of ``name`` whose ``event`` is ``event``."""
        return self.group[name].find(event)

    def signal(self, name: str, signum: int) -> None:
        self.group[name].send(signum)

    async def wait_exit(self, name: str, within: float) -> None:
        await self.group[name].exited(within)

    def tail(self, name: str, lines: int = 20) -> str:
        return self.group[name].tail(lines)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.kill_all()
        shutil.rmtree(self.group.directory, ignore_errors=True)  # callers print log tails before leaving


async def wait_until(condition: Any, within: float, what: str, interval: float = 0.01) -> Any:
    """Await ``condition()`` until it returns something truthy; TimeoutError after ``within`` s."""
    deadline = time.monotonic() + within
    while not (value := await condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)
    return value


async def stop_and_count(procs: Processes, names: list[str]) -> tuple[Counter[str], Counter[str]]:
    """SIGTERM the processes; the sums of the ``round trips`` events each logs as it stops,
    by command and by job (a process that logs no jobs adds none)."""
    for name in names:
        procs.signal(name, signal.SIGTERM)
    commands: Counter[str] = Counter()
    jobs: Counter[str] = Counter()
    for name in names:
        await procs.wait_exit(name, 20)
        events = procs.events(name, "round trips")
        if not events:
            raise RuntimeError(f"{name} logged no round trips:\n{procs.tail(name)}")
        commands.update(events[-1]["commands"])
        jobs.update(events[-1].get("jobs", {}))
    return commands, jobs
