"""Publishing, cancelling and retrying inside the application's own MongoDB transaction
(docs/publishing.md, "Publishing in a transaction"): the task exists if and only if the
transaction commits. On the embedded server, and on a real one with TASKRUNNER_TEST_MONGO_URI."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.synchronous.client_session import ClientSession

from taskrunner import ConfigurationError, InvalidState, MemoryStore, TaskNotFound, TaskRunner, TaskState

pytestmark = pytest.mark.mongo

APP_DB = "txn_app"


@pytest.fixture
async def client(mongo_uri: str) -> AsyncIterator[AsyncMongoClient[dict[str, Any]]]:
    """The application's own async client."""
    app: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
    yield app
    await app.close()


@pytest.fixture
async def shared(client: AsyncMongoClient[dict[str, Any]], collection_name: str) -> TaskRunner:
    """A runner on the application's client (client=), its collection initialized."""
    runner = TaskRunner(client=client, collection=collection_name)
    await runner.init()
    return runner


async def test_a_committed_transaction_publishes_and_an_aborted_one_does_not(
    client: AsyncMongoClient[dict[str, Any]], shared: TaskRunner, collection_name: str
) -> None:
    """The order and its task commit together; when the transaction aborts, neither exists."""
    orders = client[APP_DB][collection_name]

    async def place(session: AsyncClientSession) -> bool:
        await orders.insert_one({"_id": "o1"}, session=session)
        task = await shared.publish(
            "mail", {"order": "o1"}, key="mail-o1", allow_unknown=True, session=session
        )
        return task.created

    async with client.start_session() as session:
        assert await session.with_transaction(place) is True
    assert (await shared.get("mail-o1")).state is TaskState.PENDING

    async with client.start_session() as session, await session.start_transaction():
        await orders.insert_one({"_id": "o2"}, session=session)
        await shared.publish_many(
            [{"name": "mail", "key": "mail-o2"}, {"name": "mail", "key": "mail-o2b"}],
            allow_unknown=True,
            session=session,
        )
        await session.abort_transaction()
    for key in ("mail-o2", "mail-o2b"):
        with pytest.raises(TaskNotFound):
            await shared.get(key)
    assert await orders.count_documents({}) == 1


async def test_uncommitted_tasks_are_invisible_outside_the_transaction(
    client: AsyncMongoClient[dict[str, Any]], shared: TaskRunner, mongo_uri: str, collection_name: str
) -> None:
    """Until the commit no other client reads the task (a worker's reads are such reads)."""
    async with TaskRunner(mongo_uri, collection=collection_name) as outsider:
        async with client.start_session() as session, await session.start_transaction():
            await shared.publish("mail", key="pending-commit", allow_unknown=True, session=session)
            with pytest.raises(TaskNotFound):
                await outsider.get("pending-commit")
            assert await outsider.store.count() == 0
        assert (await outsider.get("pending-commit")).state is TaskState.PENDING


async def test_racing_transactions_publishing_one_key_leave_one_task(
    client: AsyncMongoClient[dict[str, Any]], shared: TaskRunner
) -> None:
    """Two transactions publishing the same key at once: the driver's transaction retry
    resolves the write conflict, one task exists, and exactly one caller learns it created it."""
    first_wrote, second_tried = asyncio.Event(), asyncio.Event()
    second_attempts = 0

    async def first(session: AsyncClientSession) -> bool:
        task = await shared.publish("mail", key="racy", allow_unknown=True, session=session)
        first_wrote.set()
        await second_tried.wait()  # the other transaction meets this one's uncommitted task
        return task.created

    async def second(session: AsyncClientSession) -> bool:
        nonlocal second_attempts
        await first_wrote.wait()
        second_attempts += 1
        try:
            return (await shared.publish("mail", key="racy", allow_unknown=True, session=session)).created
        finally:
            second_tried.set()

    async def run(callback: Any) -> bool:
        async with client.start_session() as session:
            created: bool = await session.with_transaction(callback)
            return created

    assert list(await asyncio.gather(run(first), run(second))) == [True, False]
    assert second_attempts >= 2  # its first attempt hit the write conflict and was run again
    assert await shared.store.count() == 1


