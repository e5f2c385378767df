"""Scratch collections on a real MongoDB are dropped after a test (tests/scratch.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import MongoClient
from scratch import STORE_DATABASE, TEST_MONGO_URI, drop_collection, new_collection

from taskrunner.store import fields as f

pytestmark = pytest.mark.embedded


def test_drop_collection_drops_a_tests_collection_and_its_companions_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a server URI, the test's collection and ``<name>.*`` go from both test databases; others stay."""
    from taskrunner.dev.server import ServerThread

    name, other = new_collection(), new_collection()
    # A private server: on the embedded server, a change stream opened right after a drop misses
    # its first events, which would fail the session server's later stream tests.
    with ServerThread() as server, MongoClient[dict[str, Any]](server.uri) as client:
        monkeypatch.setenv(TEST_MONGO_URI, server.uri)
        for database in (f.DEFAULT_DATABASE, STORE_DATABASE):
            for collection in (name, f"{name}.{f.REGISTRY_SUFFIX}", other, f"{name}x"):
                client[database][collection].insert_one({})
        drop_collection(name)
        for database in (f.DEFAULT_DATABASE, STORE_DATABASE):
            assert sorted(client[database].list_collection_names()) == sorted([other, f"{name}x"])
