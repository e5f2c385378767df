"""The memory store shared by several event loops and threads, as ``runner.sync()`` and a
worker on the main loop share it: each write is atomic and wakes every loop's streams."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

from taskrunner import MemoryStore, TaskContext, TaskRunner, TaskState


def app(store: MemoryStore) -> TaskRunner:
    runner = TaskRunner(store=store)

    @runner.task()
    async def echo(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        return params

    return runner


async def test_a_write_from_another_thread_wakes_a_stream_waiting_on_this_loop() -> None:
    """A change stream waiting on one loop hears of a task published from another thread's
    loop at once, not when its wait runs out."""
    store = MemoryStore()
    stream = await store.watch()
    other = app(store).for_another_loop()
    publisher = threading.Thread(target=asyncio.run, args=(other.publish("echo", {"n": 1}, key="k"),))
    started = time.monotonic()
    publisher.start()
    event = await stream.next(wait=60)
    publisher.join()
    assert event is not None and event.key == "k"
    assert time.monotonic() - started < 30  # woken by the write, well before the 60 s wait


async def test_a_worker_runs_what_the_sync_facade_publishes_on_the_same_memory_store() -> None:
    """``runner.sync()`` shares the runner's memory store: a worker on the main loop runs the
    task the facade published from another thread, and the facade reads its outcome."""
    runner = app(MemoryStore())
    worker = asyncio.create_task(runner.run_worker(concurrency=1, poll_interval=300))
    try:
        with runner.sync() as sync:
            published = await asyncio.to_thread(sync.publish, "echo", {"n": 2}, key="s")
            assert published.created
            done = await runner.wait("s", timeout=30)
            assert done.state is TaskState.SUCCESS and done.results == [{"n": 2}]
            seen = await asyncio.to_thread(sync.get, "s")
            assert seen.state is TaskState.SUCCESS
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker


def test_publishes_from_many_threads_create_each_key_once() -> None:
    """Threads publishing the same keys at once, each on its own loop, create every key
    exactly once: a publish's check and insert are one atomic step across threads."""
    store = MemoryStore()
    runner = app(store)
    created: list[int] = []

    async def publish_all() -> None:
        own = runner.for_another_loop()
        for i in range(400):
            created.append(int((await own.publish("echo", {"i": i}, key=f"k{i % 50}")).created))

    threads = [threading.Thread(target=asyncio.run, args=(publish_all(),)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(created) == 1600 and sum(created) == 50
    assert len(store.documents()) == 50
