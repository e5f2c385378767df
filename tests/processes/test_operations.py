"""Operating taskrunner: wait, cancel, retry, purge, stats, the worker registry, and their CLI commands.

Worker-backed tests run real ``taskrunner worker`` processes (tests/workers.py) with
tests/apps/operations_app.py; CLI commands run in-process through typer's runner (a
subprocess costs ~2 s of imports here; tests/processes/test_cli.py covers the real entry point).
"""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import runs
from pymongo import MongoClient
from typer.testing import CliRunner, Result
from workers import WorkerPool, wait_exit

from taskrunner import (
    EntryState,
    SyncTask,
    Task,
    TaskError,
    TaskOptionsDict,
    TaskRunner,
    TaskSpec,
    TaskState,
    WorkerInfo,
)
from taskrunner.cli import app
from taskrunner.errors import NoLiveWorkerWarning, TaskNotFound, WaitTimeout
from taskrunner.store import fields as f
from taskrunner.store.mongo import MongoStore
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

OPS_APP = "apps.operations_app:runner"
PING_INTERVAL = 0.5
PING: TaskOptionsDict = {"ping_interval": PING_INTERVAL, "ping_timeout": 3.0}
UNREACHABLE = ["--mongo-uri", "mongodb://127.0.0.1:9/", "--timeout", "1"]
Doc = dict[str, Any]


def invoke(*args: str, uri: str | None = None, collection: str | None = None) -> Result:
    """Run one ``taskrunner`` command in-process (wide console, so tables do not wrap)."""
    where = [*(["--mongo-uri", uri] if uri else []), *(["--collection", collection] if collection else [])]
    return CliRunner(env={"COLUMNS": "250"}).invoke(app, [*args, *where])


async def ainvoke(runner: TaskRunner, *args: str) -> Result:
    """``invoke`` on the runner's server and collection, off the event loop."""
    return await asyncio.to_thread(invoke, *args, uri=runner.mongo_uri, collection=runner.collection)


def mongo(runner: TaskRunner) -> MongoStore:
    """The runner's MongoDB store, for direct reads and writes of documents and indexes."""
    assert isinstance(runner.store, MongoStore)
    return runner.store


async def started_entry(runner: TaskRunner, key: str) -> Task | None:
    task = await runner.get(key)
    return task if any(w.state is EntryState.RUNNING and w.progress for w in task.workers) else None


async def live_workers(runner: TaskRunner) -> set[str]:
    return {w.worker_id for w in await runner.workers()}


# -- wait -----------------------------------------------------------------------------------