async def test_cancel_and_retry_hold_only_if_the_transaction_commits(
    client: AsyncMongoClient[dict[str, Any]], shared: TaskRunner
) -> None:
    """An aborted transaction's cancel leaves the task PENDING; a committed one cancels it,
    and a committed retry makes it PENDING again."""
    await shared.publish("mail", key="c", allow_unknown=True)
    async with client.start_session() as session, await session.start_transaction():
        assert (await shared.cancel("c", session=session)).state is TaskState.CANCELED
        await session.abort_transaction()
    assert (await shared.get("c")).state is TaskState.PENDING

    async def cancel(session: AsyncClientSession) -> None:
        await shared.cancel("c", session=session)

    async def retry(session: AsyncClientSession) -> None:
        await shared.retry("c", session=session)

    async with client.start_session() as session:
        await session.with_transaction(cancel)
        assert (await shared.get("c")).state is TaskState.CANCELED
        await session.with_transaction(retry)
    assert (await shared.get("c")).state is TaskState.PENDING


async def test_refusals_inside_a_transaction_are_taskrunners_errors(
    client: AsyncMongoClient[dict[str, Any]], shared: TaskRunner
) -> None:
    """A retry of a task that has not failed raises InvalidState in a transaction, as
    outside one, and a cancel of an unknown key TaskNotFound."""
    await shared.publish("mail", key="pending", allow_unknown=True)
    async with client.start_session() as session, await session.start_transaction():
        with pytest.raises(InvalidState):
            await shared.retry("pending", session=session)
    async with client.start_session() as session, await session.start_transaction():
        with pytest.raises(TaskNotFound):
            await shared.cancel("nothing-here", session=session)


async def test_tasks_after_others_published_in_the_same_transaction(
    client: AsyncMongoClient[dict[str, Any]], shared: TaskRunner
) -> None:
    """A task may run after one published earlier in the same transaction: the upstream is
    read through the session, and after the commit the dependent waits for it."""

    async def publish(session: AsyncClientSession) -> None:
        await shared.publish("mail", key="up", allow_unknown=True, session=session)
        await shared.publish("mail", key="down", after=["up"], allow_unknown=True, session=session)

    async with client.start_session() as session:
        await session.with_transaction(publish)
    down = await shared.get("down")
    assert (down.state, down.after, down.waiting_on) == (TaskState.WAITING, ["up"], ["up"])


async def test_a_shared_client_stays_open_when_the_runner_closes(
    client: AsyncMongoClient[dict[str, Any]], shared: TaskRunner, collection_name: str
) -> None:
    """client= is the application's: closing the runner leaves it usable."""
    await shared.close()
    await client[APP_DB][collection_name].insert_one({"_id": "still-open"})


def test_client_and_a_uri_or_store_together_are_refused(client: AsyncMongoClient[dict[str, Any]]) -> None:
    """client= is the connection: a URI or a store beside it is a configuration error."""
    with pytest.raises(ConfigurationError, match="client="):
        TaskRunner("mongodb://elsewhere", client=client)
    with pytest.raises(ConfigurationError, match="client="):
        TaskRunner(store=MemoryStore(), client=client)


async def test_a_memory_store_refuses_a_session(client: AsyncMongoClient[dict[str, Any]]) -> None:
    """A MemoryStore has no transaction to join: session= is a clear error, nothing stored."""
    runner = TaskRunner(store=MemoryStore())
    async with client.start_session() as session:
        with pytest.raises(ConfigurationError, match="MemoryStore"):
            await runner.publish("mail", key="m", allow_unknown=True, session=session)
    assert await runner.store.count() == 0


