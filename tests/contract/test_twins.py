"""``rules.py`` and ``store/expressions.py`` state the same rules twice: this runs both on
generated task documents and compares what they decide and write.

The Python twin runs on a deep copy of each document at a fixed ``NOW``; the MongoDB twin
is sent to a server with the same ``NOW`` as a literal date (every builder that reads the
clock takes ``now``), on the same documents in a scratch collection: filters through
``find``, update pipelines through ``update_many`` (or one bulk write) and a read back,
the sweep as its aggregate. Documents are well formed in every state, or broken the ways
hand-written ones are (missing fields, nulls, strings, numbers, arrays and objects where
dates or numbers belong, entries that are not objects, unknown states), with dates around
``NOW`` to the millisecond, so every boundary (``expires_at == now``) is hit.

Where the twins disagree, MongoDB's semantics decide (the manual's; the embedded server
imitates them) and the other twin is fixed; each such case stays below as an ``@example``.

CI runs a small, fixed set of examples (``derandomize``). Run it longer locally with
``TASKRUNNER_TWINS=long uv run pytest -n0 tests/contract/test_twins.py`` (random, 500 examples a
rule), and ``TASKRUNNER_TEST_MONGO_URI`` set to compare with a real MongoDB too.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bson import ObjectId
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pymongo import MongoClient, UpdateOne
from pymongo.collection import Collection
from scratch import STORE_DATABASE, TEST_MONGO_URI, drop_collection, new_collection

from taskrunner.models import EntryState, NewTask, TaskOptions, TaskState
from taskrunner.store import expressions as x
from taskrunner.store import fields as f
from taskrunner.store import rules
from taskrunner.store.memory import MemoryStore

pytestmark = [pytest.mark.mongo]
Doc = dict[str, Any]

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
PROFILES = {
    "ci": settings(max_examples=10, derandomize=True, deadline=None, suppress_health_check=_SLOW),
    "long": settings(max_examples=500, deadline=None, suppress_health_check=_SLOW),
}
twins = PROFILES[os.environ.get("TASKRUNNER_TWINS", "ci")]
"""A rule's test settings: ``TASKRUNNER_TWINS=long`` runs many random examples, CI a few fixed ones."""

MS = timedelta(milliseconds=1)
NOW = datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=UTC)
"""The clock both twins read (BSON dates hold milliseconds, so every date here is whole ms)."""
STEPS_MS = (-3_600_000, -1000, -1, 0, 1, 1000, 3_600_000)
WORKER_IDS = ("w1", "w2", "w3")
RUN_IDS = ("r1", "r2", "r3")
NAMES = ("job", "other")
UPSTREAMS = ("u1", "u2", "u3")

# -- generated documents -----------------------------------------------------------------------
dates = st.sampled_from(STEPS_MS).map(lambda ms: NOW + ms * MS)
odd_scalars = st.one_of(
    st.none(),
    st.sampled_from(["", "x", "PENDING", "RUNNING", "w1"]),
    st.integers(-1, 3),
    st.sampled_from([0.5, 2.0, -1.5, 1024.0]),
    st.booleans(),
    dates,
)
odd = st.one_of(
    odd_scalars,
    st.lists(odd_scalars, max_size=2),
    st.dictionaries(st.sampled_from(["a", f.CONCURRENCY]), odd_scalars, max_size=1),
)
"""A value of any type where another belongs (dates included: a date where a number belongs)."""
MISSING = object()
"""Marks a field removed from a generated document."""
broken_or_missing = st.one_of(odd, st.just(MISSING))

ENTRY_FIELDS = (f.WORKER_ID, f.RUN_ID, f.STATE, f.EXPIRES_AT, f.FINISHED_AT, f.ATTEMPT)
entries: st.SearchStrategy[Doc] = st.fixed_dictionaries(
    {
        f.WORKER_ID: st.sampled_from(WORKER_IDS),
        f.RUN_ID: st.sampled_from(RUN_IDS),
        f.STATE: st.sampled_from([s.value for s in EntryState]),
        f.CLAIMED_AT: dates,
        f.PING_AT: dates,
        f.EXPIRES_AT: dates,
        f.ATTEMPT: st.integers(1, 3),
        f.PROGRESS: st.none(),
        f.RESULT: st.none(),
        f.ERROR: st.none(),
        f.FINISHED_AT: st.one_of(st.none(), dates),
        f.TOOK_OVER: st.just([]),
    }
)
options = st.fixed_dictionaries(
    {
        f.CONCURRENCY: st.integers(1, 3),
        f.MAX_FAILURES: st.integers(1, 3),
        f.PING_TIMEOUT: st.sampled_from([0.001, 1, 30]),
        f.RETRY_BACKOFF: st.sampled_from([0, 0.001, 10]),
        f.WORKER_IDS: st.sampled_from([[], ["w1"], ["w2", "w3"]]),
    },
    optional={
        f.LOCAL_RETRIES: st.just(0),
        f.BACKOFF: st.just("fixed"),
        f.PING_INTERVAL: st.just(5.0),
        f.TIMEOUT: st.none(),
    },
)
TOP_FIELDS = (
    f.KEY,
    f.NAME,
    f.CREATED_AT,
    f.UPDATED_AT,
    f.RUN_AT,
    f.OPTIONS,
    f.WORKERS,
    f.STATE,
    f.FAILURES,
    f.ATTEMPTS,
    f.CLAIMABLE_AT,
    f.FINISHED_AT,
    f.FATAL,
    f.SNOOZES,
    f.BUCKET,
    f.ERROR,
    f.DEPENDENTS,
    f.NOTIFY,
    f.WAITING_ON,
    f.CANCELED_BY,
)
OPTION_FIELDS = tuple(
    f.opt(o) for o in (f.CONCURRENCY, f.MAX_FAILURES, f.PING_TIMEOUT, f.RETRY_BACKOFF, f.WORKER_IDS)
)


