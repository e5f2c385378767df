"""Change streams the server ends: every consumer reopens, covers the gap, logs once.

MongoDB ends a stream after an invalidate (the watched collection or database dropped or
renamed): its getMore answers ``ok: 1`` with cursor id 0, even when the stream's ``$match``
hides the invalidate event. The units below end streams with ``MemoryStore.end_streams``
(the contract suite holds both stores to the same ending); the worker-process test ends
the embedded server's streams as MongoDB would (tests/stream_ends.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import structlog
from pymongo import AsyncMongoClient, monitoring
from pymongo import errors as pe
from stream_ends import StreamEnder
from structlog.testing import capture_logs
from workers import WorkerPool, wait_exit

from taskrunner import MemoryStore, TaskRunner, TaskState
from taskrunner.dashboard.hub import Hub
from taskrunner.engine.discovery import Discovery
from taskrunner.engine.follow import ENDED, MIN_LIFE, StreamEnds
from taskrunner.engine.outage import Outage
from taskrunner.errors import ChangeHistoryLost, ChangeStreamEnded, StoreError
from taskrunner.limits.watch import LimitWatch
from taskrunner.models import Task
from taskrunner.store.base import ChangeEvent, ChangeStream
from taskrunner.store.mongo import MongoStore, mapped_errors
from taskrunner.testing import wait_for

FAULTS_APP = "apps.faults_app:runner"
LEASE: dict[str, Any] = {"ping_interval": 0.3, "ping_timeout": 1.5, "retry_backoff": 0}
Logs = Sequence[Mapping[str, Any]]


def ended(logs: Logs, stream: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] == ENDED and e.get("stream") == stream]


def warnings(logs: Logs) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["log_level"] in ("warning", "error") and e["event"] != ENDED]


class Watches(MemoryStore):
    """Records the resume token of every task stream opened; ``watch_limits`` counts."""

    def __init__(self) -> None:
        super().__init__()
        self.resumes: list[Any] = []
        self.limit_streams = 0

    async def watch(self, **options: Any) -> ChangeStream:
        self.resumes.append(options.get("resume_after"))
        return await super().watch(**options)

    async def watch_limits(self) -> ChangeStream:
        self.limit_streams += 1
        return await super().watch_limits()


def test_resuming_after_an_invalidate_is_lost_history() -> None:
    """MongoDB's 260 (a token a stream cannot resume from, as after an invalidate) is
    ``ChangeHistoryLost``: the consumer opens a new stream and rescans."""
    with pytest.raises(ChangeHistoryLost, match="open a new one"), mapped_errors():
        raise pe.OperationFailure("cannot resume after an invalidate", code=260)


def test_a_reopened_stream_that_lived_is_ended_again_not_failing() -> None:
    """A reopened stream the server ends before any of its getMores came back (they wait
    up to 5 s for events) is a new end when it lived ``MIN_LIFE`` or more: logged and
    reopened again; only one that ends sooner cannot be followed (poll, unlogged here)."""
    now = [0.0]
    with capture_logs() as logs:
        ends = StreamEnds(structlog.get_logger("test"), "tasks", clock=lambda: now[0])
        end = ChangeStreamEnded(ChangeStreamEnded.CURSOR_CLOSED)
        first = ends.ended(end)
        now[0] += MIN_LIFE
        second = ends.ended(end)  # the reopened stream waited on its first getMore
        now[0] += MIN_LIFE / 10
        third = ends.ended(end)  # this one ended at once
        now[0] += 10 * MIN_LIFE
        fourth = ends.ended(end)  # a stream retried after polling, unanswered: still failing
        ends.worked()
        fifth = ends.ended(end)
    assert (first, second, third, fourth, fifth) == (True, True, False, False, True)
    assert [e["event"] for e in logs] == [ENDED] * 3


# -- discovery: the worker's task stream ------------------------------------------------------------
async def test_discovery_reopens_an_ended_stream_without_its_token_and_sweeps() -> None:
    """The worker's stream, ended by the server, is reopened without the old token, a sweep
    is asked for, ``change stream ended`` is logged once, and new tasks arrive on the new stream."""
    store = Watches()
    heard: list[str] = []
    sweeps: list[datetime | None] = []
    discovery = Discovery(
        store, ["job"], consider=lambda t: heard.append(t.key), sweep_at=sweeps.append, keyless=lambda: None
    )
    stop = asyncio.Event()
    with capture_logs() as logs:
        following = asyncio.create_task(discovery.run(stop))
        try:
            await wait_for(lambda: sweeps, 10, "the first stream to open")
            await wait_for(store.end_streams, 10, "a stream to end")
            await wait_for(
                lambda: len(store.resumes) == 2 and len(sweeps) == 2, 10, "a new stream and a sweep"
            )
            await TaskRunner(store=store).publish("job", key="after", allow_unknown=True)
            await wait_for(lambda: heard == ["after"], 10, "the new stream to deliver")
        finally:
            stop.set()
            await following
    assert store.resumes[1] is None and sweeps == [None, None]
    assert (
        len(ended(logs, "tasks")) == 1
        and ended(logs, "tasks")[0]["reason"] == ChangeStreamEnded.CURSOR_CLOSED
    )
    assert warnings(logs) == [] and not discovery.polling


class EndingAtOnce(MemoryStore):
    """A server whose new task streams all end at their first getMore."""

    async def watch(self, **options: Any) -> ChangeStream:
        stream = await super().watch(**options)
        self.end_streams()
        return stream


async def test_discovery_polls_when_every_new_stream_ends_at_once() -> None:
    """A stream that ends again before it answered once is one that cannot be followed: one
    ``change stream ended`` line, then the worker polls (one warning) while retrying it."""
    store = EndingAtOnce()
    discovery = Discovery(store, ["job"], consider=print, sweep_at=lambda at: None, keyless=lambda: None)
    stop = asyncio.Event()
    with capture_logs() as logs:
        following = asyncio.create_task(discovery.run(stop))
        try:
            await wait_for(lambda: discovery.polling, 10, "discovery to poll")
        finally:
            stop.set()
            await following
    assert len(ended(logs, "tasks")) == 1
    assert [e["event"] for e in warnings(logs)] == [
        "change stream failing; polling instead while retrying it"
    ]


# -- the limits watch ---------------------------------------------------------------------------------
def limit_watch(store: MemoryStore | MongoStore, seen: list[frozenset[str]]) -> LimitWatch:
    return LimitWatch(store, ["job"], seen.append, lambda: datetime.now(UTC))


async def test_the_limits_watch_reopens_an_ended_stream_and_reads_again() -> None:
    """The limits stream, ended by the server, is reopened and the documents read again;
    ``change stream ended`` is logged once and a later pause applies through the new stream."""
    store = Watches()
    seen: list[frozenset[str]] = []
    watch, stop = limit_watch(store, seen), asyncio.Event()
    outage = Outage(
        structlog.get_logger("tests"), "cannot read the limits; retrying", "limits readable again"
    )
    with capture_logs() as logs:
        following = asyncio.create_task(watch.run(stop, outage))
        try:
            await wait_for(lambda: store.limit_streams == 1, 10, "the limits stream to open")
            await wait_for(store.end_streams, 10, "a stream to end")
            await wait_for(lambda: store.limit_streams == 2, 10, "a new limits stream")
            await store.pause("job", True)
            await wait_for(lambda: seen == [frozenset({"job"})], 10, "the pause to apply")
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
    assert len(ended(logs, "limits")) == 1 and warnings(logs) == []


class NoLimitStreams(MemoryStore):
    """A server that refuses every limits stream (e.g. not allowed to open one)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    async def watch_limits(self) -> ChangeStream:
        self.refused += 1
        raise StoreError("not authorized on taskrunner to execute command aggregate")


