"""The app benchmark worker processes run (``bench/processes.py`` starts them).

Worker processes load it with ``--app apps:app`` and ``bench/`` on ``PYTHONPATH``;
the URI and collection come from ``TASKRUNNER_MONGO_URI``/``TASKRUNNER_COLLECTION``.
Handlers:

    noop    returns None (throughput: the engine's own cost per task)
    stamp   returns time.time() at handler start (pickup latency = start - publish time,
            both read on this machine's clock)
    sleep   params {"seconds": float}; sleeps asynchronously (takeover runs)

"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import BaseModel

from taskrunner import TaskRunner

app = TaskRunner()


@app.task("noop")
async def noop(params: dict[str, Any]) -> None:
    return None


@app.task("stamp")
async def stamp(params: dict[str, Any]) -> float:
    return time.time()  # first statement: the handler's start as the worker sees it


class SleepParams(BaseModel):
    seconds: float


@app.task("sleep")
async def sleep(params: SleepParams) -> None:
    await asyncio.sleep(params.seconds)
