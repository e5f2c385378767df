"""A change stream that opens but whose every getMore fails: workers degrade to polling.

The failure is injected in the embedded server's bridge (``_ChangeStreams.get_more``
answers every getMore with ``Unauthorized``), so these tests run on the embedded server
only: a real MongoDB cannot be told to fail getMores. Worker processes are real.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from workers import WorkerPool

from taskrunner import TaskRunner, TaskState
from taskrunner.dev import streams, wire
from taskrunner.testing import wait_for

pytestmark = pytest.mark.embedded

TASKS = 60
WORKERS = ["w1", "w2", "w3"]
WARNING = "change stream failing; polling instead while retrying it"
RECOVERED = "change stream recovered; sweeping on events again"


@pytest.fixture
def failing_get_mores(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every change-stream getMore on the embedded server fails; counts them."""
    failures: Counter[str] = Counter()

    async def get_more(self: Any, command: Any) -> dict[str, Any]:
        failures["getMore"] += 1
        raise wire.failure("not authorized on taskrunner to execute command getMore", 13, "Unauthorized")

    monkeypatch.setattr(streams.ChangeStreams, "get_more", get_more)
    return failures


async def test_failing_get_mores_degrade_to_even_polling_without_noise(
    embedded_uri: str, collection_name: str, tmp_path: Path, failing_get_mores: Counter[str]
) -> None:
    """Each worker warns once, polls, keeps retrying the stream quietly, and the 60 tasks all run, spread evenly."""
    async with TaskRunner(embedded_uri, collection=collection_name) as runner:
        await runner.init()
        with WorkerPool(embedded_uri, collection_name, tmp_path) as pool:
            workers = pool.start_many(WORKERS, "--poll-interval", "0.5", "--concurrency", "4")
            await wait_for(lambda: all(w.find(WARNING) for w in workers), 60, "every worker to degrade")
            for i in range(TASKS):
                await runner.publish("quick", key=f"t{i:03}")

            async def all_done() -> bool:
                return await runner.store.count(state=TaskState.SUCCESS) == TASKS

            await wait_for(all_done, 120, f"{TASKS} tasks to succeed by polling")
            retried = failing_get_mores["getMore"]
            await wait_for(
                lambda: failing_get_mores["getMore"] >= retried + len(WORKERS), 60, "stream retries"
            )
            assert all(w.alive() for w in workers)
            logs = {w.worker_id: w.logs() for w in workers}
            raw = {w.worker_id: w.log_path.read_text() for w in workers}
        done = await runner.store.find(state=TaskState.SUCCESS)

    runs = Counter(t.workers[0].worker_id for t in done)
    assert sum(runs.values()) == TASKS and len(pool.marks(event="finish")) == TASKS
    assert max(runs.values()) <= 2 * TASKS / len(WORKERS), runs
    for worker_id, lines in logs.items():
        events = Counter(str(line.get("event")) for line in lines)
        assert events[WARNING] == 1, (worker_id, events)
        assert events[RECOVERED] == 0, (worker_id, events)
        assert not [line for line in lines if line.get("level") in ("error", "critical")], worker_id
        assert "Traceback" not in raw[worker_id], worker_id
