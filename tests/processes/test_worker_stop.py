"""Stopping a real ``taskrunner worker`` by signal, however it was started.

A terminal's Ctrl-C reaches the whole foreground process group, and ``uv run`` forwards
SIGINT (200 ms later when not attached to a terminal) and SIGTERM to its child too: a
worker started by ``uv run`` sees one stop request as two signals. Both must still mean
one graceful stop that gives every claim back (PENDING, no failure spent) and exits 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from workers import ACCEPTANCE_APP, TESTS_DIR, wait_exit

from taskrunner import TaskRunner, TaskState
from taskrunner.dev.processes import PACKAGE_ROOT, LoggedProcess, worker_command, worker_env
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

UV = shutil.which("uv")


@contextmanager
def session_leader(
    name: str, command: list[str], env: dict[str, str], tmp_path: Path
) -> Iterator[LoggedProcess]:
    """``command`` in a session (and process group) of its own, as ``setsid`` starts it;
    whatever of the group still runs is SIGKILLed on the way out."""
    log_path = tmp_path / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            command,
            env=env,
            cwd=PACKAGE_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    process = LoggedProcess(name, popen, log_path)
    try:
        yield process
    except BaseException:
        print(f"--- {name} (exit {process.returncode}) ---", process.tail(40), sep="\n")
        raise
    finally:
        with suppress(ProcessLookupError):  # the group may be gone already
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait(10)


async def _running(runner: TaskRunner, worker: LoggedProcess, key: str) -> None:
    """Publish a long task for ``wx`` and wait until it runs there."""
    await wait_for(lambda: worker.find("worker started"), 60, "the worker to start")
    await runner.publish("sleep", {"seconds": 120}, key=key, worker_ids=["wx"], ping_timeout=60)
    await wait_for(lambda: worker.find("run started", key=key), 60, "the task to run on wx")


async def _stopped_gracefully(runner: TaskRunner, worker: LoggedProcess, key: str) -> None:
    """The worker exited 0 after giving its claim back: PENDING, no failure spent."""
    assert await wait_exit(worker, 30) == 0, worker.tail(40)
    task = await runner.get(key)
    assert (task.state, task.failures, task.workers) == (TaskState.PENDING, 0, []), task
    assert worker.find("claim released", key=key, reason="worker shutting down")
    assert not [line for line in worker.lines() if "second signal" in line or "Traceback" in line]


@pytest.mark.skipif(UV is None, reason="uv is not on PATH")
async def test_ctrl_c_on_uv_run_releases_claims_and_exits_0(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """`setsid uv run taskrunner worker`, SIGINT to its group: the worker gets it twice
    (the group's and uv's forward) and still stops gracefully: its task is PENDING with
    no failure spent, and it exits 0."""
    assert UV is not None
    env = worker_env(mongo_uri, collection=collection_name, python_path=[TESTS_DIR])
    # `python -m taskrunner worker ...` less `python -m`: `uv run taskrunner worker ...`,
    # the README's way (without a sync, which needs nothing here).
    command = [UV, "run", "--no-sync", *worker_command(ACCEPTANCE_APP, "wx")[2:]]
    with session_leader("wx", command, env, tmp_path) as worker:
        await _running(runner, worker, "uv-ctrl-c")
        os.killpg(worker.pid, signal.SIGINT)
        await _stopped_gracefully(runner, worker, "uv-ctrl-c")


async def test_two_quick_signals_to_the_group_are_one_graceful_stop(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """`python -m taskrunner worker` sent SIGINT to its group twice within a second (as a
    group signal plus a forward deliver it) stops gracefully: task PENDING, failures 0, exit 0."""
    env = worker_env(mongo_uri, collection=collection_name, python_path=[TESTS_DIR])
    with session_leader("wx", worker_command(ACCEPTANCE_APP, "wx"), env, tmp_path) as worker:
        await _running(runner, worker, "two-sigints")
        os.killpg(worker.pid, signal.SIGINT)
        # Sent back to back, two SIGINTs may merge into one pending signal: the second
        # goes once the worker acted on the first, a few milliseconds later.
        await wait_for(lambda: worker.find("waiting for running tasks"), 30, "the stop", interval=0.01)
        os.killpg(worker.pid, signal.SIGINT)
        await _stopped_gracefully(runner, worker, "two-sigints")


_RUN_WORKER_SCRIPT = """
import asyncio

from taskrunner import MemoryStore, TaskContext, TaskRunner

runner = TaskRunner(store=MemoryStore())


@runner.task("sleep")
async def sleep(params: dict[str, object], ctx: TaskContext) -> None:
    print("handler running", flush=True)
    await asyncio.sleep(120)


async def main() -> None:
    await runner.publish("sleep", {}, key="k")
    try:
        await runner.run_worker(shutdown_timeout=1)
    finally:
        task = await runner.get("k")
        print("after stop:", task.state.value, task.failures, len(task.workers), flush=True)


asyncio.run(main())
"""


@pytest.mark.skipif(UV is None, reason="uv is not on PATH")
async def test_ctrl_c_on_a_script_running_run_worker_under_uv_releases_claims(tmp_path: Path) -> None:
    """`uv run python app.py` whose `asyncio.run(main())` awaits `runner.run_worker()`, SIGINT
    to its group: uv's forward of the same Ctrl-C does not raise KeyboardInterrupt inside
    the graceful stop, which gives the claim back (PENDING, no failure, no entry)."""
    assert UV is not None
    script = tmp_path / "app.py"
    script.write_text(_RUN_WORKER_SCRIPT)
    command = [UV, "run", "--no-sync", "python", str(script)]
    with session_leader("script", command, dict(os.environ), tmp_path) as process:

        def printed(text: str) -> list[str]:
            return [line for line in process.lines() if text in line]

        await wait_for(lambda: printed("handler running"), 60, "the handler to run")
        os.killpg(process.pid, signal.SIGINT)
        await wait_for(lambda: printed("after stop:"), 30, "run_worker to return")
        await wait_exit(process, 30)  # KeyboardInterrupt, as asyncio.run ends after a Ctrl-C
        assert printed("after stop: PENDING 0 0") and printed("claim released"), process.tail(30)
