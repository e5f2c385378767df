"""Start and stop ``taskrunner`` processes: worker processes for the demo, tests and benchmarks.

One spawner for all three::

    env = worker_env(uri, collection="tasks", python_path=[apps_dir])
    with ProcessGroup(log_dir, env) as group:
        w1 = group.worker("w1", "apps:runner", "--concurrency", "2")
        w1.find("claimed", key="k")       # its JSON log lines with those fields
        w1.kill()                        # SIGKILL; terminate() is SIGTERM, pause()/resume() SIGSTOP/SIGCONT
        await group.terminate_all(5.0)   # SIGTERM, then SIGKILL what outlives the grace

Each process writes stdout and stderr to ``<directory>/<name>.log``; leaving the group
SIGKILLs whatever still runs. ``dev_server()`` runs ``taskrunner dev-server --port 0``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import Any

import taskrunner
from taskrunner.store import fields as f

PACKAGE_ROOT = Path(taskrunner.__file__).resolve().parents[1]


def worker_command(app: str, worker_id: str, *args: str) -> list[str]:
    """``taskrunner worker`` with JSON logs, run by this interpreter."""
    return [
        sys.executable,
        "-m",
        "taskrunner",
        "worker",
        "--app",
        app,
        "--worker-id",
        worker_id,
        "--log-format",
        "json",
        *args,
    ]


def worker_env(
    uri: str,
    *,
    collection: str = f.DEFAULT_COLLECTION,
    database: str = f.DEFAULT_DATABASE,
    python_path: Iterable[str | Path] = (),
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """This environment with the server and collection set, whatever the caller's says.

    ``python_path`` is prepended (where the app module lives); this very taskrunner is
    importable from any working directory.
    """
    paths = [*map(str, python_path), str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "TASKRUNNER_MONGO_URI": uri,
        "TASKRUNNER_DATABASE": database,
        "TASKRUNNER_COLLECTION": collection,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }


class LoggedProcess:
    """One subprocess whose stdout and stderr go to ``log_path``."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name, self.popen, self.log_path = name, popen, log_path

    @property
    def worker_id(self) -> str:
        """A worker process is named by its worker id."""
        return self.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, signum: int) -> None:
        if self.alive():
            with suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        """SIGTERM: a worker stops claiming, gives handlers --shutdown-timeout, releases their claims."""
        self.send(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: no release, so only lease expiry frees a worker's tasks."""
        self.send(signal.SIGKILL)

    def pause(self) -> None:
        self.send(signal.SIGSTOP)

    def resume(self) -> None:
        self.send(signal.SIGCONT)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    async def exited(self, within: float) -> int:
        """The exit code, waiting without blocking the event loop; TimeoutError after ``within`` s."""
        deadline = time.monotonic() + within
        while (code := self.popen.poll()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not exit within {within}s")
            await asyncio.sleep(0.05)
        return code

    def lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []

    def logs(self) -> list[dict[str, Any]]:
        """Every log line so far; a line that is not JSON becomes ``{"event": None, "raw": line}``."""
        return [_parse(line) for line in self.lines()]

    def find(self, event: str, **fields: Any) -> list[dict[str, Any]]:
        """JSON log lines whose ``event`` is ``event`` and whose fields equal ``fields``."""
        return [
            e
            for e in self.logs()
            if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
        ]

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.lines()[-lines:])

    def __repr__(self) -> str:
        return f"LoggedProcess({self.name!r}, pid={self.pid})"


def _parse(line: str) -> dict[str, Any]:
    try:
        parsed = json.loads(line)
    except json.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"event": None, "raw": line}


class ProcessGroup:
    """Processes started in one directory with one environment; leaving it SIGKILLs what still runs."""

    def __init__(self, directory: Path, env: Mapping[str, str]) -> None:
        self.directory, self.env = directory, dict(env)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, LoggedProcess] = {}

    def start(self, name: str, command: list[str], env: Mapping[str, str] | None = None) -> LoggedProcess:
        """Start ``command`` in the directory, its output appended to ``<name>.log``."""
        log_path = self.directory / f"{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                command,
                env={**self.env, **(env or {})},
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        process = self.processes[name] = LoggedProcess(name, popen, log_path)
        return process

    def worker(
        self, worker_id: str, app: str, *args: str, env: Mapping[str, str] | None = None
    ) -> LoggedProcess:
        """Start ``taskrunner worker --app APP --worker-id ID --log-format json ARGS``."""
        return self.start(worker_id, worker_command(app, worker_id, *args), env)

    def __getitem__(self, name: str) -> LoggedProcess:
        return self.processes[name]

    async def terminate_all(self, grace: float) -> None:
        """SIGTERM every live process (workers release their claims), SIGKILL any alive after ``grace``."""
        alive = [p for p in self.processes.values() if p.alive()]
        for process in alive:
            process.resume()
            process.terminate()
        with suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.exited(grace + 1) for p in alive)), grace)
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL (after SIGCONT, should one be stopped) whatever still runs, and reap it."""
        for process in self.processes.values():
            process.resume()
            process.kill()
        for process in self.processes.values():
            process.wait(10)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill_all()


@contextmanager
def dev_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Run ``taskrunner dev-server --port 0``; yield the process and the URI it printed first."""
    process = subprocess.Popen(
        [sys.executable, "-m", "taskrunner", "dev-server", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        uri = process.stdout.readline().strip()
        if not uri.startswith("mongodb://"):
            raise RuntimeError(f"dev-server printed {uri!r} instead of its URI")
        yield process, uri
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_http(url: str, process: LoggedProcess | None = None, within: float = 30) -> None:
    """Return once ``url`` answers at all (any HTTP status). After ``within`` seconds, or
    as soon as ``process`` (the server behind it) has exited, raise: with its log when given."""
    deadline = time.monotonic() + within
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            if process is not None and (time.monotonic() > deadline or not process.alive()):
                raise RuntimeError(f"{process.name} did not answer at {url}:\n{process.tail(40)}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
