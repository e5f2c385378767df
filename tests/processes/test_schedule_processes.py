"""Schedules fired by real ``taskrunner worker`` processes (tests/apps/schedule_app.py).

Exactly one task per tick across workers, no tick missing while a worker is up (also
when the schedule's owner is SIGKILLed), and each catch-up policy after downtime.
"""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from typer.testing import CliRunner, Result
from workers import WorkerPool

from taskrunner import TaskRunner
from taskrunner.cli import app
from taskrunner.schedules.recurrence import iso
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

APP = "apps.schedule_app:runner"
Doc = dict[str, Any]


async def _tasks(mongo_uri: str, collection: str, schedule_id: str) -> list[Doc]:
    async with AsyncMongoClient[Doc](mongo_uri, tz_aware=True) as client:
        found = client.taskrunner[collection].find({"key": {"$regex": f"^{schedule_id}@"}}).sort("key", 1)
        return await found.to_list()


def _tick(doc: Doc) -> datetime:
    return datetime.fromisoformat(doc["key"].split("@", 1)[1].replace("Z", "+00:00"))


async def test_four_workers_fire_each_tick_once_and_none_is_lost_when_the_owner_dies(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """Four workers with a 1 s schedule publish exactly one task per tick, with no gap, also across a SIGKILL of the one firing it."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        workers = pool.start_many(["s1", "s2", "s3", "s4"], "--beat-interval", "0.5")
        await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")
        await wait_for(lambda: _count(mongo_uri, collection_name, 6), 60, "six ticks")
        owner = max(workers, key=lambda w: len(w.find("schedule fired", schedule="tick")))
        owner.kill()
        before = len(await _tasks(mongo_uri, collection_name, "tick"))
        await wait_for(lambda: _count(mongo_uri, collection_name, before + 8), 60, "eight more ticks")
        live = [w for w in workers if w is not owner]
        await wait_for(lambda: _all_done(mongo_uri, collection_name), 60, "the tick tasks to finish")
    docs = await _tasks(mongo_uri, collection_name, "tick")
    ticks = [_tick(d) for d in docs]
    assert ticks == sorted(set(ticks)), "one task per tick"
    gaps = [b - a for a, b in itertools.pairwise(ticks) if b - a != timedelta(seconds=1)]
    assert not gaps, f"ticks missing: {gaps}"
    assert all([e["state"] for e in d["workers"]].count("SUCCESS") == 1 for d in docs), "each ran once"
    assert sum(1 for w in live if w.find("schedule fired", schedule="tick")) >= 1


async def _count(mongo_uri: str, collection: str, at_least: int) -> int | None:
    found = len(await _tasks(mongo_uri, collection, "tick"))
    return found if found >= at_least else None


async def _all_done(mongo_uri: str, collection: str) -> bool:
    docs = await _tasks(mongo_uri, collection, "tick")
    return all(d["state"] == "SUCCESS" for d in docs)


async def test_catch_up_policies_after_five_hours_of_downtime(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """After 5 h with no worker, an hourly schedule fires its latest missed tick ("latest"), up to max_catch_up ticks ("all") or none ("none")."""
    now = datetime.now(UTC)
    hour = now.replace(minute=0, second=0, microsecond=0)
    down_since = hour - timedelta(hours=5)
    async with AsyncMongoClient[Doc](mongo_uri, tz_aware=True) as client:
        schedules = client.taskrunner[f"{collection_name}.schedules"]
        for policy in ("latest", "all", "none"):
            await schedules.insert_one(
                {
                    "_id": f"hourly-{policy}",
                    "name": "noop",
                    "cron": "0 * * * *",
                    "catch_up": policy,
                    "paused": False,
                    "created_at": down_since,
                    "last_tick": down_since,
                    "last_key": f"hourly-{policy}@{iso(down_since)}",
                }
            )
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        worker = pool.start("s1")
        # The schedules are fired in id order, "tick" last: once it fired, the hourly ones were judged.
        await wait_for(lambda: worker.find("schedule fired", schedule="tick"), 60, "a first pass")
    missed = [hour - timedelta(hours=n) for n in (4, 3, 2, 1, 0)]
    on_time = (datetime.now(UTC) - hour).total_seconds() < 10  # the newest tick may count as on time
    latest = [_tick(d) for d in await _tasks(mongo_uri, collection_name, "hourly-latest")]
    every = [_tick(d) for d in await _tasks(mongo_uri, collection_name, "hourly-all")]
    none = [_tick(d) for d in await _tasks(mongo_uri, collection_name, "hourly-none")]
    assert latest == [hour]
    assert every == missed  # five missed ticks, max_catch_up=5
    assert none == [] or (on_time and none == [hour])


def _cli(mongo_uri: str, collection: str, *args: str) -> Result:
    where = ["--mongo-uri", mongo_uri, "--collection", collection]
    return CliRunner(env={"COLUMNS": "250"}).invoke(
        app, [*args, *where] if len(args) < 2 else [args[0], *where, *args[1:]]
    )


async def test_schedules_cli_lists_pauses_resumes_and_triggers(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """`taskrunner schedules` lists the live app's schedules; pause stops the ticks, trigger publishes one task, an unknown id exits 1."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        worker = pool.start("s1")
        await wait_for(lambda: worker.find("schedule fired", schedule="tick"), 60, "a first tick")
        listed = await asyncio.to_thread(_cli, mongo_uri, collection_name, "schedules")
        assert listed.exit_code == 0, listed.output
        assert (
            "tick" in listed.stdout and "every 1s (UTC)" in listed.stdout and "orphaned" not in listed.stdout
        )
        paused = await asyncio.to_thread(_cli, mongo_uri, collection_name, "schedules", "pause", "tick")
        assert paused.exit_code == 0 and "paused schedule tick" in paused.stdout
        paused_at = await runner.store.server_time()
        await asyncio.sleep(3)  # three of the 1 s schedule's ticks fall due, none may fire
        ticks = [_tick(d) for d in await _tasks(mongo_uri, collection_name, "tick")]
        # A tick in flight when pausing may land, but none due after the pause.
        assert ticks and max(ticks) <= paused_at, (max(ticks), paused_at)
        before = len(ticks)
        triggered = await asyncio.to_thread(
            _cli, mongo_uri, collection_name, "schedules", "trigger", "hourly-all"
        )
        assert triggered.exit_code == 0 and triggered.stdout.startswith("hourly-all@trigger-")
        await wait_for(lambda: _finished(runner, triggered.stdout.strip()), 30, "the triggered task")
        resumed = await asyncio.to_thread(_cli, mongo_uri, collection_name, "schedules", "resume", "tick")
        assert resumed.exit_code == 0
        await wait_for(lambda: _count(mongo_uri, collection_name, before + 2), 30, "ticks after resume")
        unknown = await asyncio.to_thread(_cli, mongo_uri, collection_name, "schedules", "pause", "nope")
        assert unknown.exit_code == 1 and "no schedule with id 'nope'" in unknown.stderr


async def _finished(runner: TaskRunner, key: str) -> bool:
    return (await runner.get(key)).state.finished