def _set(doc: Doc, path: str, value: Any) -> None:
    """Set (or, for MISSING, remove) ``path`` where its parent is an object."""
    *parents, last = path.split(".")
    target: Any = doc
    for part in parents:
        target = target.get(part) if isinstance(target, dict) else None
    if not isinstance(target, dict):
        return
    if value is MISSING:
        target.pop(last, None)
    else:
        target[last] = value


def _broken_entry(entry: Doc, changes: dict[str, Any]) -> Any:
    for field, value in changes.items():
        _set(entry, field, value)
    return entry


def _run_of(entry: Any) -> Any:
    """Run ids are unique in a document (each claim draws a uuid): entries with one tell apart by it."""
    run_id = entry.get(f.RUN_ID) if isinstance(entry, dict) else None
    return run_id if run_id in RUN_IDS else object()


broken_entries = st.one_of(
    entries,
    st.builds(
        _broken_entry, entries, st.dictionaries(st.sampled_from(ENTRY_FIELDS), broken_or_missing, max_size=2)
    ),
    odd_scalars,
)
"""Entries, some with odd values, some not objects at all."""

TASK_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    f.KEY: st.just("k"),
    f.NAME: st.sampled_from(NAMES),
    f.PRIORITY: st.integers(0, 2),
    f.CREATED_AT: dates,
    f.UPDATED_AT: dates,
    f.RUN_AT: dates,
    f.OPTIONS: options,
    f.WORKERS: st.lists(entries, max_size=3, unique_by=lambda e: str(e[f.RUN_ID])),
    f.STATE: st.sampled_from([s.value for s in TaskState]),
    f.FAILURES: st.integers(0, 3),
    f.ATTEMPTS: st.integers(0, 3),
    f.BUCKET: st.sampled_from([0, 1, 5, 1023]),
}
well_formed = st.fixed_dictionaries(
    TASK_FIELDS,
    optional={
        f.CLAIMABLE_AT: dates,
        f.FINISHED_AT: dates,
        f.FATAL: st.just(True),
        f.SNOOZES: st.integers(0, 2),
        # workflows: a dependent's upstreams, and the follow-ups a task owes
        f.AFTER: st.lists(st.sampled_from(UPSTREAMS), min_size=1, max_size=3, unique=True),
        f.WAITING_ON: st.lists(st.sampled_from(UPSTREAMS), max_size=3, unique=True),
        f.CANCELED_BY: st.lists(st.sampled_from(UPSTREAMS), max_size=2, unique=True),
        f.ON_UPSTREAM_FAILURE: st.sampled_from(["cancel", "run"]),
        f.DEPENDENTS: st.just(True),
        f.NOTIFY: st.integers(1, 3),
        f.LINK: st.integers(1, 2),
    },
)
"""Documents of the schema, in every state (entries and summary need not agree)."""


def _broken(doc: Doc, changes: dict[str, Any], workers: list[Any] | None) -> Doc:
    if workers is not None:
        doc[f.WORKERS] = workers
    for field, value in changes.items():
        _set(doc, field, value)
    return doc


broken = st.builds(
    _broken,
    well_formed,
    st.dictionaries(st.sampled_from(TOP_FIELDS + OPTION_FIELDS), broken_or_missing, min_size=1, max_size=3),
    st.one_of(st.none(), st.lists(broken_entries, min_size=1, max_size=3, unique_by=_run_of)),
)
"""Documents written by hand: up to three fields odd or missing, entries broken."""

documents = st.one_of(well_formed, broken)


def batches(of: st.SearchStrategy[Doc] = documents) -> st.SearchStrategy[list[Doc]]:
    """20-40 documents, numbered by ``_id`` so each pairs with its copy."""

    def numbered(docs: list[Doc]) -> list[Doc]:
        return [{f.ID: i, **d} for i, d in enumerate(docs)]

    return st.lists(of, min_size=20, max_size=40).map(numbered)


# -- fixed examples: documents on the edges where the two writings of a rule part most easily --
SECOND = timedelta(seconds=1)


def task(changes: dict[str, Any] | None = None, *workers: Any) -> Doc:
    """A PENDING task claimable since a second ago, with ``workers``, then ``changes`` (dotted
    paths; MISSING removes)."""
    doc: Doc = {
        f.KEY: "k",
        f.NAME: "job",
        f.PRIORITY: 0,
        f.CREATED_AT: NOW - SECOND,
        f.UPDATED_AT: NOW - SECOND,
        f.RUN_AT: NOW - SECOND,
        f.OPTIONS: {
            f.CONCURRENCY: 1,
            f.MAX_FAILURES: 3,
            f.PING_TIMEOUT: 30,
            f.RETRY_BACKOFF: 10,
            f.WORKER_IDS: [],
        },
        f.WORKERS: list(workers),
        f.STATE: "RUNNING" if workers else "PENDING",
        f.FAILURES: 0,
        f.ATTEMPTS: len(workers),
        f.CLAIMABLE_AT: NOW - SECOND,
        f.BUCKET: 1,
    }
    return _broken(doc, changes or {}, None)


def entry(changes: dict[str, Any] | None = None) -> Doc:
    """w1's RUNNING entry under run r1, live for another second, then ``changes``."""
    doc: Doc = {
        f.WORKER_ID: "w1",
        f.RUN_ID: "r1",
        f.STATE: "RUNNING",
        f.CLAIMED_AT: NOW - SECOND,
        f.PING_AT: NOW - SECOND,
        f.EXPIRES_AT: NOW + SECOND,
        f.ATTEMPT: 1,
        f.PROGRESS: None,
        f.RESULT: None,
        f.ERROR: None,
        f.FINISHED_AT: None,
        f.TOOK_OVER: [],
    }
    _broken_entry(doc, changes or {})
    return doc


def batch(*docs: Doc) -> list[Doc]:
    return [{f.ID: i, **d} for i, d in enumerate(docs)]


