"""The optional ``$jsonSchema`` validator ``taskrunner init --validator`` installs."""

from __future__ import annotations

from typing import Any

from taskrunner.models import EntryState, TaskState
from taskrunner.store import fields as f


def _entry_schema() -> dict[str, Any]:
    return {
        "bsonType": "object",
        "required": [f.WORKER_ID, f.RUN_ID, f.STATE, f.CLAIMED_AT, f.EXPIRES_AT],
        "properties": {
            f.WORKER_ID: {"bsonType": "string"},
            f.RUN_ID: {"bsonType": "string"},
            f.STATE: {"enum": [s.value for s in EntryState]},
            f.CLAIMED_AT: {"bsonType": "date"},
            f.PING_AT: {"bsonType": "date"},
            f.EXPIRES_AT: {"bsonType": "date"},
        },
    }


def json_schema() -> dict[str, Any]:
    """Required fields and their BSON types; extra fields stay allowed."""
    number = {"bsonType": ["int", "long", "double"]}
    return {
        "$jsonSchema": {
            "bsonType": "object",
            "required": [
                f.KEY,
                f.NAME,
                f.PARAMS,
                f.PRIORITY,
                f.CREATED_AT,
                f.RUN_AT,
                f.OPTIONS,
                f.WORKERS,
                f.STATE,
                f.FAILURES,
            ],
            "properties": {
                f.KEY: {"bsonType": "string", "minLength": 1},
                f.NAME: {"bsonType": "string", "minLength": 1},
                f.PARAMS: {"bsonType": "object"},
                f.PRIORITY: {"bsonType": ["int", "long"]},
                f.CREATED_AT: {"bsonType": "date"},
                f.RUN_AT: {"bsonType": "date"},
                f.CLAIMABLE_AT: {"bsonType": "date"},
                f.STATE: {"enum": [s.value for s in TaskState]},
                f.FAILURES: {"bsonType": ["int", "long"], "minimum": 0},
                f.WORKERS: {"bsonType": "array", "items": _entry_schema()},
                f.OPTIONS: {
                    "bsonType": "object",
                    "required": [f.CONCURRENCY, f.MAX_FAILURES, f.PING_INTERVAL, f.PING_TIMEOUT],
                    "properties": {
                        f.CONCURRENCY: {**number, "minimum": 1},
                        f.MAX_FAILURES: {**number, "minimum": 1},
                        f.PING_INTERVAL: {**number, "minimum": 0, "exclusiveMinimum": True},
                        f.PING_TIMEOUT: {**number, "minimum": 0, "exclusiveMinimum": True},
                        f.WORKER_IDS: {"bsonType": "array", "items": {"bsonType": "string"}},
                        f.TIMEOUT: {
                            "bsonType": ["int", "long", "double", "null"],
                            "minimum": 0,
                            "exclusiveMinimum": True,
                        },
                    },
                },
            },
        }
    }
