"""Pure units: options, the document model, redaction and the state rules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from taskrunner import InvalidTask, MalformedTask, NewTask, Task, TaskOptions, rules
from taskrunner import fields as f
from taskrunner.redact import redact
from taskrunner.store import expressions

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def doc_for(**options: object) -> dict[str, Any]:
    task = NewTask.build(key="k", name="job", options=options)
    doc = {
        **rules.new_document(task, "p"),
        "created_at": NOW,
        "updated_at": NOW,
        "run_at": NOW,
        "claimable_at": NOW,
    }
    return doc


def test_option_defaults() -> None:
    """Defaults: concurrency 1, max_failures 3, ping every 5 s, lease 30 s, any worker."""
    options = TaskOptions()
    assert (options.concurrency, options.max_failures, options.ping_interval, options.ping_timeout) == (
        1,
        3,
        5,
        30,
    )
    assert options.worker_ids == []


def test_ping_timeout_must_exceed_ping_interval() -> None:
    """A lease shorter than the heartbeat would expire between pings: refused."""
    with pytest.raises(InvalidTask, match="ping_timeout"):
        NewTask.build(key="k", name="n", options={"ping_interval": 10, "ping_timeout": 10})


def test_run_at_and_delay_are_exclusive() -> None:
    """A task starts at run_at or after delay, never both."""
    with pytest.raises(InvalidTask, match="run_at or delay"):
        NewTask.build(key="k", name="n", run_at=NOW, delay=5)


def test_naive_run_at_is_utc_and_truncated_to_bson_precision() -> None:
    """Naive datetimes are taken as UTC and cut to milliseconds like BSON dates."""
    task = NewTask.build(key="k", name="n", run_at=datetime(2026, 1, 1, 12, 0, 0, 123456))
    assert task.run_at == datetime(2026, 1, 1, 12, 0, 0, 123000, tzinfo=UTC)


def test_bad_task_names_are_refused() -> None:
    """Names are identifiers (letters, digits, _ . : -), so no document can name arbitrary code."""
    for name in ("", "1abc", "a b", "$where", "x" * 201):
        with pytest.raises(InvalidTask, match="name"):
            NewTask.build(key="k", name=name)


def test_malformed_document_names_the_field() -> None:
    """Reading a document with a wrong-typed field raises MalformedTask naming it."""
    doc = {**doc_for(), "workers": "oops"}
    with pytest.raises(MalformedTask, match="workers"):
        Task.from_document(doc)


def test_redact_hides_credentials() -> None:
    """user:password@ in a MongoDB URI is replaced wherever it appears in a message."""
    text = "cannot reach mongodb://alice:pw@db:27017/x and mongodb+srv://bob@c.example.net"
    assert redact(text) == "cannot reach mongodb://***@db:27017/x and mongodb+srv://***@c.example.net"


def test_claim_drops_expired_leases_and_counts_them() -> None:
    """A claim removes other workers' expired RUNNING entries, spending one failure each."""
    doc = doc_for(ping_interval=1, ping_timeout=2)
    rules.apply_claim(doc, "w1", "r1", NOW)
    later = NOW + timedelta(seconds=3)
    assert rules.claimable_by(doc, "w2", later)
    rules.apply_claim(doc, "w2", "r2", later)
    assert [w[f.WORKER_ID] for w in doc[f.WORKERS]] == ["w2"] and doc[f.FAILURES] == 1
    assert doc[f.ATTEMPTS] == 2 and doc[f.WORKERS][0][f.ATTEMPT] == 2


def test_expired_leases_count_against_the_budget_before_claiming() -> None:
    """With max_failures=1 a task whose only run died is not run again: the next claim ends it FAIL
    and marks the dead run FAIL with a LeaseExpired error."""
    doc = doc_for(ping_interval=1, ping_timeout=2, max_failures=1)
    rules.apply_claim(doc, "w1", "r1", NOW)
    later = NOW + timedelta(seconds=3)
    assert rules.reapable(doc, later) and rules.claimable_by(doc, "w2", later)
    rules.apply_claim(doc, "w2", "r2", later)
    [dead] = doc[f.WORKERS]  # kept as the FAIL record of the run that died, with the reason
    assert (dead[f.WORKER_ID], dead[f.RUN_ID], dead[f.STATE], dead[f.FINISHED_AT]) == (
        "w1",
        "r1",
        "FAIL",
        later,
    )
    assert dead[f.ERROR][f.ERROR_TYPE] == "LeaseExpired" and doc[f.FAILURES] == 1 and doc[f.STATE] == "FAIL"
    assert doc[f.FINISHED_AT] == later and f.CLAIMABLE_AT not in doc


def test_every_filter_field_has_an_index() -> None:
    """The claim filter's indexed fields lead the claim index (the hot path)."""
    claim_keys = [k for k, _ in f.INDEXES["claim"][0]]
    filter_fields = [k for k in expressions.claim_filter("w") if not k.startswith("$")]
    assert claim_keys[:2] == filter_fields[:2] == [f.STATE, f.CLAIMABLE_AT]


def test_validator_uses_draft_4_keywords_mongodb_accepts() -> None:
    """MongoDB's $jsonSchema is draft 4: exclusiveMinimum/Maximum are booleans beside minimum/maximum."""
    from taskrunner.store.validator import json_schema

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for keyword in ("exclusiveMinimum", "exclusiveMaximum"):
                if keyword in node:
                    assert isinstance(node[keyword], bool), (keyword, node)
                    assert keyword.replace("exclusiveM", "m") in node, node
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json_schema())