DEAD = {f.EXPIRES_AT: NOW - SECOND}
"""An entry whose lease expired a second ago."""
ENDED = {f.STATE: "FAIL", f.FINISHED_AT: NOW - SECOND, f.CLAIMABLE_AT: MISSING}


# -- the server side ---------------------------------------------------------------------------
class Scratch:
    """A scratch collection the generated documents are loaded into, one batch at a time."""

    def __init__(self, collection: Collection[Doc], embedded: bool) -> None:
        self.collection = collection
        self.embedded = embedded

    def load(self, docs: list[Doc]) -> None:
        self.collection.delete_many({})
        self.collection.insert_many(copy.deepcopy(docs))

    def matching(self, query: Doc) -> set[Any]:
        return {d[f.ID] for d in self.collection.find(query, {f.ID: 1})}

    def updated(self, query: Doc, update: Any, **options: Any) -> tuple[set[Any], dict[Any, Doc]]:
        """Which documents ``query`` matched (read first), and every document after the update."""
        matched = self.matching(query)
        self.collection.update_many(query, update, **options)
        return matched, self.documents()

    def documents(self) -> dict[Any, Doc]:
        return {d[f.ID]: d for d in self.collection.find()}


@pytest.fixture(scope="module", params=["embedded", "real"])
def server(request: pytest.FixtureRequest) -> Iterator[Scratch]:
    """A scratch collection on the embedded server, and on a real MongoDB when
    TASKRUNNER_TEST_MONGO_URI is set (skipped otherwise)."""
    if request.param == "real":
        uri = os.environ.get(TEST_MONGO_URI)
        if not uri:
            pytest.skip(f"real MongoDB: set {TEST_MONGO_URI} to run this on it")
    else:
        uri = request.getfixturevalue("embedded_uri")
    name = new_collection("twins")
    with MongoClient[Doc](uri, tz_aware=True) as client:
        yield Scratch(client[STORE_DATABASE][name], embedded=request.param == "embedded")
    drop_collection(name)


