"""Workflows with real ``taskrunner worker`` processes: fan-out and fan-in through a SIGKILL,
a failed step stopping and undoing its flow, ``taskrunner retry`` re-arming what it canceled,
a worker gone between an outcome and its follow-up, a released task whose owner is full,
and randomized kills.

Workers run tests/apps/workflows_app.py (tests/workers.py starts them); handlers record
``start``/``finish`` marks with their ``run_id``. Each test judges from the task documents,
as every version of them a change stream saw, and from those marks:

- exactly once: every SUCCESS step has one SUCCESS entry and one ``finish`` mark, of the
  same run; any other run of it failed (a FAIL entry) or started on a worker that was killed;
- never early: a dependent's first ``claimed_at`` (over every version of its document, since
  a takeover drops the entry of a killed run) is no earlier than the latest ``finished_at``
  of its upstreams' SUCCESS entries; all of them server times.

Leases are short (ping_interval 0.3 s, ping_timeout 1.5 s) so lost runs come back quickly;
bounds on anything timed are generous because the host's two cores are shared.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from apps.workflows_app import EXIT_AFTER_OUTCOME
from workers import ChangeRecorder, WorkerPool, WorkerProcess, peers_known, wait_exit

from taskrunner import EntryState, FlowState, FlowView, Task, TaskOptionsDict, TaskRunner, TaskSpec, TaskState
from taskrunner.engine.worker import owned_buckets
from taskrunner.store import fields as f
from taskrunner.store import rules
from taskrunner.store.mongo import MongoStore
from taskrunner.testing import wait_for
from taskrunner.workflows.builder import StepDict

pytestmark = pytest.mark.mongo

Doc = dict[str, Any]
APP = "apps.workflows_app:runner"
LEASE: TaskOptionsDict = {"ping_interval": 0.3, "ping_timeout": 1.5, "retry_backoff": 0, "max_failures": 5}
"""Step options: short leases, and a budget no kill in these tests can spend."""
ENDED_FLOW = (FlowState.SUCCESS, FlowState.FAIL, FlowState.COMPENSATED)


async def started(*workers: WorkerProcess) -> None:
    await wait_for(lambda: all(w.find("worker started") for w in workers), 60, "workers to start")


async def flow_ended(runner: TaskRunner, flow: str) -> FlowView | None:
    """The flow once it ended: every step and compensation finished."""
    view = await runner.get_flow(flow)
    done = all(t.state.finished for t in (*view.steps, *view.compensations))
    return view if done and view.state in ENDED_FLOW else None


async def all_finished(runner: TaskRunner, keys: Iterable[str]) -> dict[str, Task] | None:
    tasks = {key: await runner.get(key) for key in keys}
    return tasks if all(t.state.finished for t in tasks.values()) else None


def first_claims(changes: ChangeRecorder, tasks: Mapping[str, Task]) -> dict[str, datetime]:
    """Each task's earliest ``claimed_at`` over every version of its document seen and the
    final one (a takeover drops the entries of runs lost with their worker)."""
    claims: dict[str, datetime] = {}
    versions = [
        (doc.get(f.KEY), entry[f.CLAIMED_AT])
        for _, doc in changes.documents
        for entry in doc.get(f.WORKERS, [])
    ]
    versions += [(t.key, e.claimed_at) for t in tasks.values() for e in t.workers]
    for key, claimed_at in versions:
        if isinstance(key, str) and key in tasks and (key not in claims or claimed_at < claims[key]):
            claims[key] = claimed_at
    return claims


def assert_never_early(tasks: Mapping[str, Task], changes: ChangeRecorder) -> int:
    """No task was claimed before every upstream it runs after had succeeded (with
    ``on_upstream_failure="run"``: had finished); returns how many dependents were checked."""
    first = first_claims(changes, tasks)
    checked = 0
    for task in tasks.values():
        if not task.after or task.key not in first:
            continue
        ups = [tasks[key] for key in task.after]
        if task.on_upstream_failure == "run":
            ends = [up.finished_at for up in ups]
            assert all(end is not None for end in ends), (task.key, ups)
        else:
            ends = [e.finished_at for up in ups for e in up.workers if e.state is EntryState.SUCCESS]
            assert len(ends) == len(ups), f"{task.key} ran although not every upstream succeeded"
        latest = max(end for end in ends if end is not None)
        assert first[task.key] >= latest, f"{task.key} claimed at {first[task.key]}, upstream ended {latest}"
        checked += 1
    return checked


def assert_ran_once(tasks: Mapping[str, Task], marks: list[Doc], killed: Iterable[str] = ()) -> None:
    """Each SUCCESS task has one SUCCESS entry and one ``finish`` mark, of the same run; any
    other run of it failed (a FAIL entry) or started on a killed worker. A task that did not
    succeed never finished a run."""
    killed = set(killed)
    for task in tasks.values():
        own = [m for m in marks if m["key"] == task.key]
        finished = [m["run_id"] for m in own if m["event"] == "finish"]
        if task.state is not TaskState.SUCCESS:
            assert finished == [], (task.key, task.state, finished)
            continue
        [entry] = [e for e in task.workers if e.state is EntryState.SUCCESS]
        assert finished == [entry.run_id], (task.key, finished, entry.run_id)
        failed = {e.run_id for e in task.workers if e.state is EntryState.FAIL}
        others = [m for m in own if m["event"] == "start" and m["run_id"] not in {entry.run_id, *failed}]
        assert all(m["worker_id"] in killed for m in others), (task.key, others)


# -- a fan-out and fan-in through a SIGKILL ----------------------------------------------------
@pytest.mark.timeout(300)
async def test_fan_out_fan_in_through_a_sigkill_runs_each_step_once_never_early(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A 1 -> 10 -> 1 flow on 3 workers; the worker running the most middle steps (held by
    a gate) is SIGKILLed while they run: every step ends SUCCESS having finished exactly
    once, no step was claimed before its upstreams' SUCCESS, and the fan-in step was handed
    all ten results (ctx.upstream)."""
    gate = tmp_path / "gate"
    flow = runner.flow("fan")
    root = flow.add("step", {}, **LEASE)
    middle = flow.group(
        *[StepDict(name="step", params={"gate": str(gate), "seconds": 0.2}, **LEASE) for _ in range(10)],
        after=root,
    )
    sink = flow.add("fan_in", {"expect": [s.key for s in middle]}, after=middle, **LEASE)
    middle_keys = [s.key for s in middle]

    async def middle_running() -> dict[str, list[str]] | None:
        """Who runs which middle step, once six of them run (their owners claim them, at
        most four each: the three workers share them)."""
        view = await runner.get_flow("fan")
        by_worker: dict[str, list[str]] = {}
        for key in middle_keys:
            for entry in view.step(key).workers:
                if entry.state is EntryState.RUNNING:
                    by_worker.setdefault(entry.worker_id, []).append(key)
        return by_worker if sum(map(len, by_worker.values())) >= 6 else None

    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        workers = pool.start_many(["w1", "w2", "w3"], "--concurrency", "4")
        await started(*workers)
        async with ChangeRecorder(mongo_uri, collection_name) as changes:
            await flow.publish()
            by_worker = await wait_for(middle_running, 90, "six middle steps to run")
            victim_id = max(sorted(by_worker), key=lambda w: len(by_worker[w]))
            lost = by_worker[victim_id]
            next(w for w in workers if w.worker_id == victim_id).kill()
            gate.touch()  # the middle steps may finish now; the victim's runs never will
            view = await wait_for(lambda: flow_ended(runner, "fan"), 120, "the flow to end")
            marks = pool.marks()
    tasks = {t.key: t for t in view.steps}
    print(f"killed {victim_id} running {lost}")
    assert view.state is FlowState.SUCCESS, {k: t.state for k, t in tasks.items()}
    assert [s.key for s in flow.steps] == ["fan/step", *(f"fan/step-{i}" for i in range(2, 12)), "fan/fan_in"]
    assert all(t.state is TaskState.SUCCESS for t in tasks.values())
    assert_ran_once(tasks, marks, killed=[victim_id])
    for key in lost:  # each run lost with the victim was taken over and done by another worker
        [entry] = tasks[key].workers
        assert entry.worker_id != victim_id and victim_id in entry.took_over, (key, entry)
    assert assert_never_early(tasks, changes) == 11
    [result] = tasks[sink.key].results
    assert result == {"inputs": {k: {"key": k, "run_id": tasks[k].workers[0].run_id} for k in middle_keys}}
    [sink_start] = [m for m in marks if m["key"] == sink.key and m["event"] == "start"]
    assert sink_start["upstream"] == dict.fromkeys(middle_keys, "SUCCESS")