async def test_the_limits_watch_polls_while_its_stream_cannot_be_opened() -> None:
    """A limits stream that cannot be opened degrades to reading every half second (one
    warning), as the task stream does, while the stream is retried with backoff."""
    store = NoLimitStreams()
    seen: list[frozenset[str]] = []
    watch = limit_watch(store, seen)
    outage = Outage(
        structlog.get_logger("tests"), "cannot read the limits; retrying", "limits readable again"
    )
    with capture_logs() as logs:
        following = asyncio.create_task(watch.run(asyncio.Event(), outage))
        try:
            await wait_for(lambda: store.refused >= 1, 10, "a refused stream")
            await store.pause("job", True)
            await wait_for(lambda: seen == [frozenset({"job"})], 10, "the pause to apply by polling")
            await wait_for(lambda: store.refused >= 2, 10, "the stream to be retried")
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
    assert [e["event"] for e in warnings(logs)] == [
        "limits change stream failing; reading the limits every 0.5 s instead while retrying it"
    ]


class GetMoreStream:
    """A limits stream answering as PyMongo's does: ``next`` returns when its getMore does
    (after the server's 5 s await), whatever wait it was given. Counts its getMores and
    the cancelled ones (PyMongo closes the connection of a cancelled getMore)."""

    def __init__(self) -> None:
        self.get_mores = self.cancelled = 0

    @property
    def resume_token(self) -> None:
        return None

    async def next(self, wait: float) -> ChangeEvent | None:
        self.get_mores += 1
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return None

    async def close(self) -> None:
        return None


