"""Workflows as the `taskrunner` command shows them: `flow ID`, and waiting tasks in `show`,
`list` and `stats` (a subprocess against a MongoDB-compatible server)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from taskrunner import TaskRunner

pytestmark = pytest.mark.mongo


async def cli(*args: str, uri: str, collection: str) -> subprocess.CompletedProcess[str]:
    """``python -m taskrunner ARGS`` on the test's collection (stdout is a pipe: one line per row)."""
    env = {**os.environ, "TASKRUNNER_MONGO_URI": uri, "TASKRUNNER_COLLECTION": collection}
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "taskrunner", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


async def publish_fan(runner: TaskRunner) -> None:
    """Flow ``nightly``: extract -> 10 transforms -> load."""
    flow = runner.flow("nightly")
    extract = flow.add("extract", {})
    parts = flow.group(*[("transform", {"part": i}) for i in range(10)], after=extract)
    flow.add("load", {}, after=parts)
    await flow.publish()


async def test_flow_command_draws_the_graph_and_lists_each_step(
    runner: TaskRunner, mongo_uri: str, collection_name: str
) -> None:
    """`flow ID` prints the flow's state, its graph as 1 -> 10 -> 1 levels and each step with its
    level and what it waits on; `--json` has every step; an unknown id exits 1 naming it."""
    await publish_fan(runner)
    shown = await cli("flow", "nightly", uri=mongo_uri, collection=collection_name)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[:2] == [
        "flow nightly: RUNNING",
        "12 steps in 3 levels (11 WAITING, 1 PENDING); 0 compensations",
    ]
    graph = lines[lines.index("graph: each step runs after steps of the levels above it") + 1 :][:5]
    assert graph == [
        "1 step    nightly/extract PENDING",
        "  ↓",
        "10 steps  transform (10): 10 WAITING",
        "  ↓",
        "1 step    nightly/load WAITING",
    ]
    load = next(line for line in lines if line.startswith("│ nightly/load "))
    waits = "nightly/transform, nightly/transform-2, nightly/transform-3 and 7 more"
    assert "│ 3 " in load and f"waits on {waits}" in load
    as_json = await cli("flow", "nightly", "--json", uri=mongo_uri, collection=collection_name)
    view = json.loads(as_json.stdout)
    assert view["state"] == "RUNNING" and len(view["steps"]) == 12 and view["compensations"] == []
    assert view["steps"][-1]["waiting_on"] == [
        f"nightly/transform{s}" for s in ["", *(f"-{i}" for i in range(2, 11))]
    ]
    missing = await cli("flow", "nope", uri=mongo_uri, collection=collection_name)
    assert missing.returncode == 1 and "error: no flow with id 'nope'" in missing.stderr


async def test_show_names_what_a_task_runs_after_what_runs_after_it_and_why_it_was_canceled(
    runner: TaskRunner, mongo_uri: str, collection_name: str
) -> None:
    """`show` lists a task's flow, the tasks it runs after and waits on with their states, the
    tasks that run after it with how many; a task canceled by its upstream says by which and why."""
    await publish_fan(runner)
    first = (await cli("show", "nightly/extract", uri=mongo_uri, collection=collection_name)).stdout
    assert "flow          nightly" in first.splitlines()
    assert (
        "tasks that run after it: 10" in first and "│ nightly/transform-10 │ transform │ WAITING │" in first
    )
    last = (await cli("show", "nightly/load", uri=mongo_uri, collection=collection_name)).stdout
    assert "after         10 tasks; on upstream failure: cancel" in last.splitlines()
    assert "waiting on    nightly/transform, nightly/transform-2, nightly/transform-3" in last
    assert (
        "runs after 10 tasks: 10 WAITING" in last and "│ nightly/transform-7  │ transform │ WAITING │" in last
    )
    await runner.cancel("nightly/extract")
    canceled = (await cli("show", "nightly/transform", uri=mongo_uri, collection=collection_name)).stdout
    lines = canceled.splitlines()
    assert "state         CANCELED" in lines and "canceled by   nightly/extract" in lines
    error = "error         UpstreamFailed: upstream 'nightly/extract' ended CANCELED; retrying it re-arms this task"
    assert error in lines
    assert "runs after 1 task: 1 CANCELED" in canceled


async def test_list_and_stats_show_waiting_tasks(
    runner: TaskRunner, mongo_uri: str, collection_name: str
) -> None:
    """`list --state waiting` lists the tasks that wait on others, `list --flow ID` a flow's
    tasks (filtered as any list), and `stats` counts WAITING tasks in a column of their own."""
    await publish_fan(runner)
    await runner.publish("alone", key="alone")
    waiting = await cli("list", "--state", "waiting", "--json", uri=mongo_uri, collection=collection_name)
    assert waiting.returncode == 0, waiting.stderr
    listed = [json.loads(line) for line in waiting.stdout.splitlines()]
    assert len(listed) == 11 and {task["state"] for task in listed} == {"WAITING"}
    pending = await cli(
        "list", "--flow", "nightly", "--state", "pending", uri=mongo_uri, collection=collection_name
    )
    rows = [line for line in pending.stdout.splitlines() if line.startswith("│ ")]
    assert len(rows) == 1 and rows[0].startswith("│ nightly/extract ")
    first = await cli(
        "list", "--flow", "nightly", "--limit", "2", "--json", uri=mongo_uri, collection=collection_name
    )
    assert [json.loads(line)["key"] for line in first.stdout.splitlines()] == [
        "nightly/extract",
        "nightly/transform",
    ]
    none = await cli("list", "--flow", "nope", uri=mongo_uri, collection=collection_name)
    assert (none.returncode, none.stdout.strip()) == (0, "no tasks match")
    stats = await cli("stats", "--json", uri=mongo_uri, collection=collection_name)
    counts = json.loads(stats.stdout)["counts"]
    assert counts["transform"] == {"WAITING": 10} and counts["load"] == {"WAITING": 1}
    assert counts["alone"] == {"PENDING": 1}
    table = (await cli("stats", uri=mongo_uri, collection=collection_name)).stdout.splitlines()
    header = next(line for line in table if line.startswith("┃ name"))
    assert [cell.strip() for cell in header.strip("┃").split("┃")][:3] == ["name", "WAITING", "PENDING"]
    transform = next(line for line in table if line.startswith("│ transform "))
    assert [cell.strip() for cell in transform.strip("│").split("│")][:3] == ["transform", "10", "0"]