# -- a saga: a failed step stops its flow and undoes what succeeded -----------------------------
@pytest.mark.timeout(300)
async def test_a_failed_step_cancels_its_dependents_and_compensates_in_reverse_order(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """reserve -> (charge -> ship -> notify, hold -> confirm), each with a compensation; ship
    fails (Fail) while hold still runs: notify is CANCELED by its upstream (UpstreamFailed),
    confirm, not started, by the flow (FlowFailed), and nothing is undone while hold runs.
    Once it ends, the compensations of reserve, charge and hold run, each once, reserve's
    last (after the other two finished), and the flow is COMPENSATED."""
    gate, holding = tmp_path / "gate", tmp_path / "holding"
    flow = runner.flow("trip")
    undo = ("undo", {"seconds": 0.2})
    reserve = flow.add("step", {}, key="reserve", compensate=undo, **LEASE)
    charge = flow.add("step", {}, key="charge", after=reserve, compensate=undo, **LEASE)
    hold_params = {"touch": str(holding), "gate": str(gate)}
    hold = flow.add("step", hold_params, key="hold", after=reserve, compensate=undo, **LEASE)
    ship_params = {"gate": str(holding), "fail_without": str(tmp_path / "never")}  # fails once hold runs
    ship = flow.add("step", ship_params, key="ship", after=charge, compensate=undo, **LEASE)
    flow.add("step", {}, key="notify", after=ship, compensate=undo, **LEASE)
    flow.add("step", {}, key="confirm", after=hold, compensate=undo, **LEASE)

    async def stopped() -> FlowView | None:
        view = await runner.get_flow("trip")
        return view if view.step("confirm").state is TaskState.CANCELED else None

    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        workers = pool.start_many(["w1", "w2"], "--concurrency", "4")
        await started(*workers)
        async with ChangeRecorder(mongo_uri, collection_name) as changes:
            await flow.publish()
            early = await wait_for(stopped, 90, "the flow to stop")
            assert early.step("hold").state is TaskState.RUNNING
            assert early.state is FlowState.COMPENSATING and early.compensations == []
            gate.touch()
            view = await wait_for(lambda: flow_ended(runner, "trip"), 120, "the flow to end")
            marks = pool.marks()
    steps = {t.key: t for t in view.steps}
    undos = {t.key: t for t in view.compensations}
    assert view.state is FlowState.COMPENSATED, {k: t.state for k, t in {**steps, **undos}.items()}
    assert {k: t.state for k, t in steps.items()} == {
        "reserve": TaskState.SUCCESS,
        "charge": TaskState.SUCCESS,
        "hold": TaskState.SUCCESS,
        "ship": TaskState.FAIL,
        "notify": TaskState.CANCELED,
        "confirm": TaskState.CANCELED,
    }
    notify, confirm = steps["notify"], steps["confirm"]
    assert (
        notify.error is not None and notify.error.type == f.UPSTREAM_FAILED and notify.canceled_by == ["ship"]
    )
    assert confirm.error is not None and confirm.error.type == f.FLOW_FAILED and confirm.canceled_by == []
    assert notify.workers == [] and confirm.workers == []
    assert {m["key"] for m in marks if m["event"] == "start"} == {
        "reserve",
        "charge",
        "hold",
        "ship",
        "reserve/undo",
        "charge/undo",
        "hold/undo",
    }
    assert sorted(undos) == ["charge/undo", "hold/undo", "reserve/undo"]
    assert all(
        t.state is TaskState.SUCCESS and t.compensates == t.key.removesuffix("/undo") for t in undos.values()
    )
    assert sorted(undos["reserve/undo"].after) == ["charge/undo", "hold/undo", "reserve"]
    assert undos["charge/undo"].after == ["charge"] and undos["hold/undo"].after == ["hold"]
    tasks = steps | undos
    assert_ran_once(tasks, marks)
    assert all(len([m for m in marks if m["key"] == k and m["event"] == "start"]) == 1 for k in undos)
    assert assert_never_early(tasks, changes) == 6  # charge, hold, ship and the three compensations
    last = undos["reserve/undo"].workers[0].claimed_at
    others = [undos[k].workers[0].finished_at for k in ("charge/undo", "hold/undo")]
    assert all(end is not None and end <= last for end in others)  # reverse dependency order
    assert undos["reserve/undo"].results == [{"undid": ["charge/undo", "hold/undo", "reserve"]}]


# -- retry re-arms what a failure canceled ---------------------------------------------------------
async def cli(runner: TaskRunner, *args: str) -> tuple[int, str]:
    """Run ``taskrunner ARGS`` as a process on the runner's server and collection."""
    where = ["--mongo-uri", runner.mongo_uri, "--collection", runner.collection]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "taskrunner",
        *args,
        *where,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode()


@pytest.mark.timeout(300)
async def test_taskrunner_retry_re_arms_the_canceled_chain_and_the_flow_completes(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """A chain a -> b -> c -> d whose b fails (Fail, max_failures 1): c and d end CANCELED
    (UpstreamFailed, c by b and d by c), the flow FAIL. ``taskrunner retry b`` puts c and d
    back to WAITING on their upstreams at once; b then succeeds, c and d each run once, after
    their upstreams, and the flow is SUCCESS."""
    gate, fix = tmp_path / "gate", tmp_path / "fix"
    gate.touch()
    flow = runner.flow("fix")
    a, b, c, d = flow.chain(
        {"name": "step", "params": {}, **LEASE},
        {
            "name": "step",
            "params": {"gate": str(gate), "fail_without": str(fix)},
            **LEASE | {"max_failures": 1},
        },
        {"name": "step", "params": {}, **LEASE},
        {"name": "step", "params": {}, **LEASE},
    )
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        workers = pool.start_many(["w1", "w2"], "--concurrency", "2")
        await started(*workers)
        async with ChangeRecorder(mongo_uri, collection_name) as changes:
            await flow.publish()
            failed = await wait_for(lambda: flow_ended(runner, "fix"), 90, "the flow to fail")
            gate.unlink()  # the retried run of b waits for it, so the re-armed states can be read
            fix.touch()
            code, out = await cli(runner, "retry", b.key)
            assert code == 0, out
            rearmed = {k: await runner.get(k) for k in (b.key, c.key, d.key)}
            gate.touch()
            view = await wait_for(lambda: flow_ended(runner, "fix"), 120, "the flow to end")
            marks = pool.marks()
    assert failed.state is FlowState.FAIL
    assert [t.state for t in failed.steps] == [
        TaskState.SUCCESS,
        TaskState.FAIL,
        TaskState.CANCELED,
        TaskState.CANCELED,
    ]
    assert [(t.canceled_by, t.error and t.error.type) for t in failed.steps[2:]] == [
        ([b.key], f.UPSTREAM_FAILED),
        ([c.key], f.UPSTREAM_FAILED),
    ]
    assert rearmed[b.key].state in (TaskState.PENDING, TaskState.RUNNING)
    for key, upstream in ((c.key, b.key), (d.key, c.key)):
        task = rearmed[key]
        assert (task.state, task.waiting_on, task.canceled_by, task.error) == (
            TaskState.WAITING,
            [upstream],
            [],
            None,
        )
    tasks = {t.key: t for t in view.steps}
    assert view.state is FlowState.SUCCESS and all(t.state is TaskState.SUCCESS for t in tasks.values())
    assert [e.state for e in tasks[b.key].workers] == [EntryState.FAIL, EntryState.SUCCESS]
    assert_ran_once(tasks, marks)
    assert [
        len([m for m in marks if m["key"] == k and m["event"] == "start"])
        for k in (a.key, b.key, c.key, d.key)
    ] == [1, 2, 1, 1]
    assert assert_never_early(tasks, changes) == 3


# -- a worker gone between an outcome and its follow-up ----------------------------------------------
@pytest.mark.timeout(300)
async def test_a_worker_gone_right_after_an_outcome_leaves_the_release_to_another_workers_sweep(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """w1 exits the moment the SUCCESS of ``up`` has landed, before the follow-up it owes
    (the app's fault hook) while w2 is stopped (SIGSTOP): the document keeps ``notify`` and
    its four dependents stay WAITING. Once w2 runs again its sweep releases them within a
    few sweep intervals, and each runs once, after ``up``."""
    gate = tmp_path / "gate"
    downs = [f"down-{i}" for i in range(4)]
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        w1 = pool.group.worker("w1", APP, env={"WORKFLOW_EXIT_AFTER_OUTCOME": "up"})
        w2 = pool.start("w2")
        await started(w1, w2)
        await peers_known(runner, ["w1", "w2"])
        w2.pause()
        await runner.publish_many(
            [
                {"name": "step", "key": "up", "params": {"gate": str(gate)}, **LEASE},
                *[TaskSpec(name="step", key=key, after=["up"], **LEASE) for key in downs],
            ]
        )
        gate.touch()  # only now may ``up`` end: the publisher's own follow-up is done
        assert await wait_exit(w1, 60) == EXIT_AFTER_OUTCOME
        store = runner.store
        assert isinstance(store, MongoStore)
        up_doc = await store.collection.find_one({f.KEY: "up"})
        waiting = [await runner.get(key) for key in downs]
        w2.resume()
        resumed = time.monotonic()

        async def released() -> float | None:
            states = [(await runner.get(key)).state for key in downs]
            return time.monotonic() - resumed if TaskState.WAITING not in states else None

        took = await wait_for(released, 60, "w2's sweep to release the dependents")
        tasks = await wait_for(lambda: all_finished(runner, ["up", *downs]), 60, "the dependents to run")
        marks = pool.marks()
    print(f"released {took:.2f}s after w2 resumed")
    assert up_doc is not None and up_doc[f.STATE] == "SUCCESS" and up_doc.get(f.NOTIFY, 0) >= 1
    assert [(t.state, t.waiting_on) for t in waiting] == [(TaskState.WAITING, ["up"])] * 4
    assert took <= 30  # a sweep every 1-2 s; the bound leaves a busy host room
    assert all(t.state is TaskState.SUCCESS for t in tasks.values())
    [up_entry] = tasks["up"].workers
    assert up_entry.worker_id == "w1" and up_entry.state is EntryState.SUCCESS
    assert all([e.worker_id for e in tasks[k].workers] == ["w2"] for k in downs)
    assert_ran_once(tasks, marks)
    assert all(
        up_entry.finished_at is not None and tasks[k].workers[0].claimed_at >= up_entry.finished_at
        for k in downs
    )


# -- a released dependent whose owner is full ------------------------------------------------------
@pytest.mark.timeout(300)
async def test_a_dependent_released_while_its_owner_is_full_runs_on_a_worker_with_a_free_slot(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """w1 (one slot) and w2 (two slots) each run a held step; ``down`` (owned by w1 by its
    bucket) runs after ``up``, which w2 runs in its free slot. Once ``up`` succeeds, ``down``
    is released while its owner has no slot: w2's sweep takes it (the orphan grace is 0.5 s)
    while both held steps still run, and it runs once, after ``up``."""
    gate = tmp_path / "gate"
    w1_buckets = set(owned_buckets("w1", ["w2"]))
    down = next(k for k in (f"down-{i}" for i in itertools.count()) if rules.bucket_of(k) in w1_buckets)
    held: TaskSpec = {"name": "step", "params": {"gate": str(gate)}, **LEASE}
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        workers = [pool.start("w1", "--concurrency", "1"), pool.start("w2", "--concurrency", "2")]
        await started(*workers)
        await peers_known(runner, ["w1", "w2"])
        await runner.publish_many(
            [
                {**held, "key": "held-1", "worker_ids": ["w1"]},
                {**held, "key": "held-2", "worker_ids": ["w2"]},
            ]
        )
        await wait_for(lambda: running(runner, "held-1", "held-2"), 60, "both held steps to run")
        await runner.publish_many(
            [
                {"name": "step", "key": "up", "worker_ids": ["w2"], **LEASE},
                {"name": "step", "key": down, "after": ["up"], **LEASE},
            ]
        )
        ran = await wait_for(lambda: all_finished(runner, ["up", down]), 60, "up and down to run")
        holding = [await runner.get(k) for k in ("held-1", "held-2")]
        gate.touch()
        tasks = await wait_for(lambda: all_finished(runner, ["held-1", "held-2"]), 60, "the held steps")
        marks = pool.marks()
    assert [t.state for t in holding] == [TaskState.RUNNING, TaskState.RUNNING]  # w1 never had a slot
    assert all(t.state is TaskState.SUCCESS for t in (*ran.values(), *tasks.values()))
    [up_entry], [down_entry] = ran["up"].workers, ran[down].workers
    assert down_entry.worker_id == "w2" and up_entry.finished_at is not None
    assert down_entry.claimed_at >= up_entry.finished_at
    assert_ran_once(ran | tasks, marks)


async def running(runner: TaskRunner, *keys: str) -> bool:
    states = [(await runner.get(k)).state for k in keys]
    return all(state is TaskState.RUNNING for state in states)


# -- the property: no early or double release under randomized kills -------------------------------
def random_graph(rng: random.Random, prefix: str, size: int) -> dict[str, list[str]]:
    """A random DAG of ``size`` steps: each after 1-3 earlier ones (the first after none, the
    second after none or the first)."""
    keys = [f"{prefix}-{i}" for i in range(size)]
    return {
        key: sorted(rng.sample(keys[:i], rng.randint(1 if i > 1 else 0, min(3, i))))
        for i, key in enumerate(keys)
    }


def expected_states(graph: Mapping[str, list[str]], failing: str | None) -> dict[str, TaskState]:
    """SUCCESS, but FAIL for the failing step and CANCELED for everything after it, transitively."""
    states: dict[str, TaskState] = {}
    for key, ups in graph.items():  # upstreams come first
        if key == failing:
            states[key] = TaskState.FAIL
        elif any(states[u] is not TaskState.SUCCESS for u in ups):
            states[key] = TaskState.CANCELED
        else:
            states[key] = TaskState.SUCCESS
    return states


async def busy(runner: TaskRunner, keys: list[str], live: list[WorkerProcess]) -> list[WorkerProcess] | bool:
    """The live workers running one of ``keys``; True once they all finished."""
    tasks = [await runner.get(k) for k in keys]
    if all(t.state.finished for t in tasks):
        return True
    running = {e.worker_id for t in tasks for e in t.workers if e.state is EntryState.RUNNING}
    return [w for w in live if w.worker_id in running]


@pytest.mark.timeout(300)
async def test_randomized_kills_release_no_step_early_or_twice(
    runner: TaskRunner, mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """Rounds of small random graphs (seeded) on 3 workers; in each, 1-2 workers busy with a
    run are SIGKILLed at random moments (and replaced), and sometimes one step fails for
    good: every step ends as its graph says (SUCCESS; FAIL; CANCELED after a failure),
    finished once, never claimed before its upstreams succeeded; a canceled one never ran."""
    rng = random.Random(20261126)
    missing = str(tmp_path / "never")
    ids = (f"w{i}" for i in itertools.count(1))
    killed: list[str] = []
    graphs: list[tuple[dict[str, list[str]], str | None]] = []
    started_at = time.monotonic()
    with WorkerPool(mongo_uri, collection_name, tmp_path, app=APP) as pool:
        live = [pool.start(next(ids), "--concurrency", "3") for _ in range(3)]
        await started(*live)
        async with ChangeRecorder(mongo_uri, collection_name) as changes:
            for round_ in range(4):
                graph = random_graph(rng, f"r{round_}", rng.randint(5, 8))
                failing = rng.choice(list(graph)[1:]) if rng.random() < 0.5 else None
                graphs.append((graph, failing))
                await runner.publish_many(
                    TaskSpec(name="step", key=key, after=ups, **LEASE)
                    | (
                        TaskSpec(name="step", params={"fail_without": missing}, max_failures=1)
                        if key == failing
                        else TaskSpec(name="step", params={"seconds": rng.uniform(0.2, 0.7)})
                    )
                    for key, ups in graph.items()
                )

                for _ in range(rng.randint(1, 2)):
                    await asyncio.sleep(rng.uniform(0.1, 1.0))  # when to kill: the seeded schedule
                    victims = await wait_for(partial(busy, runner, list(graph), live), 60, "a busy worker")
                    if not isinstance(victims, list):
                        break  # the round is over
                    victim = rng.choice(victims)
                    victim.kill()
                    killed.append(victim.worker_id)
                    live.remove(victim)
                    live.append(pool.start(next(ids), "--concurrency", "3"))
                await wait_for(partial(all_finished, runner, list(graph)), 120, f"round {round_} to end")
            tasks = {k: await runner.get(k) for graph, _ in graphs for k in graph}
            marks = pool.marks()
    print(f"{len(graphs)} rounds, {len(tasks)} steps, killed {killed}, {time.monotonic() - started_at:.1f}s")
    assert killed
    for graph, failing in graphs:
        assert {k: tasks[k].state for k in graph} == expected_states(graph, failing), (graph, failing)
    canceled = [k for k, t in tasks.items() if t.state is TaskState.CANCELED]
    assert all(tasks[k].workers == [] and not [m for m in marks if m["key"] == k] for k in canceled)
    assert_ran_once(tasks, marks, killed=killed)
    assert assert_never_early(tasks, changes) > 0