class SlowGetMores(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.stream = GetMoreStream()

    async def watch_limits(self) -> ChangeStream:
        return self.stream


async def test_a_throttle_ends_on_time_without_cancelling_or_adding_a_getmore() -> None:
    """``RateLimited(retry_after=1)`` frees the name within a fraction of a second of its
    end although the limits stream's getMore waits 5 s: the watch stops waiting on it
    without cancelling it (which would close a connection) and sends no other getMore."""
    store = SlowGetMores()
    await store.throttle("job", 1.0)
    ends = time.monotonic() + 1.0
    seen: list[frozenset[str]] = []
    freed: list[float] = []
    watch = LimitWatch(store, ["job"], recorder(seen, freed), lambda: datetime.now(UTC))
    following = asyncio.create_task(
        watch.run(asyncio.Event(), Outage(structlog.get_logger("tests"), "x", "y"))
    )
    try:
        await wait_for(lambda: len(seen) == 2, 10, "the throttle to start and end")
        get_mores = (store.stream.get_mores, store.stream.cancelled)
    finally:
        following.cancel()  # this cancels the getMore: the worker is stopping
        await asyncio.gather(following, return_exceptions=True)
    assert seen == [frozenset({"job"}), frozenset()]
    assert freed[1] - ends < 0.5, f"freed {freed[1] - ends:.2f} s after the throttle's end"
    assert get_mores == (1, 0)


def recorder(seen: list[frozenset[str]], at: list[float]) -> Callable[[frozenset[str]], None]:
    """An ``on_change`` that records what is paused and when."""

    def record(paused: frozenset[str]) -> None:
        seen.append(paused)
        at.append(time.monotonic())

    return record


class ClosedConnections(monitoring.ConnectionPoolListener):
    """Counts the connections the client closed."""

    def __init__(self) -> None:
        self.closed = 0

    def connection_closed(self, event: monitoring.ConnectionClosedEvent) -> None:
        self.closed += 1

    def pool_created(self, event: monitoring.PoolCreatedEvent) -> None: ...
    def pool_ready(self, event: monitoring.PoolReadyEvent) -> None: ...
    def pool_cleared(self, event: monitoring.PoolClearedEvent) -> None: ...
    def pool_closed(self, event: monitoring.PoolClosedEvent) -> None: ...
    def connection_created(self, event: monitoring.ConnectionCreatedEvent) -> None: ...
    def connection_ready(self, event: monitoring.ConnectionReadyEvent) -> None: ...
    def connection_check_out_started(self, event: monitoring.ConnectionCheckOutStartedEvent) -> None: ...
    def connection_check_out_failed(self, event: monitoring.ConnectionCheckOutFailedEvent) -> None: ...
    def connection_checked_out(self, event: monitoring.ConnectionCheckedOutEvent) -> None: ...
    def connection_checked_in(self, event: monitoring.ConnectionCheckedInEvent) -> None: ...


@pytest.mark.embedded
async def test_a_throttle_ends_on_time_on_the_embedded_server(
    embedded_uri: str, collection_name: str
) -> None:
    """On a server whose limits getMore awaits 5 s, a 1.5 s throttle frees its name within
    a fraction of a second of its end, and no connection is closed for it."""
    connections = ClosedConnections()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        embedded_uri, tz_aware=True, event_listeners=[connections]
    )
    store = MongoStore(client, "taskrunner", collection_name)
    seen: list[frozenset[str]] = []
    freed: list[float] = []
    watch = LimitWatch(store, ["job"], recorder(seen, freed), lambda: datetime.now(UTC))
    await store.throttle("job", 1.5)  # before the watch starts: it opens its stream, reads, waits
    ends = time.monotonic() + 1.5
    following = asyncio.create_task(
        watch.run(asyncio.Event(), Outage(structlog.get_logger("tests"), "x", "y"))
    )
    try:
        await wait_for(lambda: len(seen) == 2, 15, "the throttle to start and end")
        closed = connections.closed
    finally:
        following.cancel()  # this cancels the getMore: the worker is stopping
        await asyncio.gather(following, return_exceptions=True)
        await client.close()
    assert seen == [frozenset({"job"}), frozenset()]
    assert freed[1] - ends < 0.75, f"freed {freed[1] - ends:.2f} s after the throttle's end"
    assert closed == 0


