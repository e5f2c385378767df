"""A server outage is one log line per side task when it starts and one when it ends.

Real ``taskrunner worker`` processes of tests/apps/outage_app.py (a limited name, a
schedule firing every second: every side task talks to the server) against a server
that is not there at all, then through tests/fault_proxy.py while the server goes away
and comes back. docs/worker.md's log table names the lines; taskrunner/engine/outage.py keeps
the rule: a warning or error when failing starts, debug while it lasts, info at the end,
never a traceback for a server that does not answer.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy
from workers import WorkerPool, WorkerProcess, wait_exit

from taskrunner import Task, TaskRunner, TaskState
from taskrunner.dev.processes import free_port
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

Doc = dict[str, Any]
APP = "apps.outage_app:runner"
OUTAGE = 20.0  # seconds without a server: many retries of every side task
RECOVERED = {
    "registry heartbeat failed": "registry heartbeat recovered",
    "discovery lost the server; retrying": "discovery recovered",
    "cannot read the limits; retrying": "limits readable again",
    "scheduler cannot reach the server; retrying": "scheduler recovered",
    "claim failed": "claiming recovered",
    "cannot read the server's clock; retrying": "server clock recovered",
    "gates cannot reach the server; retrying": "gates recovered",
    "ping failed; retrying": "ping recovered",
    "workflow follow-ups failed; retrying": "workflow follow-ups recovered",
}
"""Each side task's outage line and the line that ends it."""
SIDE_TASKS_AWAY = {
    "registry heartbeat failed",
    "discovery lost the server; retrying",
    "cannot read the limits; retrying",
    "scheduler cannot reach the server; retrying",
    "gates cannot reach the server; retrying",
    "cannot read the server's clock; retrying",
}
"""What a worker that never reached the server says, once each."""
AWAY = {
    "registry heartbeat failed",
    "discovery lost the server; retrying",
    "scheduler cannot reach the server; retrying",
    "cannot read the limits; retrying",
}
"""Side tasks that talk to the server every few seconds: each notices an outage soon."""
ONCE = {"start-up check skipped", "claims recovered after a lost reply"}
"""Warnings that are not an outage's start: the start-up check that could not run, and a
claim the drop cut off on its way back (its landed claims were found once the server
answered; docs/worker.md)."""


def noisy(lines: list[Doc]) -> Counter[str]:
    """Warning and error lines by event name."""
    return Counter(str(e.get("event")) for e in lines if e.get("level") in ("warning", "error"))


def tracebacks(worker: WorkerProcess) -> list[str]:
    return [line for line in worker.lines() if "Traceback" in line]


async def hold(seconds: float) -> None:
    """Let ``seconds`` pass: the behaviour under test is what a worker logs over time."""
    since = time.monotonic()
    await wait_for(lambda: time.monotonic() - since >= seconds, seconds + 10, "time to pass", interval=0.2)


async def test_an_unreachable_server_logs_one_line_per_side_task(
    collection_name: str, tmp_path: Path
) -> None:
    """20 s against a port nothing listens on (`--timeout 2`): each side task says so once,
    no side task crashes or logs a traceback, and SIGTERM still stops the worker (exit 0)."""
    uri = f"mongodb://127.0.0.1:{free_port()}/"
    with WorkerPool(uri, collection_name, tmp_path, app=APP) as pool:
        worker = pool.start("w1", "--timeout", "2")
        await wait_for(lambda: worker.find("worker started"), 60, "the worker to start")
        await hold(OUTAGE)
        worker.terminate()
        assert await wait_exit(worker, 60) == 0, worker.tail(20)
    counts = noisy(worker.logs())
    print(f"{len(worker.lines())} lines; warnings and errors {dict(counts)}")
    assert not tracebacks(worker), tracebacks(worker)[:1]
    assert set(counts) >= SIDE_TASKS_AWAY, counts
    assert all(n == 1 for n in counts.values()), counts
    assert len(worker.lines()) <= 20, worker.tail(40)


async def done(runner: TaskRunner, key: str) -> Task | None:
    task = await runner.get(key)
    return task if task.state.finished else None


def events(lines: list[Doc], names: set[str]) -> set[str]:
    return {str(e.get("event")) for e in lines} & names


@pytest.mark.parametrize("starts_away", [False, True], ids=["while-working", "from-the-start"])
async def test_server_away_and_back_logs_one_line_each_way_per_side_task(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path, starts_away: bool
) -> None:
    """The server goes away for 20 s and comes back (FaultProxy drop/heal), while the
    worker works or from its start: each side task logs one line when it loses the server
    and one when it has it again, nothing else at warning level and no traceback; then
    tasks run and the schedule fires again."""
    with FaultProxy(mongo_uri) as proxy, WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        if starts_away:
            proxy.drop()
        worker = pool.start("w1", "--mongo-uri", proxy.uri, "--timeout", "1", "--beat-interval", "1")
        if not starts_away:
            await wait_for(lambda: worker.find("change stream opened"), 60, "the worker's stream")
            await runner.publish("paced", key="before")  # the gate keeper holds lanes from here on
            first = await wait_for(lambda: done(runner, "before"), 30, "a limited task")
            assert first.state is TaskState.SUCCESS
            await wait_for(lambda: worker.find("schedule fired"), 30, "the schedule to fire")
            proxy.drop()
        start = len(worker.lines())
        await wait_for(lambda: events(worker.logs()[start:], AWAY) == AWAY, 30, "the side tasks to notice")
        await hold(OUTAGE)
        during = worker.logs()[start:]
        healed = len(worker.lines())
        proxy.heal()

        expected = {RECOVERED[event] for event in noisy(during) if event in RECOVERED}
        await wait_for(
            lambda: events(worker.logs()[healed:], expected) == expected, 30, "every recovery line"
        )
        await runner.publish("quick", key="after")
        assert (await wait_for(lambda: done(runner, "after"), 30, "a task after")).state is TaskState.SUCCESS
        fired = len(worker.find("schedule fired"))
        await wait_for(lambda: len(worker.find("schedule fired")) > fired, 30, "the schedule to fire again")
        worker.terminate()
        assert await wait_exit(worker, 30) == 0
    logs = worker.logs()[start:]
    counts = noisy(logs)
    recoveries = Counter(str(e.get("event")) for e in logs if e.get("event") in set(RECOVERED.values()))
    print(f"warnings and errors {dict(counts)}; recoveries {dict(recoveries)}")
    assert not tracebacks(worker), tracebacks(worker)[:1]
    assert set(counts) >= AWAY, counts
    assert all(n == 1 for n in counts.values()), counts
    assert recoveries == Counter(RECOVERED[event] for event in counts if event in RECOVERED), recoveries
    assert set(counts) - set(RECOVERED) <= ONCE, counts  # no other warning
