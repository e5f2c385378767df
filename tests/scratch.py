"""Scratch names on a real MongoDB (``TASKRUNNER_TEST_MONGO_URI``): dropped once a test is done.

Each test writes to a fresh collection (and its companions: ``<name>.workers``,
``<name>.schedules``, ...) so runs never see each other's documents; on the embedded server
they vanish with it, but a real server keeps them, so the fixtures drop them after use.
"""

from __future__ import annotations

import os
import re
from typing import Any
from uuid import uuid4

from pymongo import MongoClient

from taskrunner.store import fields as f

TEST_MONGO_URI = "TASKRUNNER_TEST_MONGO_URI"
STORE_DATABASE = "taskrunner_test"
"""The database of the ``store`` fixture's MongoStores (the runners use ``fields.DEFAULT_DATABASE``)."""


def new_collection(prefix: str = "t") -> str:
    """A collection name no other test or run uses."""
    return f"{prefix}_{uuid4().hex[:12]}"


def drop_collection(name: str) -> None:
    """Drop ``name`` and its companions from the real server's test databases; nothing without one."""
    uri = os.environ.get(TEST_MONGO_URI)
    if not uri:
        return
    pattern = {"name": {"$regex": f"^{re.escape(name)}(\\.|$)"}}
    with MongoClient[dict[str, Any]](uri) as client:
        for database in (f.DEFAULT_DATABASE, STORE_DATABASE):
            for found in client[database].list_collection_names(filter=pattern):
                client[database].drop_collection(found)
