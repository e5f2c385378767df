"""The taskrunner command as a user runs it: a subprocess against a MongoDB-compatible server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pymongo import MongoClient

pytestmark = pytest.mark.mongo


def cli(*args: str, uri: str, collection: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TASKRUNNER_MONGO_URI": uri, "TASKRUNNER_COLLECTION": collection}
    return subprocess.run(
        [sys.executable, "-m", "taskrunner", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=cwd,
    )


def test_init_publish_show_round_trip(mongo_uri: str, collection_name: str) -> None:
    """init is idempotent, publish prints the key, show --json returns the stored task."""
    for _ in range(2):
        assert cli("init", uri=mongo_uri, collection=collection_name).returncode == 0
    published = cli("publish", "resize", "--params", '{"width": 3}', "--key", "img:1", "--priority", "4",
                    uri=mongo_uri, collection=collection_name)  # fmt: skip
    assert published.returncode == 0, published.stderr
    assert published.stdout.strip() == "img:1"
    # --mongo-uri beats the environment (which points nowhere here).
    shown = cli(
        "show",
        "img:1",
        "--json",
        "--mongo-uri",
        mongo_uri,
        uri="mongodb://127.0.0.1:9",
        collection=collection_name,
    )
    task = json.loads(shown.stdout)
    assert (task["key"], task["name"], task["params"], task["priority"], task["state"]) == (
        "img:1", "resize", {"width": 3}, 4, "PENDING")  # fmt: skip
    table = cli("show", "img:1", uri=mongo_uri, collection=collection_name)
    assert table.returncode == 0 and "PENDING" in table.stdout and "img:1" in table.stdout


def test_publish_twice_reports_the_existing_task(mongo_uri: str, collection_name: str) -> None:
    """Publishing an existing key prints its key, says it was not created, and exits 0."""
    for _ in range(2):
        result = cli("publish", "job", "--key", "dup", uri=mongo_uri, collection=collection_name)
    assert result.returncode == 0 and result.stdout.strip() == "dup" and "not created" in result.stderr


def test_invalid_params_name_the_field_and_write_nothing(
    mongo_uri: str, collection_name: str, tmp_path: Path
) -> None:
    """Bad JSON, non-object params and params failing the app's model exit non-zero, nothing written."""
    (tmp_path / "demo_app.py").write_text(
        "from pydantic import BaseModel\nfrom taskrunner import TaskRunner\n"
        "class P(BaseModel):\n    width: int\n"
        "runner = TaskRunner()\n@runner.task('resize')\nasync def resize(params: P, ctx): ...\n"
    )
    cases = [(["--params", "{nope"], "params"), (["--params", "[1]"], "params"),
             (["--params", '{"width": "x"}', "--app", "demo_app:runner"], "params.width"),
             (["--concurrency", "0"], "options.concurrency")]  # fmt: skip
    for args, field in cases:
        result = cli("publish", "resize", *args, uri=mongo_uri, collection=collection_name, cwd=tmp_path)
        assert result.returncode != 0 and field in result.stderr, (args, result.stderr)
    with MongoClient[dict[str, object]](mongo_uri) as client:
        assert client.taskrunner[collection_name].count_documents({}) == 0
    missing = cli("show", "anything", uri=mongo_uri, collection=collection_name)
    assert missing.returncode == 1 and "no task with key 'anything'" in missing.stderr


def test_unreachable_server_fails_fast_with_redacted_uri(collection_name: str) -> None:
    """A dead server gives a clear error within the timeout and never prints the password."""
    result = cli(
        "show", "k", "--timeout", "1", uri="mongodb://user:s3cret@127.0.0.1:9/", collection=collection_name
    )
    assert result.returncode == 1 and "MongoDB unavailable" in result.stderr
    assert "s3cret" not in result.stderr + result.stdout