async def test_wait_returns_results_errors_and_honours_its_timeout(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """wait returns the handler's result or the error records, raises WaitTimeout on time; same for sync and CLI."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=OPS_APP) as pool:
        pool.start("w1")
        await runner.publish("quick", key="ok")
        await runner.publish("fails_fast", key="bad", max_failures=1)
        await runner.publish("nobody_handles_this", key="stuck")
        done = await runner.wait("ok", 30)
        failed = await runner.wait("bad", 30)
        began = time.monotonic()
        with pytest.raises(WaitTimeout) as timed_out:
            await runner.wait("stuck", 1.0)
        waited = time.monotonic() - began
        synced, sync_waited = await asyncio.to_thread(_sync_waits, runner)
        cli = {key: await ainvoke(runner, "wait", key, "--within", "1s") for key in ("ok", "bad", "stuck")}
    assert done.state is TaskState.SUCCESS and done.results == [
        {"worker_id": "w1", "run_id": done.workers[0].run_id}
    ]
    assert failed.state is TaskState.FAIL and failed.last_error is not None
    assert [(e.type, e.message) for e in failed.errors] == [("Fail", "gave up on purpose")]
    print(f"wait(timeout=1) raised after {waited:.2f}s; sync wait(timeout=0.5) after {sync_waited:.2f}s")
    # On time: never early; "late" leaves a busy host room, yet is far below a wait that ignored it (30 s).
    assert 1.0 <= waited <= 1.0 + 10 and isinstance(timed_out.value.task, Task)
    assert timed_out.value.task.state is TaskState.PENDING
    assert synced.state is TaskState.SUCCESS and synced.results[0]["worker_id"] == "w1"
    assert 0.5 <= sync_waited <= 0.5 + 10
    assert (cli["ok"].exit_code, cli["bad"].exit_code, cli["stuck"].exit_code) == (0, 1, 3)
    assert "ok: SUCCESS" in cli["ok"].stdout and "Fail: gave up on purpose" in cli["bad"].stdout
    assert "did not finish within 1 s (still PENDING)" in cli["stuck"].stderr


def _sync_waits(runner: TaskRunner) -> tuple[SyncTask, float]:
    """The sync facade's wait: a finished task, then the seconds a 0.5 s timeout took."""
    with runner.sync() as facade:
        synced = facade.wait("ok", 30)
        began = time.monotonic()
        with pytest.raises(WaitTimeout):
            facade.wait("stuck", 0.5)
        return synced, time.monotonic() - began


async def test_a_handlers_follow_up_goes_where_its_worker_runs(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A handler publishing through ``ctx.runner`` in a ``taskrunner worker`` process puts the
    follow-up in the worker's collection, where it runs, not where the app module's own
    runner points (the default ``tasks`` collection)."""
    key = f"{collection_name}-first"
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=OPS_APP) as pool:
        pool.start("w1")
        await runner.publish("follow_up", key=key)
        first = await runner.wait(key, timeout=60)
        follow_up = await runner.wait(f"{key}:next", timeout=60)
    assert first.state is TaskState.SUCCESS and first.results == [f"{key}:next"]
    assert follow_up.state is TaskState.SUCCESS and follow_up.name == "quick"
    async with TaskRunner(mongo_uri) as module_default:
        with pytest.raises(TaskNotFound):
            await module_default.get(f"{key}:next")


async def test_update_pending_leaves_a_delayed_tasks_run_time_alone(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """``publish --update-pending --priority 7`` on a task delayed an hour changes its
    priority only: a worker does not run it (a task published after it runs first), and
    its run time, params and options stay as published."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=OPS_APP) as pool:
        pool.start("w1")
        delayed = ["publish", "quick", "--key", "up1", "--params", '{"n": 1}', "--delay", "3600"]
        assert (await ainvoke(runner, *delayed, "--max-failures", "5")).exit_code == 0
        before = await runner.get("up1")
        updated = await ainvoke(
            runner, "publish", "quick", "--key", "up1", "--update-pending", "--priority", "7"
        )
        assert updated.exit_code == 0, updated.output
        await runner.publish("quick", key="probe")
        assert (await runner.wait("probe", timeout=60)).state is TaskState.SUCCESS
    after = await runner.get("up1")
    assert after.state is TaskState.PENDING and after.workers == [] and after.priority == 7
    assert (after.run_at, after.params, after.options) == (before.run_at, {"n": 1}, before.options)


async def test_a_finished_runs_entry_holds_its_last_progress(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """The outcome write carries the run's last progress, on success and on failure: a run
    shorter than the ping interval shows its final step, and a run whose renewals carried
    an earlier step shows the final one, not the last renewal's."""
    steps: list[TaskSpec] = [
        {"name": "progress_steps", "key": "short", "params": {"steps": 32}},
        {"name": "progress_steps", "key": "failed", "params": {"steps": 3, "fail": True}},
        {"name": "progress_steps", "key": "long", "params": {"steps": 32, "pause": 1.5}, **PING},
    ]
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=OPS_APP) as pool:
        pool.start("w1")
        await runner.publish_many(steps)
        done = [await runner.wait(str(step["key"]), timeout=60) for step in steps]
    assert [(t.state, [w.progress for w in t.workers]) for t in done] == [
        (TaskState.SUCCESS, [{"fraction": 1.0, "message": "step 32"}]),
        (TaskState.FAIL, [{"fraction": 1.0, "message": "step 3"}]),
        (TaskState.SUCCESS, [{"fraction": 1.0, "message": "step 32"}]),
    ]


# -- cancel and retry -----------------------------------------------------------------------


async def test_cancel_stops_a_running_handler_and_nobody_claims_it_again(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """`cancel` stops a running 30 s handler within ping_interval + 1 s; the task stays CANCELED and unclaimed."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=OPS_APP) as pool:
        workers = pool.start_many(["w1", "w2"])
        await runner.publish(
            "progress_sleep", {"seconds": 30, "fraction": 0.5, "message": "halfway"}, key="long", **PING
        )
        running = await wait_for(lambda: started_entry(runner, "long"), 30, "progress on the running entry")
        shown = await ainvoke(runner, "show", "long")
        began = time.time()
        canceled = await ainvoke(runner, "cancel", "long")
        [mark] = await wait_for(lambda: pool.marks(key="long", event="cancelled"), 10, "the handler's cancel")
        [owner] = [w for w in workers if w.worker_id == running.workers[0].worker_id]
        [stop] = await wait_for(lambda: owner.find("stopping run", key="long"), 10, "the stop log")
        await asyncio.sleep(3.5)  # > ping_timeout: a claim left behind would have expired and been retaken
        task = await runner.get("long")
        claims = [e for w in workers for e in w.find("claimed", key="long")]
        starts = pool.marks(key="long", event="start")
    latency = mark["t"] - began
    print(f"handler cancelled {latency:.2f}s after `taskrunner cancel` began (ping_interval 0.5s)")
    assert shown.exit_code == 0 and "50% halfway" in shown.stdout
    assert canceled.exit_code == 0 and canceled.stdout.strip() == "long: CANCELED"
    assert mark["ctx_cancelled"] is True and latency <= PING_INTERVAL + 1.0
    assert stop["reason"] == "task canceled" and owner.find("claim released", key="long")
    assert task.state is TaskState.CANCELED and task.workers == [] and task.attempts == 1
    assert len(claims) == 1 and len(starts) == 1


async def test_retry_of_a_failed_task_runs_it_again_to_success(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """`retry` makes a FAIL task claimable with a fresh budget; a repaired handler then succeeds."""
    broken = tmp_path / "broken"
    broken.touch()
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=OPS_APP) as pool:
        pool.start("w1")
        await runner.publish("gated", {"broken_while": str(broken)}, key="fix-me", max_failures=1)
        failed = await runner.wait("fix-me", 30)
        premature = await ainvoke(runner, "cancel", "fix-me")
        broken.unlink()
        retried = await ainvoke(runner, "retry", "fix-me")
        done = await runner.wait("fix-me", 30)
        again = await ainvoke(runner, "retry", "fix-me")
    assert failed.state is TaskState.FAIL and failed.last_error is not None
    assert "broken while" in failed.last_error.message
    assert premature.exit_code == 1 and "cannot cancel task 'fix-me': it is FAIL" in premature.stderr
    assert retried.exit_code == 0 and retried.stdout.strip() == "fix-me: PENDING"
    assert done.state is TaskState.SUCCESS and done.results == ["repaired"]
    assert (done.failures, done.attempts, [w.state for w in done.workers]) == (
        0,
        2,
        [EntryState.FAIL, EntryState.SUCCESS],
    )
    assert again.exit_code == 1 and "cannot retry task 'fix-me': it is SUCCESS" in again.stderr


# -- purge, stats, retention ----------------------------------------------------------------


async def test_purge_deletes_only_matching_states_and_ages(runner: TaskRunner) -> None:
    """`purge --dry-run` counts without deleting; `purge` deletes finished tasks of the given states and age only."""
    now = datetime.now(UTC)
    finished = {
        "old-ok": (TaskState.SUCCESS, now - timedelta(days=10)),
        "new-ok": (TaskState.SUCCESS, now - timedelta(hours=1)),
        "old-bad": (TaskState.FAIL, now - timedelta(days=10)),
    }
    for key in [*finished, "pending", "gone"]:
        await runner.publish("job", key=key)
    await runner.cancel("gone")
    collection = mongo(runner).collection
    for key, (state, at) in finished.items():
        await collection.update_one({f.KEY: key}, {"$set": {f.STATE: state.value, f.FINISHED_AT: at}})

    async def remaining() -> set[str]:
        return {t.key for t in await runner.list_tasks()}

    dry = await ainvoke(runner, "purge", "--state", "success", "--older-than", "7d", "--dry-run")
    assert (dry.exit_code, dry.stdout.strip()) == (0, "would delete 1 SUCCESS task")
    assert await remaining() == {*finished, "pending", "gone"}
    old = await ainvoke(runner, "purge", "--state", "success", "--state", "FAIL", "--older-than", "7d")
    assert (old.exit_code, old.stdout.strip()) == (0, "deleted 2 SUCCESS/FAIL tasks")
    assert await remaining() == {"new-ok", "pending", "gone"}
    recent = await ainvoke(runner, "purge", "--state", "canceled", "--older-than", "1d")
    assert recent.stdout.strip() == "deleted 0 CANCELED tasks"
    everything = await ainvoke(
        runner, "purge", "--state", "canceled", "--state", "success", "--older-than", "0s"
    )
    assert everything.stdout.strip() == "deleted 2 CANCELED/SUCCESS tasks"
    assert await remaining() == {"pending"}


async def test_stats_and_list_after_a_small_run(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """`stats --json` counts tasks by name and state and the last hour's runs; `list` filters them."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=OPS_APP) as pool:
        pool.start("w1")
        await runner.publish_many([{"name": "quick", "key": f"q{i}"} for i in range(3)])
        await runner.publish("fails_fast", key="bad", max_failures=1)
        await runner.publish("quick", key="later", delay=3600)
        for key in ("q0", "q1", "q2", "bad"):
            await runner.wait(key, 30)
    result = await ainvoke(runner, "stats", "--json")
    numbers = json.loads(result.stdout)
    assert numbers["counts"] == {"quick": {"SUCCESS": 3, "PENDING": 1}, "fails_fast": {"FAIL": 1}}
    assert (numbers["running"], numbers["finished_last_hour"], numbers["failed_last_hour"]) == (0, 4, 1)
    assert numbers["failure_rate_last_hour"] == 0.25 and numbers["oldest_pending_seconds"] >= 0
    table = await ainvoke(runner, "stats")
    assert (
        table.exit_code == 0
        and "fails_fast" in table.stdout
        and "4 runs finished, 1 failed (25%)" in table.stdout
    )
    lines = (await ainvoke(runner, "list", "--state", "success", "--json")).stdout.splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["q0", "q1", "q2"]
    listed = await ainvoke(runner, "list", "--name", "fails_fast", "--worker", "w1")
    assert (
        "bad" in listed.stdout and "Fail: gave up on purpose" in listed.stdout and "q0" not in listed.stdout
    )
    assert "1 task" in (await ainvoke(runner, "list", "--limit", "1")).stdout


async def test_init_retain_finished_installs_changes_and_removes_the_ttl_index(runner: TaskRunner) -> None:
    """`init --retain-finished 1d` creates the TTL index on finished_at, `2h` changes it, `off` removes it."""

    async def ttl() -> Any:
        indexes = await mongo(runner).collection.index_information()
        return indexes.get(f.RETENTION_INDEX, {}).get("expireAfterSeconds")

    day = await ainvoke(runner, "init", "--retain-finished", "1d")
    assert day.exit_code == 0 and "deletes tasks 86400 s after they finish" in day.stdout
    assert await ttl() == 86400
    assert (await ainvoke(runner, "init", "--retain-finished", "2h")).exit_code == 0
    assert await ttl() == 7200
    off = await ainvoke(runner, "init", "--retain-finished", "off")
    assert off.exit_code == 0 and "retention off" in off.stdout
    assert await ttl() is None


async def test_init_retain_failed_gives_fail_and_canceled_tasks_a_retention_of_their_own(
    runner: TaskRunner,
) -> None:
    """`--retain-failed 30d` installs failed_ttl (FAIL and CANCELED) and narrows finished_ttl to
    SUCCESS; `off` removes it and finished_ttl covers every finished task again."""

    async def ttls() -> dict[str, tuple[Any, Any, Any]]:
        indexes = await mongo(runner).collection.index_information()
        return {
            name: (spec["key"], spec.get("expireAfterSeconds"), spec.get("partialFilterExpression"))
            for name, spec in indexes.items()
            if name in (f.RETENTION_INDEX, f.FAILED_RETENTION_INDEX)
        }

    both = await ainvoke(runner, "init", "--retain-finished", "1d", "--retain-failed", "30d")
    assert both.exit_code == 0, both.output
    assert "failed_ttl deletes FAIL and CANCELED tasks 2592000 s after they finish" in both.stdout
    assert await ttls() == {
        "finished_ttl": ([("finished_at", 1)], 86400, {"state": "SUCCESS"}),
        "failed_ttl": ([("finished_at", -1)], 2592000, {"state": {"$lt": "PENDING"}}),
    }
    assert (await ainvoke(runner, "init", "--retain-failed", "30d")).exit_code == 0  # unchanged
    assert (await ttls())["finished_ttl"] == ([("finished_at", 1)], 86400, {"state": "SUCCESS"})
    off = await ainvoke(runner, "init", "--retain-failed", "off")
    assert off.exit_code == 0 and "failed retention off" in off.stdout
    assert await ttls() == {"finished_ttl": ([("finished_at", 1)], 86400, None)}
    await runner.init(retain_finished=0, retain_failed=timedelta(days=7))
    assert await ttls() == {"failed_ttl": ([("finished_at", -1)], 604800, {"state": {"$lt": "PENDING"}})}


async def failed_tasks(runner: TaskRunner) -> None:
    """f1, f2, f3 failed 3, 2 and 1 hours ago; "hand" is FAIL without a finish date (written by
    hand); one task succeeded, one was canceled, one waits."""
    store, now = mongo(runner), await runner.store.server_time()
    for hours, key in ((3, "f1"), (2, "f2"), (1, "f3")):
        await runner.publish("job", key=key, allow_unknown=True)
        claim = await store.claim("w1", key=key)
        assert claim is not None
        await runs.fail(store, key, claim.run_id, TaskError(type="Boom", message=f"{key} broke"), final=True)
        await store.collection.update_one(
            {"key": key}, {"$set": {"finished_at": now - timedelta(hours=hours)}}
        )
    await store.collection.insert_one({"key": "hand", "name": "job", "state": "FAIL"})
    await runner.publish("job", key="ok", allow_unknown=True)
    claim = await store.claim("w1", key="ok")
    assert claim is not None
    await runs.succeed(store, "ok", claim.run_id)
    await runner.publish("job", key="stopped", allow_unknown=True)
    await runner.cancel("stopped")
    await runner.publish("other", key="waiting", allow_unknown=True)


async def test_failed_lists_failed_tasks_newest_first_with_their_errors_page_by_page(
    runner: TaskRunner,
) -> None:
    """`runner.failed` (the dead-letter view) returns FAIL tasks only, the latest failure first and
    undated ones last, a page at a time; `taskrunner failed` shows each error and the next page."""
    await failed_tasks(runner)
    first = await runner.failed(limit=2)
    assert [t.key for t in first.tasks] == ["f3", "f2"] and first.after is not None
    assert first.tasks[0].last_error == TaskError(type="Boom", message="f3 broke")
    second = await runner.failed(limit=2, after=first.after)
    assert [t.key for t in second.tasks] == ["f1", "hand"]
    assert [t.key for t in (await runner.failed(limit=2, after=second.after)).tasks] == []
    assert [t.key for t in (await runner.failed(name="other")).tasks] == []
    table = await ainvoke(runner, "failed", "--limit", "2")
    assert table.exit_code == 0 and "Boom: f3 broke" in table.stdout and "f1" not in table.stdout
    assert table.stderr.startswith("next page: taskrunner failed --limit 2 --after ")
    after = table.stderr.split("--after ", 1)[1].strip().strip("'")
    rest = await ainvoke(runner, "failed", "--limit", "2", "--after", after, "--json")
    assert [json.loads(line)["key"] for line in rest.stdout.splitlines()] == ["f1", "hand"]
    assert (await ainvoke(runner, "failed", "--after", "nonsense")).exit_code == 1


# -- the worker registry --------------------------------------------------------------------


async def test_workers_lists_live_workers_and_stop_worker_stops_one_gracefully(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """`workers` shows live processes and drops a SIGKILLed one; `stop-worker` makes one exit 0, claim released."""
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=OPS_APP) as pool:
        w1, w2 = pool.start_many(["w1", "w2"], "--beat-interval", "0.3")
        await runner.publish("sleep", {"seconds": 60}, key="busy", worker_ids=["w1"])
        await wait_for(lambda: _running_on(runner, "w1", "busy"), 30, "w1 to report running busy")
        await wait_for(lambda: _ids_are(runner, {"w1", "w2"}), 30, "both workers to register")
        listed = {
            i["worker_id"]: i
            for i in map(json.loads, (await ainvoke(runner, "workers", "--json")).stdout.splitlines())
        }
        table = (await ainvoke(runner, "workers")).stdout
        w2.kill()
        killed = time.monotonic()
        await wait_for(lambda: _ids_are(runner, {"w1"}), 30, "the killed worker to age out", interval=0.02)
        aged_out = time.monotonic() - killed
        after_kill = (await ainvoke(runner, "workers")).stdout
        dead = await ainvoke(runner, "stop-worker", "w2")
        asked = time.monotonic()
        stopping = await ainvoke(runner, "stop-worker", "w1")
        code = await wait_exit(w1, 30)
        stop_latency = time.monotonic() - asked
        task = await runner.get("busy")
    print(
        f"killed worker gone from `workers` after {aged_out:.2f}s (beat 0.3s, entry lives 1.5s); "
        f"stop-worker exit after {stop_latency:.2f}s"
    )
    assert {k: (v["pid"], v["running"], v["stop_requested"]) for k, v in listed.items()} == {
        "w1": (w1.pid, ["busy"], False),
        "w2": (w2.pid, [], False),
    }
    assert "w1" in table and "w2" in table and "1/10: busy" in table and "running" in table
    # Bounds leave a busy host room; an entry that outlived its ttl, or a stop that waited for
    # the 60 s handler, would take far longer.
    assert aged_out <= 1.5 + 10 and "w2" not in after_kill and "w1" in after_kill
    assert dead.exit_code == 1 and "no live worker with id 'w2'" in dead.stderr
    assert stopping.exit_code == 0 and "stop requested" in stopping.stdout
    assert code == 0 and stop_latency <= 0.3 + 0.5 + 10
    assert w1.find("stop requested by an operator; shutting down") and w1.find("claim released", key="busy")
    assert task.state is TaskState.PENDING and task.workers == [] and task.failures == 0


async def test_workers_marks_a_worker_asked_to_stop_as_stopping(runner: TaskRunner) -> None:
    """A live registry entry with a stop request shows as "stopping" in `workers`."""
    registry = mongo(runner).registry
    now = datetime.now(UTC)
    await registry.insert_one(
        {
            "_id": "ghost",
            "host": "h",
            "pid": 7,
            "started_at": now,
            "names": ["quick"],
            "concurrency": 2,
            "running": [],
            "version": "0",
            "beat_at": now,
            "expires_at": now + timedelta(hours=1),
        }
    )
    asked = await ainvoke(runner, "stop-worker", "ghost")
    shown = await ainvoke(runner, "workers")
    assert asked.exit_code == 0 and "ghost" in shown.stdout and "stopping" in shown.stdout


async def _running_on(runner: TaskRunner, worker_id: str, key: str) -> bool:
    return any(w.worker_id == worker_id and key in w.running for w in await runner.workers())


async def _ids_are(runner: TaskRunner, ids: set[str]) -> bool:
    return await live_workers(runner) == ids


# -- names and ids no live worker has -------------------------------------------------------


async def register(runner: TaskRunner, worker_id: str, *names: str) -> None:
    """A live registration (as a worker's beat writes it), without a worker process."""
    now = datetime.now(UTC)
    info = WorkerInfo(worker_id=worker_id, host="h", pid=1, started_at=now, names=list(names), concurrency=1)
    await runner.store.beat(info, 3600)


async def test_pause_and_limit_of_a_name_no_live_worker_serves_warn_and_go_ahead(runner: TaskRunner) -> None:
    """A typo'd name is paused or limited all the same (ahead of a deploy that is right) with a
    NoLiveWorkerWarning naming the nearest served name; a served name or force gives none."""
    await register(runner, "w1", "sleep", "quick")
    with pytest.warns(NoLiveWorkerWarning, match=r"task name 'sleeep' \(did you mean 'sleep'\?\)") as caught:
        await runner.pause("sleeep")
    assert caught[0].message.names == ["sleeep"]  # type: ignore[union-attr]
    with pytest.warns(NoLiveWorkerWarning, match="task name 'nosuchname'"):
        await runner.set_limits("nosuchname", rate_limit="1/s")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await runner.pause("sleep")
        await runner.pause("deploying_next", force=True)
        await runner.pause("*")
        await runner.set_limits("quick", max_running=2)
        await runner.set_limits("deploying_next", max_running=1, force=True)
    assert set(await runner.paused()) == {"sleeep", "sleep", "deploying_next", "*"}
    assert (await runner.limits("nosuchname")).stored is not None  # stored: the warning blocks nothing


async def test_tasks_pinned_to_ids_no_live_worker_has_warn_and_show_in_stats(runner: TaskRunner) -> None:
    """publish with worker_ids naming no live worker warns (the task is published and waits);
    stats lists such unfinished tasks by worker_ids, and names no live worker serves."""
    await register(runner, "w1", "quick")
    with pytest.warns(NoLiveWorkerWarning, match=r"worker id 'ghost'") as caught:
        await runner.publish("quick", key="lost", worker_ids=["ghost"])
    assert caught[0].message.worker_ids == ["ghost"]  # type: ignore[union-attr]
    with pytest.warns(NoLiveWorkerWarning, match=r"worker id 'w2'; done anyway"):
        await runner.publish_many([{"name": "quick", "key": f"b{i}", "worker_ids": ["w2"]} for i in range(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await runner.publish("quick", key="mine", worker_ids=["w1"])
        await runner.publish("quick", key="anyone")
    await runner.publish("typo", key="unserved", allow_unknown=True)
    stats = await runner.stats()
    assert [(p.worker_ids, p.tasks, p.keys) for p in stats.pinned_away] == [
        (["w2"], 2, ["b0", "b1"]),
        (["ghost"], 1, ["lost"]),
    ]
    assert stats.unserved == {"typo": 1}
    assert (await runner.get("lost")).state is TaskState.PENDING


async def test_cli_warns_of_names_and_ids_no_live_worker_has_unless_forced(runner: TaskRunner) -> None:
    """`pause`, `limit` and `publish --worker-id` print one warning line on stderr and exit 0;
    `--force` prints none; `stats` lists the tasks pinned to no live worker."""
    await register(runner, "w1", "sleep")
    paused = await ainvoke(runner, "pause", "sleeep")
    assert paused.exit_code == 0 and paused.stdout.strip() == "paused: sleeep"
    assert paused.stderr.startswith(
        "warning: no live worker serves task name 'sleeep' (did you mean 'sleep'?)"
    )
    forced = await ainvoke(runner, "pause", "later", "--force")
    assert forced.exit_code == 0 and forced.stderr == ""
    limited = await ainvoke(runner, "limit", "nosuchname", "--rate", "1/s")
    assert (
        limited.exit_code == 0 and "warning: no live worker serves task name 'nosuchname'" in limited.stderr
    )
    assert (await ainvoke(runner, "limit", "sleep", "--rate", "1/s")).stderr == ""
    pinned = await ainvoke(runner, "publish", "sleep", "--key", "lost", "--worker-id", "ghost")
    assert pinned.exit_code == 0 and pinned.stdout.strip() == "lost"
    assert "warning: no live worker has worker id 'ghost'" in pinned.stderr
    quiet = await ainvoke(runner, "publish", "sleep", "--key", "soon", "--worker-id", "w9", "--force")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    stats = await ainvoke(runner, "stats")
    assert "pinned to no live worker: 1 task with worker_ids ghost (lost)" in stats.stdout
    assert "pinned to no live worker: 1 task with worker_ids w9 (soon)" in stats.stdout


# -- documents written by hand -------------------------------------------------------------
async def test_operators_commands_work_on_a_document_written_by_hand(runner: TaskRunner) -> None:
    """show, list, cancel, retry and stats exit 0 on documents inserted with pymongo that no
    model reads (one marked FAIL by normalization, one not yet seen by any worker)."""
    await mongo(runner).collection.insert_many(
        [{"key": "hand:bad", "name": "job", "options": None}, {"key": "hand:odd", "name": "job", "state": 42}]
    )
    await runner.store.normalize("hand:bad")
    shown = await ainvoke(runner, "show", "hand:bad", "--json")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["error"]["type"] == "MalformedTask", shown.stderr
    table = await ainvoke(runner, "show", "hand:bad")
    assert table.exit_code == 0 and "MalformedTask: options" in table.stdout, table.stdout
    odd = await ainvoke(runner, "show", "hand:odd")
    assert odd.exit_code == 0 and "unreadable" in odd.stdout and "state" in odd.stdout, odd.stdout
    listed = await ainvoke(runner, "list", "--json")
    assert listed.exit_code == 0 and {json.loads(line)["key"] for line in listed.stdout.splitlines()} == {
        "hand:bad",
        "hand:odd",
    }
    assert (await ainvoke(runner, "stats")).exit_code == 0
    canceled = await ainvoke(runner, "cancel", "hand:odd")
    assert canceled.exit_code == 0 and "CANCELED" in canceled.stdout, canceled.stderr
    retried = await ainvoke(runner, "retry", "hand:bad")
    assert retried.exit_code == 0 and "PENDING" in retried.stdout, retried.stderr


# -- CLI errors -----------------------------------------------------------------------------

KEYED = [["show", "nope"], ["cancel", "nope"], ["retry", "nope"], ["wait", "nope"]]
EVERY = [
    *KEYED,
    ["init"],
    ["publish", "job"],
    ["list"],
    ["purge", "--state", "fail", "--older-than", "1d"],
    ["stats"],
    ["workers"],
    ["stop-worker", "w"],
]


def test_unknown_keys_exit_1_naming_the_key(mongo_uri: str, collection_name: str) -> None:
    """Every command taking a key exits 1 with "no task with key" for an unknown one."""
    for args in KEYED:
        result = invoke(*args, uri=mongo_uri, collection=collection_name)
        assert result.exit_code == 1 and "no task with key 'nope'" in result.stderr, (args, result.stderr)


def test_every_command_fails_fast_when_the_server_is_unreachable() -> None:
    """With --timeout 1 every command exits 1 within a few seconds, saying MongoDB is unavailable."""
    for args in EVERY:
        began = time.monotonic()
        result = invoke(*args, *UNREACHABLE)
        took = time.monotonic() - began
        assert result.exit_code == 1 and "MongoDB unavailable" in result.stderr, (args, result.stderr)
        assert took < 8.0, (args, took)  # --timeout 1, not the default 10 s, with room for a busy host


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["purge", "--state", "success", "--older-than", "soon"], "'--older-than': not a duration: 'soon'"),
        (["purge", "--state", "pending", "--older-than", "1d"], "'--state'"),
        (["purge", "--older-than", "1d"], "Missing option '--state'"),
        (["list", "--state", "BOGUS"], "'--state'"),
        (["list", "--limit", "-1"], "'--limit'"),
        (["init", "--retain-finished", "forever"], "'--retain-finished'"),
        (["init", "--retain-finished", "0.5s"], "at least 1s"),
        (["wait", "k", "--within", "later"], "'--within'"),
        (["cancel"], "Missing argument 'KEY'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(args: list[str], named: str) -> None:
    """Bad durations, states and missing arguments are usage errors that name the option."""
    result = invoke(*args, *UNREACHABLE)
    assert result.exit_code == 2 and named in result.stderr, result.stderr


def test_show_table_lists_progress_verbatim(mongo_uri: str, collection_name: str) -> None:
    """`show` prints each entry's progress, and keys with rich markup are printed as given."""
    with MongoClient[Doc](mongo_uri) as client:
        now = datetime.now(UTC)
        entry = {
            "worker_id": "w[bold]1",
            "run_id": "r" * 32,
            "state": "RUNNING",
            "claimed_at": now,
            "ping_at": now,
            "expires_at": now + timedelta(minutes=1),
            "attempt": 1,
            "progress": {"fraction": 0.4, "message": "[red]resizing"},
        }
        client.taskrunner[collection_name].insert_one(
            {
                "key": "[b]k",
                "name": "job",
                "params": {},
                "priority": 0,
                "created_at": now,
                "updated_at": now,
                "run_at": now,
                "options": {},
                "workers": [entry],
                "state": "RUNNING",
                "failures": 0,
                "attempts": 1,
            }
        )
    shown = invoke("show", "[b]k", uri=mongo_uri, collection=collection_name)
    listed = invoke("list", uri=mongo_uri, collection=collection_name)
    assert shown.exit_code == 0 and "40% [red]resizing" in shown.stdout and "w[bold]1" in shown.stdout
    assert "[b]k" in listed.stdout and "w[bold]1 RUNNING" in listed.stdout
