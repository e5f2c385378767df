"""Publishing in the application's transaction, with real ``taskrunner worker`` processes
(docs/publishing.md, "Publishing in a transaction"): a task published in a transaction exists,
and runs, if and only if the transaction commits; a worker watching meanwhile never claims it
early; racing publishers of one key leave one task; a publisher killed inside its transaction
leaves nothing. On the embedded server, and on a real one with TASKRUNNER_TEST_MONGO_URI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from workers import TESTS_DIR, WorkerPool, finished

from taskrunner import TaskNotFound, TaskRunner, TaskState
from taskrunner.dev.processes import worker_env
from taskrunner.testing import wait_for

pytestmark = pytest.mark.mongo

APP = "apps.transactions_app:runner"
APP_DB = "txn_app"
# A publisher process: inside one transaction, the order and its confirmation task. It notes
# each attempt (a line in READY.attempts) and, once published, touches READY and waits for the
# GO file before committing (so two of them overlap inside their transactions); then prints
# what publish said.
PUBLISHER = """
import asyncio, json, os, sys, time
from pathlib import Path
from pymongo import AsyncMongoClient
from taskrunner import TaskRunner

order, key, orders, ready, go, hang = sys.argv[1:7]

async def main() -> None:
    client = AsyncMongoClient(os.environ["TASKRUNNER_MONGO_URI"])
    runner = TaskRunner(client=client, collection=os.environ["TASKRUNNER_COLLECTION"])
    attempts = 0

    async def place(session):
        nonlocal attempts
        attempts += 1
        with open(ready + ".attempts", "a") as noted:
            noted.write(f"{attempts}\\n")
        await client["txn_app"][orders].insert_one({"_id": order}, session=session)
        task = await runner.publish("confirm", {"order": order, "orders": orders}, key=key, session=session)
        Path(ready).touch()
        if hang == "hang":
            await asyncio.Event().wait()  # killed here, its transaction open
        while not Path(go).exists():
            await asyncio.sleep(0.02)
        return task.created

    async with client.start_session() as session:
        created = await session.with_transaction(place)
    print(json.dumps({"event": "committed", "created": created, "attempts": attempts}), flush=True)
    await client.close()

