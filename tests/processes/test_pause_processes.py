"""Pausing task names with real ``taskrunner worker`` processes and the CLI: workers stop
claiming a paused name within a second (judged from server times in the documents),
running tasks finish, publishing goes on, and resuming runs the backlog."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from typer.testing import CliRunner, Result
from workers import WorkerPool, WorkerProcess

from taskrunner import TaskRunner, TaskState
from taskrunner.cli import app
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo
Doc = dict[str, Any]


async def _cli(mongo_uri: str, collection: str, *args: str) -> Result:
    """The CLI in a thread: it runs its own event loop, and the test's keeps going."""
    where = ["--mongo-uri", mongo_uri, "--collection", collection]
    result = await asyncio.to_thread(CliRunner(env={"COLUMNS": "250"}).invoke, app, [*args, *where])
    assert result.exit_code == 0, result.output
    return result


async def _states(runner: TaskRunner, prefix: str) -> dict[str, int]:
    tasks = await runner.list_tasks(limit=1000)
    counts: dict[str, int] = {}
    for task in tasks:
        if task.key.startswith(prefix):
            counts[task.state.value] = counts.get(task.state.value, 0) + 1
    return counts


async def _all_succeeded(runner: TaskRunner, prefix: str, n: int) -> bool:
    return (await _states(runner, prefix)).get(TaskState.SUCCESS.value, 0) == n


async def test_a_paused_name_is_not_claimed_until_resumed_and_other_names_run_on(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """``taskrunner pause quick``: while tasks of "quick" keep being published, no worker
    claims one later than 1 s after the pause (server time), "sleep" tasks still run, the
    pause shows in ``stats``, ``workers`` and the limits collection; ``resume`` runs the backlog."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = pool.start_many(["w1", "w2"], "--beat-interval", "0.5")
        await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")
        feeding = asyncio.create_task(_feed(runner, "q", 60, 0.05))
        await wait_for(lambda: _some_succeeded(runner, "q", 3), 30, "the first fed tasks to run")
        await _cli(mongo_uri, collection_name, "pause", "quick")
        await feeding
        await runner.publish_many(
            [{"name": "sleep", "params": {"seconds": 0.01}, "key": f"s{i}"} for i in range(5)]
        )
        await wait_for(lambda: _all_succeeded(runner, "s", 5), 60, "the other name's tasks")
        await wait_for(lambda: _shown_paused(mongo_uri, collection_name), 30, "workers to show the pause")
        stats = json.loads((await _cli(mongo_uri, collection_name, "stats", "--json")).stdout)
        limits = await _limit_docs(mongo_uri, collection_name)
        paused = await _states(runner, "q")
        await _cli(mongo_uri, collection_name, "resume", "quick")
        await wait_for(lambda: _all_succeeded(runner, "q", 60), 60, "the backlog after resume")
    docs = await _docs(mongo_uri, collection_name, "q")
    paused_at = limits["quick"]["paused_at"].timestamp()
    resumed_at = (await _limit_docs(mongo_uri, collection_name))["quick"]["resumed_at"].timestamp()
    late = [d["key"] for d in docs if paused_at + 1.0 < d["workers"][0]["claimed_at"] < resumed_at]
    assert late == [], f"claimed more than 1 s after the pause: {late}"
    assert paused.get("PENDING", 0) > 0, "tasks published after the pause waited"
    assert stats["paused"] == ["quick"] and limits["quick"]["paused"] is True


async def test_pause_all_lets_running_tasks_finish_and_resume_all_restarts_everything(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """``pause --all``: a task already running finishes SUCCESS, nothing new starts for 3 s
    (new tasks are still published); ``resume --all`` runs them all."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = pool.start_many(["w1"])
        await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "the worker to start")
        await runner.publish("sleep", {"seconds": 2}, key="long")
        await wait_for(lambda: _running(runner, "long"), 60, "the long task to start")
        await runner.pause("*")
        await wait_for(lambda: _read_pause(workers, "quick"), 30, "the worker to read the pause")
        await runner.publish_many([{"name": "quick", "key": f"n{i}"} for i in range(5)])
        long = await wait_for(lambda: _finished(runner, "long"), 60, "the running task to finish")
        await asyncio.sleep(3)  # nothing may start for 3 s (the behaviour under test)
        waiting = await _states(runner, "n")
        assert await runner.paused() == ["*"]
        await runner.resume("*")
        await wait_for(lambda: _all_succeeded(runner, "n", 5), 60, "the tasks after resume --all")
    assert long.state is TaskState.SUCCESS
    assert waiting == {"PENDING": 5}
    assert await runner.paused() == []


