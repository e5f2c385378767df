"""Process plumbing the benchmark scripts share: the dev server and worker processes.

``dev_server()`` runs ``taskrunner dev-server --port 0`` as a subprocess and yields its
URI; ``Processes`` starts ``taskrunner worker`` (or any other subprocess) with logs to
files and always SIGKILLs what is left at the end; ``wait_until`` polls a condition.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
APP = "apps:app"


@contextmanager
def dev_server() -> Iterator[str]:
    """Run ``taskrunner dev-server --port 0`` and yield the URI it prints first."""
    process = subprocess.Popen(
        [sys.executable, "-m", "taskrunner", "dev-server", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        uri = process.stdout.readline().strip()
        if not uri.startswith("mongodb://"):
            raise RuntimeError(f"dev-server printed {uri!r} instead of its URI")
        yield uri
    finally:
        process.kill()
        process.wait(10)


class Processes:
    """Subprocesses whose stdout+stderr go to one file each (in a tmp dir); all SIGKILLed on exit."""

    def __init__(self, uri: str, collection: str, env: Mapping[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-"))
        python_path = os.pathsep.join(p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "TASKRUNNER_MONGO_URI": uri, "TASKRUNNER_COLLECTION": collection,
                    "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1", **(env or {})}  # fmt: skip
        self.popens: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, command: list[str], env: Mapping[str, str] | None = None) -> None:
        with self.log(name).open("ab") as out:
            self.popens[name] = subprocess.Popen(
                command, env={**self.env, **(env or {})}, cwd=self.dir,
                stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            )  # fmt: skip

    def worker(self, worker_id: str, *args: str, env: Mapping[str, str] | None = None) -> None:
        """Start ``taskrunner worker --app apps:app --worker-id ID --log-format json ARGS``."""
        command = [sys.executable, "-m", "taskrunner", "worker", "--app", APP, "--worker-id", worker_id,
                   "--log-format", "json", *args]  # fmt: skip
        self.start(worker_id, command, env)

    def log(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def events(self, name: str, event: str) -> list[dict[str, Any]]:
        """JSON log lines of ``name`` whose ``event`` is ``event``."""
        found = []
        for line in self.log(name).read_text(errors="replace").splitlines():
            try:
                parsed = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(parsed, dict) and parsed.get("event") == event:
                found.append(parsed)
        return found

    def signal(self, name: str, signum: int) -> None:
        if self.popens[name].poll() is None:
            os.kill(self.popens[name].pid, signum)

    async def wait_exit(self, name: str, within: float) -> None:
        deadline = time.monotonic() + within
        while self.popens[name].poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not exit within {within}s")
            await asyncio.sleep(0.05)

    def tail(self, name: str, lines: int = 20) -> str:
        return "\n".join(self.log(name).read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for popen in self.popens.values():
            if popen.poll() is None:
                popen.send_signal(signal.SIGKILL)
        for popen in self.popens.values():
            popen.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)  # callers print log tails before leaving


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
