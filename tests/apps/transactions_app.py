"""The app of the transaction process tests (tests/faults/test_transaction_processes.py):
``confirm`` reads the order its task was published with, as a handler that sends the
confirmation mail would, and records each run in the application's database."""

from __future__ import annotations

import os
from typing import Any

from pymongo import AsyncMongoClient

from taskrunner import TaskContext, TaskRunner

APP_DB = "txn_app"
runner = TaskRunner()


@runner.task()
async def confirm(params: dict[str, str], ctx: TaskContext) -> dict[str, Any]:
    """The order as this run reads it (None if it does not exist), recorded under ``runs``."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(os.environ["TASKRUNNER_MONGO_URI"])
    try:
        app = client[APP_DB]
        order = await app[params["orders"]].find_one({"_id": params["order"]})
        await app[params["orders"] + "_runs"].insert_one({"key": ctx.key, "order": order})
        return {"order": order}
    finally:
        await client.close()