async def _some_succeeded(runner: TaskRunner, prefix: str, n: int) -> bool:
    return (await _states(runner, prefix)).get(TaskState.SUCCESS.value, 0) >= n


def _read_pause(workers: list[WorkerProcess], name: str) -> bool:
    """Whether every worker has logged ``name`` among its paused names."""
    return all(any(name in e["paused"] for e in w.find("paused names changed")) for w in workers)


async def _feed(runner: TaskRunner, prefix: str, n: int, every: float) -> None:
    for i in range(n):
        await runner.publish("quick", key=f"{prefix}{i:03d}")
        await asyncio.sleep(every)


async def _running(runner: TaskRunner, key: str) -> bool:
    return (await runner.get(key)).state is TaskState.RUNNING


async def _finished(runner: TaskRunner, key: str) -> Any:
    task = await runner.get(key)
    return task if task.state.finished else None


async def _shown_paused(mongo_uri: str, collection: str) -> bool:
    async with AsyncMongoClient[Doc](mongo_uri) as client:
        workers = await client.taskrunner[f"{collection}.workers"].find().to_list()
    return len(workers) == 2 and all(w.get("paused") == ["quick"] for w in workers)


async def _limit_docs(mongo_uri: str, collection: str) -> dict[str, Doc]:
    async with AsyncMongoClient[Doc](mongo_uri, tz_aware=True) as client:
        return {d["_id"]: d async for d in client.taskrunner[f"{collection}.limits"].find()}


async def _docs(mongo_uri: str, collection: str, prefix: str) -> list[Doc]:
    async with AsyncMongoClient[Doc](mongo_uri, tz_aware=True) as client:
        found = client.taskrunner[collection].find({"key": {"$regex": f"^{prefix}"}})
        docs = await found.to_list()
    for doc in docs:
        for entry in doc["workers"]:
            entry["claimed_at"] = entry["claimed_at"].timestamp()
    return docs


async def test_resume_makes_the_backlog_claimable_within_a_second(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """``taskrunner resume quick`` after tasks of quick were published while paused: every
    one of them is claimed within 1 s of the resume (``resumed_at`` against ``claimed_at``,
    server times), none before it."""
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = pool.start_many(["w1", "w2"], "--beat-interval", "0.5")
        await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")
        await _cli(mongo_uri, collection_name, "pause", "quick")
        await wait_for(lambda: _holding(workers, "quick"), 30, "both workers to hold quick back")
        await runner.publish_many([{"name": "quick", "key": f"r{i}"} for i in range(8)])
        await _cli(mongo_uri, collection_name, "resume", "quick")
        await wait_for(lambda: _all_succeeded(runner, "r", 8), 60, "the backlog after resume")
    docs = await _docs(mongo_uri, collection_name, "r")
    resumed_at = (await _limit_docs(mongo_uri, collection_name))["quick"]["resumed_at"].timestamp()
    waits = sorted(d["workers"][0]["claimed_at"] - resumed_at for d in docs)
    assert waits[0] >= 0 and waits[-1] <= 1.0, waits


def _holding(workers: list[Any], name: str) -> bool:
    """Whether every worker logged that it holds ``name`` back (it logs each change)."""
    return all(
        any(name in line.get("paused", []) for line in w.find("paused names changed")) for w in workers
    )
