"""The document-size tests' app: handlers whose results (or documents) approach 16 MiB.

``TASKRUNNER_MONGO_URI`` and ``TASKRUNNER_COLLECTION`` (set for worker processes) name the
collection ``crowded`` writes to, as another writer would.
"""

from __future__ import annotations

import os
from typing import Any

from pymongo import MongoClient

from apps.acceptance_app import mark
from taskrunner import TaskContext, TaskRunner

MAX_DOCUMENT_BYTES = 16 * 1024 * 1024  # MongoDB's limit

runner = TaskRunner()
__all__ = ["runner"]


@runner.task("sized", max_failures=1)
async def sized(params: dict[str, Any], ctx: TaskContext) -> str:
    """Return a string of ``params["result_bytes"]`` characters."""
    mark("start", ctx)
    return "r" * int(params["result_bytes"])


@runner.task("crowded", max_failures=1)
def crowded(params: dict[str, Any], ctx: TaskContext) -> str:
    """Fill the task's own document to within ``params["room"]`` bytes of 16 MiB, as a writer
    other than taskrunner could, then return a result of ``params["result_bytes"]``: within
    what the task's budget allows, but no longer within what its document has room for."""
    mark("start", ctx)
    uri, collection = os.environ["TASKRUNNER_MONGO_URI"], os.environ["TASKRUNNER_COLLECTION"]
    with MongoClient[dict[str, Any]](uri) as client:
        tasks = client.taskrunner[collection]
        [size] = tasks.aggregate([{"$match": {"key": ctx.key}}, {"$project": {"n": {"$bsonSize": "$$ROOT"}}}])
        filler = MAX_DOCUMENT_BYTES - int(params["room"]) - size["n"] - len("\0filler\0") - 5
        tasks.update_one({"key": ctx.key}, {"$set": {"filler": "f" * filler}})
    return "r" * int(params["result_bytes"])