# -- wait ------------------------------------------------------------------------------------------------
async def test_wait_reopens_an_ended_stream_and_reads_the_task_again() -> None:
    """``runner.wait`` and ``task.wait`` whose streams the server ends reopen them, read the
    task again and log the end once each: the task's success is seen at once, not after
    the 30 s poll interval."""
    store = MemoryStore()
    runner = TaskRunner(store=store)
    [first, second] = [await runner.publish("job", key=k, allow_unknown=True) for k in ("w1", "w2")]
    with capture_logs() as logs:
        waits = [
            asyncio.create_task(runner.wait("w1", 8, poll_interval=30)),
            asyncio.create_task(second.wait(8)),
        ]
        started = time.monotonic()
        await wait_for(lambda: store.end_streams() >= 2, 10, "both waits' streams to end")
        for key in ("w1", "w2"):
            claim = await store.claim("w", key=key)
            assert claim is not None
            await store.write_runs([_success(key, claim.run_id)])
        done = await asyncio.gather(*waits)
    assert [t.state for t in done] == [TaskState.SUCCESS, TaskState.SUCCESS]
    assert time.monotonic() - started < 5
    assert sorted(e["key"] for e in ended(logs, "wait")) == ["w1", "w2"] and first.key == "w1"


def _success(key: str, run_id: str) -> Any:
    from taskrunner.store.base import RunWrite

    return RunWrite("success", key, run_id, "w", 1)


