"""Pure units: options, the document model, redaction and the state rules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from taskrunner import InvalidTask, MalformedTask, NewTask, Task, TaskOptions
from taskrunner.observability.redact import redact
from taskrunner.store import expressions, rules
from taskrunner.store import fields as f

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


def test_a_stored_task_holds_what_the_server_computes_with() -> None:
    """A document missing an option the server's claims read, or holding a number as a
    string, does not read as a task (a worker normalizes or marks it), naming the field."""
    doc = doc_for()
    del doc["options"]["concurrency"]
    with pytest.raises(MalformedTask, match=r"options\.concurrency: missing") as missing:
        Task.from_document(doc)
    assert missing.value.field == "options.concurrency"
    with pytest.raises(MalformedTask, match="failures: must be a number, not a string"):
        Task.from_document({**doc_for(), "failures": "2"})
    with pytest.raises(
        MalformedTask, match=r"claimable_at: a PENDING or RUNNING task needs a date here \(got None\)"
    ):
        Task.from_document({**doc_for(), "claimable_at": None})


def test_read_gives_a_malformed_document_placeholders_and_its_problem() -> None:
    """``Task.read`` never fails: the first problem names the field and value, what reads is kept."""
    task = Task.read({"key": "k", "name": "job", "params": "x", "state": 7, "priority": 4})
    assert task.unreadable is not None
    assert task.unreadable.problem == "params: Input should be a valid dictionary (got 'x')"
    assert (task.key, task.name, task.params, task.priority, task.state.value) == (
        "k",
        "job",
        {},
        4,
        "PENDING",
    )
    assert Task.read(doc_for()).unreadable is None


def test_normalization_adds_only_missing_fields() -> None:
    """Defaults fill what a hand-written document leaves out; what it gives is kept."""
    fill, problem = rules.verdict({"key": "k", "name": "job", "options": {"concurrency": 2}}, NOW)
    assert problem is None and fill["options"]["concurrency"] == 2 and fill["options"]["max_failures"] == 3
    assert (fill["params"], fill["state"], fill["claimable_at"], fill["created_at"]) == (
        {},
        "PENDING",
        NOW,
        NOW,
    )
    assert rules.verdict(doc_for(), NOW) == ({}, None)
    _, bad = rules.verdict({"key": "k", "name": "job", "options": None}, NOW)
    assert bad is not None and bad.field == "options" and "(got None)" in bad.problem


def test_redact_hides_credentials() -> None:
    """user:password@ in a MongoDB URI is replaced wherever it appears in a message."""
    text = "cannot reach mongodb://alice:pw@db:27017/x and mongodb+srv://bob@c.example.net"
    assert redact(text) == "cannot reach mongodb://***@db:27017/x and mongodb+srv://***@c.example.net"


def test_claim_drops_expired_leases_and_counts_them() -> None:
    """A claim removes other workers' expired RUNNING entries, spending one failure each."""
    doc = doc_for(ping_interval=1, ping_timeout=2)
    rules.claim(doc, "w1", "r1", NOW)
    later = NOW + timedelta(seconds=3)
    assert rules.claimable(doc, "w2", later)
    rules.claim(doc, "w2", "r2", later)
    assert [w[f.WORKER_ID] for w in doc[f.WORKERS]] == ["w2"] and doc[f.FAILURES] == 1
    assert doc[f.ATTEMPTS] == 2 and doc[f.WORKERS][0][f.ATTEMPT] == 2


def test_expired_leases_count_against_the_budget_before_claiming() -> None:
    """With max_failures=1 a task whose only run died is not run again: the next claim ends it FAIL
    and marks the dead run FAIL with a LeaseExpired error."""
    doc = doc_for(ping_interval=1, ping_timeout=2, max_failures=1)
    rules.claim(doc, "w1", "r1", NOW)
    later = NOW + timedelta(seconds=3)
    assert rules.reapable(doc, later) and rules.claimable(doc, "w2", later)
    rules.claim(doc, "w2", "r2", later)
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
    filter_fields = [k for k in expressions.claimable("w") if not k.startswith("$")]
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