asyncio.run(main())
"""


@pytest.fixture
async def client(mongo_uri: str) -> AsyncIterator[AsyncMongoClient[dict[str, Any]]]:
    """The application's client, as the test's own publisher uses it."""
    app: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
    yield app
    await app.close()


def publisher(mongo_uri: str, collection: str, *args: str) -> subprocess.Popen[str]:
    env = worker_env(mongo_uri, collection=collection, python_path=[TESTS_DIR])
    return subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def runs_of(client: AsyncMongoClient[dict[str, Any]], orders: str, key: str) -> list[dict[str, Any]]:
    return await client[APP_DB][orders + "_runs"].find({"key": key}).to_list()


async def probe(runner: TaskRunner, key: str) -> None:
    """Publish a task outside any transaction and wait for it: the worker is claiming and
    running tasks meanwhile (it saw every change and sweep up to then)."""
    await runner.publish("confirm", {"order": "none", "orders": "probes"}, key=key)
    await wait_for(lambda: finished(runner, key), 60, f"probe {key} to run")


async def test_a_task_runs_if_and_only_if_its_transaction_commits(
    runner: TaskRunner,
    client: AsyncMongoClient[dict[str, Any]],
    mongo_uri: str,
    runner_collection: str,
    tmp_path: Path,
    collection_name: str,
) -> None:
    """With a worker running: a transaction that publishes and aborts leaves no task and no
    run; one held open while the worker runs other tasks is not claimed before its commit,
    then runs once and reads the order committed with it."""
    shared = TaskRunner(client=client, collection=runner_collection)
    orders = f"orders_{collection_name}"
    params = {"orders": orders}
    with WorkerPool(mongo_uri, runner_collection, tmp_path, app=APP) as pool:
        pool.start("w1", "--concurrency", "2")
        await probe(runner, "probe-0")

        async with client.start_session() as session, await session.start_transaction():
            await client[APP_DB][orders].insert_one({"_id": "o-aborted"}, session=session)
            await shared.publish(
                "confirm", params | {"order": "o-aborted"}, key="mail-aborted", session=session
            )
            await probe(runner, "probe-1")
            await session.abort_transaction()

        async with client.start_session() as session, await session.start_transaction():
            await client[APP_DB][orders].insert_one({"_id": "o-1", "total": 42}, session=session)
            await shared.publish("confirm", params | {"order": "o-1"}, key="mail-1", session=session)
            await probe(runner, "probe-2")
            before_commit = await runner.store.server_time()
            await session.commit_transaction()

        [done] = await wait_for(lambda: finished(runner, "mail-1"), 60, "the committed task to run")
        await probe(runner, "probe-3")

    assert done.state is TaskState.SUCCESS
    assert [e.claimed_at >= before_commit for e in done.workers] == [True]
    assert done.results == [{"order": {"_id": "o-1", "total": 42}}]
    assert len(await runs_of(client, orders, "mail-1")) == 1
    with pytest.raises(TaskNotFound):
        await runner.get("mail-aborted")
    assert await runs_of(client, orders, "mail-aborted") == []
    assert await client[APP_DB][orders].count_documents({}) == 1


async def test_racing_publisher_processes_of_one_key_leave_one_task(
    runner: TaskRunner,
    client: AsyncMongoClient[dict[str, Any]],
    mongo_uri: str,
    runner_collection: str,
    tmp_path: Path,
    collection_name: str,
) -> None:
    """Two processes publish the same key, each in a transaction with its own order, both
    inside their transactions at once: the write conflict is retried by the driver, one task
    exists, exactly one publisher learns it created it, and it runs once."""
    orders = f"orders_{collection_name}"
    go = tmp_path / "go"
    procs = [
        publisher(
            mongo_uri,
            runner_collection,
            f"o-{i}",
            "mail-shared",
            orders,
            str(tmp_path / f"ready-{i}"),
            str(go),
            "-",
        )
        for i in range(2)
    ]

    def attempts(i: int) -> int:
        noted = tmp_path / f"ready-{i}.attempts"
        return len(noted.read_text().split()) if noted.exists() else 0

    def overlapped() -> bool:
        """One publisher is inside with its task, and the other has met it (a write conflict
        made the driver run its transaction again)."""
        return any((tmp_path / f"ready-{i}").exists() and attempts(1 - i) >= 2 for i in range(2))

    try:
        await wait_for(overlapped, 60, "a publisher to meet the other's uncommitted task")
        go.touch()
        outputs = [await asyncio.to_thread(p.communicate, timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    said = [json.loads(out.splitlines()[-1]) for out, _ in outputs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    assert sorted(s["created"] for s in said) == [False, True]
    assert await runner.store.count() == 1
    with WorkerPool(mongo_uri, runner_collection, tmp_path, app=APP) as pool:
        pool.start("w1")
        [done] = await wait_for(lambda: finished(runner, "mail-shared"), 60, "the shared task to run")
    assert done.state is TaskState.SUCCESS
    assert len(await runs_of(client, orders, "mail-shared")) == 1
    assert await client[APP_DB][orders].count_documents({}) == 2


async def test_a_publisher_killed_inside_its_transaction_leaves_no_task(
    runner: TaskRunner,
    client: AsyncMongoClient[dict[str, Any]],
    mongo_uri: str,
    runner_collection: str,
    tmp_path: Path,
    collection_name: str,
) -> None:
    """SIGKILLed after publishing inside its open transaction: no task and no order ever
    appear, nothing runs, and once the server ends the transaction (its lifetime limit) the
    same key publishes and runs once."""
    orders = f"orders_{collection_name}"
    admin = client.admin
    limit = (await admin.command({"getParameter": 1, "transactionLifetimeLimitSeconds": 1}))[
        "transactionLifetimeLimitSeconds"
    ]
    await admin.command({"setParameter": 1, "transactionLifetimeLimitSeconds": 2})
    try:
        ready = tmp_path / "ready"
        proc = publisher(
            mongo_uri, runner_collection, "o-crash", "mail-crash", orders, str(ready), "-", "hang"
        )
        try:
            await wait_for(lambda: ready.exists(), 60, "the publisher inside its transaction")
        finally:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        with WorkerPool(mongo_uri, runner_collection, tmp_path, app=APP) as pool:
            pool.start("w1")
            await probe(runner, "probe-crash")
            with pytest.raises(TaskNotFound):
                await runner.get("mail-crash")
            # The server aborts the orphaned transaction; then the key is free to publish.
            await runner.publish("confirm", {"order": "o-crash", "orders": orders}, key="mail-crash")
            [done] = await wait_for(lambda: finished(runner, "mail-crash"), 60, "the republished task")
    finally:
        await admin.command({"setParameter": 1, "transactionLifetimeLimitSeconds": limit})
    assert done.created is False or done.state is TaskState.SUCCESS
    assert done.results == [{"order": None}]  # the killed transaction's order never committed
    assert len(await runs_of(client, orders, "mail-crash")) == 1
    assert await client[APP_DB][orders].count_documents({}) == 0