@pytest.fixture
def sync_client(mongo_uri: str) -> Iterator[MongoClient[dict[str, Any]]]:
    """The application's own sync client."""
    app: MongoClient[dict[str, Any]] = MongoClient(mongo_uri)
    yield app
    app.close()


def test_the_sync_facade_publishes_in_the_applications_sync_transaction(
    sync_client: MongoClient[dict[str, Any]], mongo_uri: str, collection_name: str
) -> None:
    """runner.sync(client=MongoClient) takes that client's sessions: committed, the task
    exists and waits like any; aborted, it does not; the client stays open after close."""
    facade = TaskRunner(mongo_uri, collection=collection_name).sync(client=sync_client)
    orders = sync_client[APP_DB][collection_name]

    def place(session: ClientSession) -> None:
        orders.insert_one({"_id": "s1"}, session=session)
        facade.publish("mail", key="sync-1", allow_unknown=True, session=session)

    with sync_client.start_session() as session:
        session.with_transaction(place)
    assert facade.get("sync-1").state is TaskState.PENDING
    with sync_client.start_session() as session, session.start_transaction():
        facade.publish_many([{"name": "mail", "key": "sync-2"}], allow_unknown=True, session=session)
        session.abort_transaction()
    with pytest.raises(TaskNotFound):
        facade.get("sync-2")
    facade.cancel("sync-1")
    assert facade.wait("sync-1", timeout=10).state is TaskState.CANCELED
    facade.close()
    assert orders.count_documents({}) == 1


def test_the_sync_facade_refuses_a_session_of_another_client(
    sync_client: MongoClient[dict[str, Any]], mongo_uri: str, collection_name: str
) -> None:
    """A session must come from the client the facade runs on (or it could not join it)."""
    facade = TaskRunner(mongo_uri, collection=collection_name).sync()
    try:
        with sync_client.start_session() as session, pytest.raises(ConfigurationError, match="client"):
            facade.publish("mail", key="x", allow_unknown=True, session=session)
    finally:
        facade.close()


async def test_update_pending_and_republish_finished_take_effect_only_on_commit(
    client: AsyncMongoClient[dict[str, Any]], shared: TaskRunner
) -> None:
    """update_pending and republish_finished in a transaction change the stored task if and
    only if the transaction commits."""
    await shared.publish("mail", {"v": 1}, key="u", allow_unknown=True)
    await shared.publish("mail", key="f", allow_unknown=True)
    await shared.cancel("f")
    async with client.start_session() as session, await session.start_transaction():
        updated = await shared.publish(
            "mail", {"v": 2}, key="u", update_pending=True, allow_unknown=True, session=session
        )
        again = await shared.publish(
            "mail", key="f", republish_finished=True, allow_unknown=True, session=session
        )
        assert (updated.params, again.state, again.created) == ({"v": 2}, TaskState.PENDING, True)
        await session.abort_transaction()
    assert (await shared.get("u")).params == {"v": 1}
    assert (await shared.get("f")).state is TaskState.CANCELED

    async def change(session: AsyncClientSession) -> None:
        await shared.publish(
            "mail", {"v": 3}, key="u", update_pending=True, allow_unknown=True, session=session
        )
        await shared.publish("mail", key="f", republish_finished=True, allow_unknown=True, session=session)

    async with client.start_session() as session:
        await session.with_transaction(change)
    assert (await shared.get("u")).params == {"v": 3}
    assert (await shared.get("f")).state is TaskState.PENDING


def test_a_runner_on_an_async_client_has_no_thread_facade(
    client: AsyncMongoClient[dict[str, Any]], sync_client: MongoClient[dict[str, Any]]
) -> None:
    """The application's async client belongs to its event loop: runner.sync() refuses it,
    saying what to do, and runner.sync(client=MongoClient) runs on the sync client instead."""
    runner = TaskRunner(client=client)
    with pytest.raises(ConfigurationError, match="belongs to its event loop"):
        runner.sync()
    facade = runner.sync(client=sync_client)
    facade.close()