class EndingKeyStreams(MemoryStore):
    """A server whose key streams end at their first getMore, every time."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = 0

    async def watch(self, **options: Any) -> ChangeStream:
        self.opened += 1
        stream = await super().watch(**options)
        self.end_streams()
        return stream


async def test_wait_polls_when_its_reopened_stream_ends_at_once() -> None:
    """A wait whose reopened stream ends again before answering gives the stream up and
    polls: one ``change stream ended`` line, two streams opened, and the task still seen."""
    store = EndingKeyStreams()
    runner = TaskRunner(store=store)
    await runner.publish("job", key="p", allow_unknown=True)

    async def finish() -> None:
        await wait_for(lambda: store.opened == 2, 10, "the stream to be reopened once")
        claim = await store.claim("w", key="p")
        assert claim is not None
        await store.write_runs([_success("p", claim.run_id)])

    with capture_logs() as logs:
        task, _ = await asyncio.gather(runner.wait("p", 10, poll_interval=0.1), finish())
    assert task.state is TaskState.SUCCESS and store.opened == 2 and len(ended(logs, "wait")) == 1


# -- the dashboard's hub -----------------------------------------------------------------------------
async def next_message(queue: asyncio.Queue[str]) -> str:
    return await asyncio.wait_for(queue.get(), 10)


async def test_the_hub_names_updated_tasks_and_rereads_after_its_stream_ends() -> None:
    """The hub's summary stream names the task of each change (updates by the ``_id`` its
    insert showed); when the server ends the stream the pages are told to read anew, the
    end is logged once, and a new stream carries on."""
    store = MemoryStore()
    hub = Hub(store)
    queue = hub.subscribe()
    with capture_logs() as logs:
        following = asyncio.create_task(hub.run())
        try:
            await wait_for(lambda: store._streams, 10, "the hub's stream to open")
            await TaskRunner(store=store).publish("job", key="a", allow_unknown=True)
            assert await next_message(queue) == '{"kind": "insert", "key": "a", "state": "PENDING"}'
            assert await store.claim("w", key="a") is not None
            assert await next_message(queue) == '{"kind": "update", "key": "a", "state": "RUNNING"}'
            assert store.end_streams() == 1
            assert await next_message(queue) == '{"kind": "poll", "key": null}'
            await wait_for(lambda: store._streams, 10, "a new stream")
            await TaskRunner(store=store).publish("job", key="b", allow_unknown=True)
            assert await next_message(queue) == '{"kind": "insert", "key": "b", "state": "PENDING"}'
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
    assert len(ended(logs, "dashboard")) == 1 and warnings(logs) == []


class NoTaskStreams(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    async def watch(self, **options: Any) -> ChangeStream:
        self.refused += 1
        raise StoreError("not authorized on taskrunner to execute command aggregate")


async def test_the_hub_polls_while_its_stream_cannot_be_opened() -> None:
    """A hub whose stream fails polls the newest ``updated_at`` (pages still hear of
    changes), warns once, and retries the stream with backoff."""
    store = NoTaskStreams()
    hub = Hub(store)
    queue = hub.subscribe()
    with capture_logs() as logs:
        following = asyncio.create_task(hub.run())
        try:
            await wait_for(lambda: store.refused >= 1, 10, "a refused stream")
            await TaskRunner(store=store).publish("job", key="a", allow_unknown=True)
            assert await next_message(queue) == '{"kind": "poll", "key": null}'
            await wait_for(lambda: store.refused >= 2, 10, "the stream to be retried")
            await TaskRunner(store=store).publish("job", key="b", allow_unknown=True)
            assert await next_message(queue) == '{"kind": "poll", "key": null}'
            assert queue.empty()  # a retry alone says no change
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
    assert [e["event"] for e in warnings(logs)] == [
        "dashboard change stream failing; polling instead while retrying it"
    ]


# -- worker processes ------------------------------------------------------------------------------------
@pytest.mark.embedded
@pytest.mark.timeout(300)
async def test_workers_whose_streams_the_server_ends_carry_on(
    embedded_uri: str, collection_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers whose task and limits streams the server ends mid-run (a 6 s task in
    progress): the running task keeps its lease and finishes once on its worker, 5 tasks
    published afterwards all run, each worker logs ``change stream ended`` once per stream,
    and both exit within 10 s of SIGTERM."""
    ender = StreamEnder(embedded_uri, monkeypatch)
    async with TaskRunner(embedded_uri, collection=collection_name) as runner:
        await runner.init()
        with WorkerPool(embedded_uri, collection_name, tmp_path, app=FAULTS_APP) as pool:
            workers = pool.start_many(["w1", "w2"])
            await wait_for(lambda: all(w.find("change stream opened") for w in workers), 60, "streams")
            await runner.publish("nap", {"seconds": 6}, key="long", **LEASE)
            await wait_for(lambda: pool.marks(key="long", event="start"), 60, "the long task to start")
            # Each worker's task and limits streams (the same numbers of lines are expected).
            ends = {
                stream: await ender.end(f"taskrunner.{collection_name}{suffix}")
                for stream, suffix in (("tasks", ""), ("limits", ".limits"))
            }
            # A worker that spins on the ended stream freezes: its run never finishes.
            await wait_for(lambda: pool.marks(key="long", event="finish"), 30, "the long task to finish")
            await wait_for(
                lambda: all(sum(len(ended(w.logs(), s)) for w in workers) >= n for s, n in ends.items()),
                30,
                "the workers to log their streams' ends",
            )
            keys = [f"after{i}" for i in range(5)]
            for key in keys:
                await runner.publish("nap", {"seconds": 0.1}, key=key, **LEASE)

            async def all_done() -> bool:
                tasks = [await runner.get(k) for k in ["long", *keys]]
                return all(t.state is TaskState.SUCCESS for t in tasks)

            await wait_for(all_done, 60, "every task to succeed")
            for worker in workers:
                worker.terminate()
            codes = [await wait_exit(worker, 10) for worker in workers]
            logs = {w.worker_id: w.logs() for w in workers}
            marks = pool.marks()
    assert codes == [0, 0]
    long = [m for m in marks if m["key"] == "long"]
    assert [m["event"] for m in long] == ["start", "finish"] and len({m["run_id"] for m in long}) == 1
    assert len((await _task(embedded_uri, collection_name, "long")).workers) == 1
    assert sorted(m["key"] for m in marks if m["event"] == "start" and m["key"] != "long") == keys
    # Once per end: as many lines as streams ended, one per stream and worker. (A worker that
    # reopened its task stream for new peers just then has no stream to end: rarely 1 of 2.)
    assert ends["limits"] == 2 and ends["tasks"] >= 1, ends
    for stream, n in ends.items():
        lines_per_worker = [len(ended(lines, stream)) for lines in logs.values()]
        assert sum(lines_per_worker) == n and max(lines_per_worker) == 1, (stream, lines_per_worker)
    for worker_id, lines in logs.items():
        assert not [e for e in lines if e.get("level") in ("error", "critical")], worker_id


async def _task(uri: str, collection: str, key: str) -> Task:
    async with TaskRunner(uri, collection=collection) as runner:
        return await runner.get(key)