# -- comparing -----------------------------------------------------------------------------------
def norm(value: Any) -> Any:
    """A value as BSON tells it apart: field order ignored (updates may reorder fields), numbers
    by kind (an int and a double are different BSON), booleans apart from numbers."""
    if isinstance(value, dict):
        return ("object", sorted((k, norm(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("array", [norm(v) for v in value])
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", int(value))
    if isinstance(value, float):
        return ("double", value)
    if value is None:
        return ("null", None)
    return (type(value).__name__, value)


def assert_same(expected: dict[Any, Doc], found: dict[Any, Doc], originals: list[Doc]) -> None:
    """Every document as the Python twin left it equals the server's, whole (``_id`` included:
    both keep the generated one)."""
    wrong = [i for i in expected if norm(expected[i]) != norm(found.get(i))]
    if wrong:
        i = wrong[0]
        original = next(d for d in originals if d[f.ID] == i)
        python, server = expected[i], found.get(i) or {}
        fields = [
            k
            for k in python.keys() | server.keys()
            if norm(python.get(k, MISSING)) != norm(server.get(k, MISSING))
        ]
        differ = "\n".join(
            f"  {k}: python {python.get(k, MISSING)!r}\n  {k}: server {server.get(k, MISSING)!r}"
            for k in fields
        )
        raise AssertionError(f"{len(wrong)} documents differ; the first was\n  {original!r}\n{differ}")


def assert_same_choice(expected: set[Any], found: set[Any], docs: list[Doc], rule: str) -> None:
    if expected != found:
        by_id = {d[f.ID]: d for d in docs}
        only_py = [by_id[i] for i in expected - found]
        only_server = [by_id[i] for i in found - expected]
        raise AssertionError(f"{rule}: python only {only_py[:2]!r}\n server only {only_server[:2]!r}")


def python_twin(docs: list[Doc], apply: Callable[[Doc], bool]) -> tuple[set[Any], dict[Any, Doc]]:
    """Which documents ``apply`` changed (it says so), and every document after it, on copies."""
    copies = {d[f.ID]: copy.deepcopy(d) for d in docs}
    chosen = {i for i, d in copies.items() if apply(d)}
    return chosen, copies


IDS = st.sampled_from(WORKER_IDS)
RUNS = st.sampled_from(RUN_IDS)


# -- the rules -------------------------------------------------------------------------------------
@twins
@example(docs=batch(task({**ENDED, f.FINISHED_AT: ""})))  # restamped: not a date
@example(docs=batch(task({f.FAILURES: "x", f.OPTIONS + "." + f.MAX_FAILURES: 1})))  # counts as 0
@example(
    docs=batch(task({f.RUN_AT: MISSING}), task({f.RUN_AT: MISSING, f.STATE: "FAIL"}))
)  # claimable_at null
@given(docs=batches())
def test_summary(server: Scratch, docs: list[Doc]) -> None:
    """``rules.summarize`` writes what ``summarize`` writes, on any document."""
    server.load(docs)
    _, found = server.updated({}, x.summarize(NOW))

    def summarize(doc: Doc) -> bool:
        rules.summarize(doc, NOW)
        return True

    _, expected = python_twin(docs, summarize)
    assert_same(expected, found, docs)


@twins
@example(docs=batch(task({f.CLAIMABLE_AT: [NOW - SECOND]})), worker_id="w1")  # not a date: no claim
@example(docs=batch(task({f.WORKERS: [0, entry(DEAD)], f.STATE: "RUNNING"})), worker_id="w2")  # 0 kept
@example(  # reaped in place: the dead runs keep their order
    docs=batch(
        task(
            {f.FAILURES: 2},
            entry(DEAD),
            entry({**DEAD, f.RUN_ID: "r2", f.STATE: "SUCCESS"}),
            entry({**DEAD, f.RUN_ID: "r3"}),
        )
    ),
    worker_id="w2",
)
@example(docs=batch(task({f.ATTEMPTS: "x"}), task({f.ATTEMPTS: MISSING})), worker_id="w1")  # counts as 0
@example(
    docs=batch(task({f.STATE: ["PENDING"]}), task({f.OPTIONS + "." + f.WORKER_IDS: "w1"})), worker_id="w1"
)
@example(docs=batch(task({f.OPTIONS + "." + f.PING_TIMEOUT: "x"})), worker_id="w1")  # a lease without expiry
@given(docs=batches(), worker_id=IDS)
def test_claim(server: Scratch, docs: list[Doc], worker_id: str) -> None:
    """``rules.claimable`` chooses what ``claimable`` matches and ``rules.claim``
    writes what ``claim`` writes (reaping included)."""
    server.load(docs)
    matched, found = server.updated(x.claimable(worker_id, NOW), x.claim(worker_id, "run", NOW))

    def claim(doc: Doc) -> bool:
        if not rules.claimable(doc, worker_id, NOW):
            return False
        rules.claim(doc, worker_id, "run", NOW)
        return True

    chosen, expected = python_twin(docs, claim)
    assert_same_choice(chosen, matched, docs, "claim")
    assert_same(expected, found, docs)


@twins
@example(docs=batch(task({f.FATAL: True})), worker_id="w1")  # left to the general claim, which ends it FAIL
@given(docs=batches(), worker_id=IDS)
def test_fresh_claim(server: Scratch, docs: list[Doc], worker_id: str) -> None:
    """``fresh_claimable`` matches what ``rules.fresh`` and ``rules.claimable`` allow, and
    ``fresh_claim`` writes what ``rules.claim`` writes."""
    server.load(docs)
    query, update = x.fresh_claimable(worker_id, NOW), x.fresh_claim(worker_id, "run", NOW)
    matched, found = server.updated(query, update)

    def claim(doc: Doc) -> bool:
        if not rules.fresh_claimable(doc, worker_id, NOW):
            return False
        rules.claim(doc, worker_id, "run", NOW)
        return True

    chosen, expected = python_twin(docs, claim)
    assert_same_choice(chosen, matched, docs, "fresh claim")
    assert_same(expected, found, docs)


@twins
@given(docs=batches())
def test_reapable(server: Scratch, docs: list[Doc]) -> None:
    """``rules.reapable`` is ``expressions.reapable`` over the live and expired leases."""
    server.load(docs)
    counts = {"live": x.count(x.is_live(NOW)), "expired": x.count(x.is_expired(NOW))}
    reap = {"$let": {"vars": counts, "in": x.reapable("$$live", "$$expired")}}
    found = server.matching({"$expr": {"$and": [*x.numeric(), reap]}})
    chosen = {d[f.ID] for d in docs if rules.reapable(d, NOW)}
    assert_same_choice(chosen, found, docs, "reapable")


@twins
@example(
    docs=batch(task({}, entry()), task({f.STATE: ["CANCELED"]}, entry())),
    worker_id="w1",
    run_id="r1",
    progress=None,
)
@example(
    docs=batch(task({f.OPTIONS + "." + f.PING_TIMEOUT: "x"}, entry())),
    worker_id="w1",
    run_id="r1",
    progress=0.5,
)
@example(
    docs=batch(task({}, entry({f.STATE: ["RUNNING"]}))), worker_id="w1", run_id="r1", progress=None
)  # $elemMatch
@given(docs=batches(), worker_id=IDS, run_id=RUNS, progress=st.sampled_from([None, 0.5, {"done": 3}]))
def test_renewal(server: Scratch, docs: list[Doc], worker_id: str, run_id: str, progress: Any) -> None:
    """``renewable`` matches where ``rules.renewal_status`` is DONE, and ``ping``
    writes what ``rules.ping`` writes."""
    server.load(docs)
    query = x.renewable("k", run_id, worker_id)
    matched, found = server.updated(query, x.ping(run_id, progress, NOW))

    def ping(doc: Doc) -> bool:
        if doc.get(f.KEY) != "k" or not rules.renewable(doc, run_id, worker_id):
            return False
        entry = rules.running_entry(doc, run_id)
        assert entry is not None
        rules.ping(doc, entry, NOW, progress)
        return True

    chosen, expected = python_twin(docs, ping)
    assert_same_choice(chosen, matched, docs, "renewal")
    assert_same(expected, found, docs)


def _run_write(apply: Callable[[Doc, Doc], None], run_id: str) -> Callable[[Doc], bool]:
    """The Python twin of a fenced write on the task of key "k": ``apply`` to the run's RUNNING
    entry, if there is one."""

    def write(doc: Doc) -> bool:
        entry = rules.running_entry(doc, run_id) if doc.get(f.KEY) == "k" else None
        if entry is None:
            return False
        apply(doc, entry)
        return True

    return write


RESULTS = st.sampled_from([None, 7, {"rows": [1, None]}])
LAST_PROGRESS = st.sampled_from([None, {"fraction": 1.0, "message": "step 32"}])
"""An outcome's last progress: none reported (the entry keeps its own), or one."""


@twins
@example(docs=batch(task({}, entry({f.PROGRESS: {"fraction": 0.5}}))), run_id="r1", result=7, progress=None)
@given(docs=batches(), run_id=RUNS, result=RESULTS, progress=LAST_PROGRESS)
def test_success(server: Scratch, docs: list[Doc], run_id: str, result: Any, progress: Any) -> None:
    """``succeed`` under ``running_entry`` writes what ``rules.succeed`` writes, the run's
    last progress included."""
    server.load(docs)
    update = x.succeed(run_id, result, NOW, progress)
    matched, found = server.updated(x.running_entry("k", run_id), update)
    succeed = _run_write(lambda d, e: rules.succeed(d, e, result, NOW, copy.deepcopy(progress)), run_id)
    chosen, expected = python_twin(docs, succeed)
    assert_same_choice(chosen, matched, docs, "success")
    assert_same(expected, found, docs)


@twins
@example(
    docs=batch(task({f.FATAL: True}, entry()), task({f.FINISHED_AT: NOW - SECOND}, entry())),
    run_id="r1",
    result=7,
    progress=None,
)
@example(docs=batch(task({}, entry())), run_id="r1", result=7, progress={"fraction": 1.0, "message": "done"})
@given(docs=batches(), run_id=RUNS, result=RESULTS, progress=LAST_PROGRESS)
def test_quick_success(server: Scratch, docs: list[Doc], run_id: str, result: Any, progress: Any) -> None:
    """Where ``quick_succeed`` matches, it writes what ``rules.succeed`` writes, the run's
    last progress included, and it matches only documents the pipeline's fence matches."""
    server.load(docs)
    query, update, array_filters = x.quick_succeed("k", run_id, result, NOW, progress)
    matched, found = server.updated(query, update, array_filters=array_filters)
    succeed = _run_write(lambda d, e: rules.succeed(d, e, result, NOW, copy.deepcopy(progress)), run_id)
    chosen, expected = python_twin(docs, succeed)
    assert matched <= chosen
    unchanged = {d[f.ID]: d for d in docs if d[f.ID] not in matched}
    assert_same({i: expected[i] for i in matched} | unchanged, found, docs)


ERROR = {f.ERROR_TYPE: "ValueError", f.ERROR_MESSAGE: "no", f.ERROR_TRACEBACK: None}


@twins
@example(
    docs=batch(task({f.OPTIONS + "." + f.RETRY_BACKOFF: "x"}, entry()), task({f.FAILURES: None}, entry())),
    run_id="r1",
    retry_in=None,
    final=False,
    progress={"fraction": 1.0, "message": "done"},
)
@given(
    docs=batches(),
    run_id=RUNS,
    retry_in=st.sampled_from([None, 0, 0.001, 5]),
    final=st.booleans(),
    progress=LAST_PROGRESS,
)
def test_failure(
    server: Scratch, docs: list[Doc], run_id: str, retry_in: float | None, final: bool, progress: Any
) -> None:
    """``fail`` under ``running_entry`` writes what ``rules.fail`` writes, final or not, the
    run's last progress included."""
    server.load(docs)
    update = x.fail(run_id, ERROR, retry_in, final, NOW, progress)
    matched, found = server.updated(x.running_entry("k", run_id), update)

    def fail(doc: Doc, entry: Doc) -> None:
        rules.fail(doc, entry, dict(ERROR), NOW, retry_in, final, copy.deepcopy(progress))

    chosen, expected = python_twin(docs, _run_write(fail, run_id))
    assert_same_choice(chosen, matched, docs, "failure")
    assert_same(expected, found, docs)


@twins
@example(
    docs=batch(task({f.SNOOZES: 1.5, f.WORKERS: [1, entry(), "w1"]})), run_id="r1", seconds=30
)  # 1 and "w1" kept
@given(docs=batches(), run_id=RUNS, seconds=st.sampled_from([0, 0.001, 30]))
def test_snooze(server: Scratch, docs: list[Doc], run_id: str, seconds: float) -> None:
    """``snooze`` under ``running_entry`` writes what ``rules.snooze`` writes."""
    server.load(docs)
    matched, found = server.updated(x.running_entry("k", run_id), x.snooze(run_id, seconds, NOW))
    chosen, expected = python_twin(docs, _run_write(lambda d, e: rules.snooze(d, e, NOW, seconds), run_id))
    assert_same_choice(chosen, matched, docs, "snooze")
    assert_same(expected, found, docs)


@twins
@example(docs=batch(task({f.WORKERS: [1, entry(), "w1"]})), run_id="r1")  # 1 and "w1" kept
@given(docs=batches(), run_id=RUNS)
def test_release(server: Scratch, docs: list[Doc], run_id: str) -> None:
    """``release`` under ``running_entry`` writes what ``rules.release`` writes."""
    server.load(docs)
    matched, found = server.updated(x.running_entry("k", run_id), x.release(run_id, NOW))
    chosen, expected = python_twin(docs, _run_write(lambda d, e: rules.release(d, e, NOW), run_id))
    assert_same_choice(chosen, matched, docs, "release")
    assert_same(expected, found, docs)


@twins
@example(
    docs=batch(task(ENDED), task({**ENDED, f.STATE: "SUCCESS", f.WORKERS: [entry()]}))
)  # left as they are
@given(docs=batches())
def test_cancel(server: Scratch, docs: list[Doc]) -> None:
    """``cancel`` writes what ``rules.cancel`` writes (a finished task unchanged)."""
    server.load(docs)
    _, found = server.updated(x.cancelable("k"), x.cancel(NOW))

    def cancel(doc: Doc) -> bool:
        if doc.get(f.KEY) == "k":
            rules.cancel(doc, NOW)
        return True

    _, expected = python_twin(docs, cancel)
    assert_same(expected, found, docs)


def new_task(**named: Any) -> NewTask:
    """The task of key "k" a publish call naming only ``named`` gives (what it updates)."""
    return NewTask.build(key="k", name="job", **named)


named_options = st.fixed_dictionaries(
    {},
    optional={
        f.CONCURRENCY: st.integers(1, 2),
        f.MAX_FAILURES: st.integers(1, 3),
        f.PING_TIMEOUT: st.just(60.0),
        f.RETRY_BACKOFF: st.just(5.0),
    },
)
new_tasks = st.builds(
    lambda params, priority, options, start: new_task(**params, **priority, **options, **start),
    st.sampled_from([{}, {f.PARAMS: {"n": 1}}]),
    st.sampled_from([{}, {f.PRIORITY: 1}]),
    st.one_of(st.just({}), named_options.map(lambda o: {f.OPTIONS: o})),
    st.one_of(
        st.just({}), dates.map(lambda d: {f.RUN_AT: d}), st.sampled_from([0, 1.5]).map(lambda s: {"delay": s})
    ),
)
"""Publish calls naming any part of a task: params, priority, some options, a run time."""


@twins
@example(  # a finished task left as it is; a PENDING one loses a stale finished_at; a bare key is written over
    docs=batch(task({**ENDED, f.CLAIMABLE_AT: NOW}), task({f.FINISHED_AT: NOW - SECOND}), {f.KEY: "k"}),
    task=new_task(),
    republish_finished=False,
)
@example(  # only the priority: a delayed task keeps its run time, params and options
    docs=batch(task({f.RUN_AT: NOW + 3600 * SECOND, f.CLAIMABLE_AT: NOW + 3600 * SECOND})),
    task=new_task(priority=7),
    republish_finished=False,
)
@example(  # options merge into the stored ones, the ping pair together; options that are not
    # an object are replaced whole; a max_failures at the failures spent ends the task FAIL
    docs=batch(task({f.FAILURES: 2}), task({f.OPTIONS: "x"}), task({f.OPTIONS: MISSING})),
    task=new_task(options={f.MAX_FAILURES: 2, f.PING_TIMEOUT: 60.0}),
    republish_finished=False,
)
@given(docs=batches(), task=new_tasks, republish_finished=st.booleans())
def test_publish_update(server: Scratch, docs: list[Doc], task: NewTask, republish_finished: bool) -> None:
    """On an existing task, ``publish`` writes what the memory store's publish writes:
    ``rules.pending_update`` of what the call named where ``rules.updatable``, a fresh
    document where finished and republished, else nothing."""
    server.load(docs)
    new = {f.ID: ObjectId(), **rules.new_document(task, "p")}
    run_at = x.start_time(task.run_at, task.delay, NOW)
    changes = rules.pending_changes(task)
    update = x.publish(new, run_at, update=changes, republish_finished=republish_finished, now=NOW)
    _, found = server.updated({f.KEY: "k"}, update)

    def publish(doc: Doc) -> bool:
        if doc.get(f.KEY) != "k":
            return False
        if rules.is_seed(doc) or (republish_finished and doc.get(f.STATE) in rules.FINISHED):
            fresh = MemoryStore._fresh(task, "p", NOW, doc)
            doc.clear()
            doc.update(fresh)
        elif rules.updatable(doc):
            rules.pending_update(doc, task, NOW)
        return True

    _, expected = python_twin(docs, publish)
    assert_same(expected, found, docs)


def test_an_update_names_what_its_call_named() -> None:
    """``pending_changes`` holds exactly what the publish call named: nothing for a bare
    key, the priority alone, the run time for ``delay=0``, and both ping options for one."""
    assert rules.pending_changes(new_task()) == rules.PendingChanges(
        {}, {}, TaskOptions().model_dump(), run_time=False
    )
    assert rules.pending_changes(new_task(priority=7)).fields == {f.PRIORITY: 7}
    assert rules.pending_changes(new_task(delay=0)).run_time
    pinged = rules.pending_changes(new_task(options={f.PING_TIMEOUT: 60.0}))
    assert pinged.options == {f.PING_INTERVAL: 5.0, f.PING_TIMEOUT: 60.0} and not pinged.fields


HORIZONS = st.sampled_from(STEPS_MS).map(lambda ms: NOW + ms * MS)


@twins
@example(  # the query language: an array holding a date or a name, a string worker_ids
    docs=batch(
        task({f.CLAIMABLE_AT: [NOW - SECOND]}),
        task({f.NAME: ["job"], f.STATE: ["PENDING"]}),
        task({f.OPTIONS + "." + f.WORKER_IDS: "w1"}),
        task({}, entry({f.EXPIRES_AT: [NOW + SECOND]})),
    ),
    worker_id="w1",
    names=["job"],
    horizon=NOW,
)
@given(docs=batches(), worker_id=IDS, names=st.sampled_from([["job"], ["job", "other"]]), horizon=HORIZONS)
def test_sweep(server: Scratch, docs: list[Doc], worker_id: str, names: list[str], horizon: datetime) -> None:
    """``expressions.sweepable`` matches what ``rules.sweepable`` allows, state by state;
    ``unsettled`` what ``rules.unsettled`` does; and the sweep's aggregate returns both."""
    server.load(docs)
    due = [d for d in docs if rules.sweepable(d, worker_id, names, horizon)]
    by_state = {s: [d[f.ID] for d in due if rules.is_one_of(d.get(f.STATE), (s,))] for s in rules.ACTIVE}
    for state in rules.ACTIVE:
        found = server.matching(x.sweepable(worker_id, names, horizon, state))
        assert_same_choice(set(by_state[state]), found, docs, f"sweep of {state}")
    unsettled = [d[f.ID] for d in docs if rules.unsettled(d)]
    assert_same_choice(set(unsettled), server.matching(x.unsettled()), docs, "unsettled")
    # The aggregate: RUNNING, PENDING by group of names, unsettled (a document in several, in each).
    apart = names[1:]
    pipeline = x.due_pipeline(server.collection.name, worker_id, names, horizon, 1000, apart=apart)
    swept = Counter(d[f.ID] for d in server.collection.aggregate(pipeline))
    pending = set(by_state[TaskState.PENDING.value])
    grouped = [
        d[f.ID]
        for g in rules.sweep_groups(names, apart)
        for d in due
        if d[f.ID] in pending and rules.is_one_of(d.get(f.NAME), g)
    ]
    assert swept == Counter(by_state[TaskState.RUNNING.value] + grouped + unsettled)


def _event(kind: str, doc: Doc, changed: Doc) -> Doc:
    """A change event as a worker's stream sees it (without post-image lookups)."""
    event: Doc = {f.OPERATION_TYPE: kind}
    if kind in ("insert", "replace"):
        event[f.FULL_DOCUMENT] = doc
    elif kind == "update":
        event[f.UPDATE_DESCRIPTION] = {f.UPDATED_FIELDS: changed, "removedFields": []}
    return event


changes = st.dictionaries(
    st.sampled_from([f.STATE, f.RUN_AT, f.CLAIMABLE_AT, f.UPDATED_AT, f.WORKERS, f.FAILURES]),
    st.one_of(st.sampled_from([s.value for s in TaskState]), dates, odd),
    max_size=3,
)
events = st.builds(_event, st.sampled_from(["insert", "replace", "update", "delete"]), documents, changes)
OWNED = st.sampled_from([None, {}, {"job": [1, 5]}, {"job": [0], "other": [1023, 1]}])


@twins
@example(
    events=batch(
        _event("update", {}, {f.STATE: [False, "PENDING"]}),
        _event("insert", task({f.NAME: ["job"], f.BUCKET: [0.5]}), {}),
        _event("insert", task({f.NAME: ["x"]}), {}),
    ),
    names=["job"],
    owned={"job": [1]},
)
@given(events=batches(events), names=st.sampled_from([["job"], ["job", "other"]]), owned=OWNED)
def test_stream(
    server: Scratch, events: list[Doc], names: list[str], owned: dict[str, list[int]] | None
) -> None:
    """``expressions.hears`` matches the events ``rules.hears`` lets through (inserts and
    replacements it ``hears_insert``, updates that ``wakes``), run with ``find`` on
    event-shaped documents."""
    server.load(events)
    found = server.matching(x.hears(names, owned))
    heard = {e[f.ID] for e in events if rules.hears(e, names, owned)}
    assert_same_choice(heard, found, events, "stream")


@twins
@given(docs=batches(st.one_of(documents, documents.map(lambda d: _broken(d, {f.STATE: "?"}, None)))))
def test_normalization(server: Scratch, docs: list[Doc]) -> None:
    """What ``MongoStore.normalize`` sends (``normalize``, ``mark`` under
    ``unchanged``) writes what ``rules.normalize`` writes."""
    server.load(docs)
    ops = []
    for doc in docs:
        fill, problem = rules.verdict(doc, NOW)
        if not (fill or problem) or (problem and rules.is_marked(doc)):
            continue
        update = x.normalize(fill, NOW) if fill else []
        guard: Doc = {f.ID: doc[f.ID]}
        if problem is not None:
            update += x.mark(problem.problem, NOW)
            guard |= x.unchanged(doc, sorted({f.STATE, problem.field.split(".")[0]} - {""}))
        ops.append(UpdateOne(guard, update))
    if ops:
        server.collection.bulk_write(ops)
    found = server.documents()

    def normalize(doc: Doc) -> bool:
        fill, problem = rules.verdict(doc, NOW)
        if (fill or problem) and not (problem and rules.is_marked(doc)):
            rules.normalize(doc, fill, problem, NOW)
        return True

    _, expected = python_twin(docs, normalize)
    assert_same(expected, found, docs)


FAILED = {f.STATE: "FAIL", f.FINISHED_AT: NOW - SECOND}
"""A run that failed a second ago."""


@twins
@example(docs=batch(task({f.STATE: "FAIL", f.ERROR: {}, f.FINISHED_AT: NOW}), task({f.STATE: ["FAIL"]})))
@example(docs=batch(task({**FAILED, f.WORKERS: MISSING})))  # no workers field: it stays missing
@example(
    docs=batch(
        task(
            {**ENDED, f.opt(f.MAX_FAILURES): 2, f.opt(f.CONCURRENCY): 1},
            entry({**FAILED, f.RUN_ID: "r1"}),
            "not an entry",
            entry({**FAILED, f.RUN_ID: "r2"}),
            entry({f.STATE: "SUCCESS", f.RUN_ID: "r3"}),
            entry({**FAILED, f.RUN_ID: "r4"}),
            entry({f.STATE: ["FAIL"], f.RUN_ID: "r5"}),
        ),
        task({**ENDED, f.opt(f.MAX_FAILURES): 1.5}, entry(FAILED), entry({**FAILED, f.RUN_ID: "r2"})),
        task({**ENDED, f.opt(f.MAX_FAILURES): "1"}, entry(FAILED), entry({**FAILED, f.RUN_ID: "r2"})),
    )
)
@given(docs=batches())
def test_retry(server: Scratch, docs: list[Doc]) -> None:
    """``retryable`` matches FAIL or CANCELED tasks ``rules.still_running`` finds no live run
    in, and ``retry`` writes what ``rules.retry`` writes (keeping the last
    ``max_failures + concurrency - 1`` FAIL entries)."""
    server.load(docs)
    matched, found = server.updated(x.retryable("k", NOW), x.retry(NOW))

    def retry(doc: Doc) -> bool:
        if doc.get(f.KEY) != "k" or not rules.retryable(doc, NOW):
            return False
        rules.retry(doc, NOW)
        return True

    chosen, expected = python_twin(docs, retry)
    assert_same_choice(chosen, matched, docs, "retry")
    assert_same(expected, found, docs)


@twins
@example(docs=batch(task({**ENDED, f.FINISHED_AT: [NOW - SECOND]})), states=["FAIL"], older_than=0)
@given(
    docs=batches(),
    states=st.sampled_from([["SUCCESS"], ["FAIL", "CANCELED"], ["SUCCESS", "FAIL", "CANCELED"]]),
    older_than=st.sampled_from([0, 0.001, 1]),
)
def test_purge(server: Scratch, docs: list[Doc], states: list[str], older_than: float) -> None:
    """``purgeable`` matches what ``rules.purgeable`` allows at the same cutoff."""
    server.load(docs)
    found = server.matching(x.purgeable(states, older_than * 1000, NOW))
    cutoff = NOW - timedelta(seconds=older_than)
    assert_same_choice({d[f.ID] for d in docs if rules.purgeable(d, states, cutoff)}, found, docs, "purge")


@twins
@example(values=[[0.5], [-1, 2000], [2000], True, 1023.5, "1"])
@given(
    values=st.lists(
        st.one_of(st.integers(-2, 1025), st.sampled_from([0.5, 1023.5, 1024.0]), odd),
        min_size=20,
        max_size=40,
    )
)
def test_bucket_range(server: Scratch, values: list[Any]) -> None:
    """``rules.in_bucket_range`` judges a bucket as ``{$gte: 0, $lt: BUCKETS}`` does."""
    docs = [{f.ID: i, f.BUCKET: v} for i, v in enumerate(values)]
    server.load(docs)
    found = server.matching({f.BUCKET: x.in_bucket_range()})
    assert_same_choice(
        {d[f.ID] for d in docs if rules.in_bucket_range(d[f.BUCKET])}, found, docs, "bucket range"
    )


def test_a_computed_field_whose_branch_is_missing_is_not_set(server: Scratch) -> None:
    """The server semantics the twins rely on: ``$set`` of a ``$cond``, ``$switch`` or
    ``$ifNull`` whose branch taken is a missing field sets nothing (rules.py then leaves the
    field absent too, as ``$$REMOVE`` would), and a branch that has a value sets it."""
    server.load(batch({"present": 5}))
    pipeline = [
        {
            "$set": {
                "cond": {"$cond": [False, 1, "$absent"]},
                "cond_object": {"$cond": {"if": "$absent", "then": 1, "else": "$absent"}},
                "switch": {"$switch": {"branches": [{"case": True, "then": "$absent"}], "default": 1}},
                "default": {"$switch": {"branches": [{"case": False, "then": 1}], "default": "$absent"}},
                "kept": {"$cond": [True, "$present", "$absent"]},
                "nested": {"$cond": [True, {"$cond": [True, "$absent", 1]}, 2]},
                "if_null": {"$ifNull": ["$absent", "$absent_too"]},
                "if_null_set": {"$ifNull": ["$absent", "$present"]},
            }
        }
    ]
    _, found = server.updated({}, pipeline)
    assert {k: v for k, v in found[0].items() if k != f.ID} == {"present": 5, "kept": 5, "if_null_set": 5}


heard_states = st.dictionaries(
    st.sampled_from(UPSTREAMS), st.sampled_from([s.value for s in TaskState]), min_size=1, max_size=3
)
"""Upstream states as a read found them."""


@twins
@example(  # a success releases; a failure cancels (and announces); "run" runs after a failure;
    # a retried upstream re-arms what it canceled
    docs=batch(
        task({f.STATE: "WAITING", f.AFTER: ["u1"], f.WAITING_ON: ["u1"], f.CLAIMABLE_AT: MISSING}),
        task({f.STATE: "WAITING", f.AFTER: ["u2"], f.WAITING_ON: ["u2"], f.DEPENDENTS: True}),
        task({f.STATE: "WAITING", f.AFTER: ["u2"], f.WAITING_ON: ["u2"], f.ON_UPSTREAM_FAILURE: "run"}),
        task(
            {**ENDED, f.STATE: "CANCELED", f.AFTER: ["u3", "u1"], f.WAITING_ON: ["u3"], f.CANCELED_BY: ["u3"]}
        ),
        task({f.STATE: "WAITING", f.AFTER: [1, "u2"], f.WAITING_ON: [1, "u2", "u2"]}),
    ),
    states={"u1": "SUCCESS", "u2": "FAIL", "u3": "RUNNING"},
)
@given(docs=batches(), states=heard_states)
def test_settle(server: Scratch, docs: list[Doc], states: dict[str, str]) -> None:
    """``settleable`` matches what ``rules.settleable`` takes, and ``settle`` writes what
    ``rules.settle`` writes, for any upstream states heard."""
    server.load(docs)
    heard = rules.Heard(states)
    matched, found = server.updated(x.settleable(heard.keys), x.settle(heard, NOW))

    def settle(doc: Doc) -> bool:
        if not rules.settleable(doc, heard.keys):
            return False
        rules.settle(doc, heard, NOW)
        return True

    chosen, expected = python_twin(docs, settle)
    assert_same_choice(chosen, matched, docs, "settle")
    assert_same(expected, found, docs)


@twins
@example(  # a broken counter restarts at 1; one marked and running is left alone
    docs=batch(task({**ENDED, f.NOTIFY: "x"}), task({f.DEPENDENTS: False}), task({f.DEPENDENTS: [True]}))
)
@given(docs=batches())
def test_mark_upstream(server: Scratch, docs: list[Doc]) -> None:
    """``markable`` matches what ``rules.markable`` takes, and ``mark_upstream`` writes what
    ``rules.mark_upstream`` writes."""
    server.load(docs)
    matched, found = server.updated(x.markable(["k"]), x.mark_upstream())

    def mark(doc: Doc) -> bool:
        if not rules.markable(doc, ["k"]):
            return False
        rules.mark_upstream(doc)
        return True

    chosen, expected = python_twin(docs, mark)
    assert_same_choice(chosen, matched, docs, "mark")
    assert_same(expected, found, docs)


@twins
@example(
    docs=batch(
        task({f.FLOW: "f", f.STATE: "WAITING", f.CLAIMABLE_AT: MISSING, f.DEPENDENTS: True}),
        task({f.FLOW: "f"}, entry()),  # started: runs on
        task({f.FLOW: "f", f.COMPENSATES: "s"}),  # a compensation: runs on
        task({f.FLOW: ["f"], f.CANCELED_BY: ["u1"], f.STATE: "WAITING"}),
    )
)
@given(docs=batches(st.one_of(documents, documents.map(lambda d: {**d, f.FLOW: "f"}))))
def test_stop(server: Scratch, docs: list[Doc]) -> None:
    """``stoppable`` matches what ``rules.stoppable`` takes, and ``stop`` writes what
    ``rules.stop`` writes."""
    server.load(docs)
    error = rules.flow_error("f", "s")
    matched, found = server.updated(x.stoppable("f"), x.stop(error, NOW))

    def stop(doc: Doc) -> bool:
        if not rules.stoppable(doc, "f"):
            return False
        rules.stop(doc, error, NOW)
        return True

    chosen, expected = python_twin(docs, stop)
    assert_same_choice(chosen, matched, docs, "stop")
    assert_same(expected, found, docs)
