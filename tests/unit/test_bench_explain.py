"""bench/explain.py's judgement of query plans, on canned ``explain`` replies (the shapes
MongoDB 8.0 answers at ``executionStats`` verbosity): no real server runs here, the CI's
8.0 job runs the bench itself."""

from __future__ import annotations

import importlib.util
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from taskrunner.store import expressions as x

PATH = Path(__file__).resolve().parents[2] / "bench" / "explain.py"
spec = importlib.util.spec_from_file_location("bench_explain", PATH)
assert spec is not None and spec.loader is not None
explain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(explain)

Doc = dict[str, Any]
STATES = ['["PENDING", "PENDING"]', '["RUNNING", "RUNNING"]']
WHOLE = ["[MinKey, MaxKey]"]


def ixscan(index: str, bounds: dict[str, list[str]]) -> Doc:
    return {"stage": "IXSCAN", "indexName": index, "indexBounds": bounds}


def reply(plan: Doc, keys: int, docs: int, returned: int, *, sbe: bool = False) -> Doc:
    winning = {"queryPlan": plan, "slotBasedPlan": {}} if sbe else plan
    return {
        "queryPlanner": {"winningPlan": winning},
        "executionStats": {"totalKeysExamined": keys, "totalDocsExamined": docs, "nReturned": returned},
        "ok": 1.0,
    }


def fetch(child: Doc) -> Doc:
    return {"stage": "FETCH", "filter": {}, "inputStage": child}


BY_KEY = reply(fetch(ixscan("key_unique", {"key": ['["todo:0000000", "todo:0000000"]']})), 1, 1, 1)
# The unsettled branch as it was ({claimable_at: {$not: {$type: "date"}}}): the claim index
# bounded on state alone, every active key read to return nothing.
NEGATED = reply(
    fetch(ixscan("claim", {"state": STATES, "claimable_at": WHOLE, "priority": WHOLE, "created_at": WHOLE})),
    10_020,
    10_020,
    0,
)
TYPES = ["[MinKey, MinKey]", "[nan.0, inf.0]", '["", {})', "[{}, [])", "[undefined, undefined]"]
POSITIVE = reply(
    fetch(ixscan("claim", {"state": STATES, "claimable_at": TYPES, "priority": WHOLE, "created_at": WHOLE})),
    30,
    20,
    20,
    sbe=True,
)
COLLSCAN = reply({"stage": "COLLSCAN", "filter": {}, "direction": "forward"}, 0, 110_020, 20)
OR_PLAN = reply(
    {
        "stage": "SORT",
        "inputStage": fetch(
            {
                "stage": "OR",
                "inputStages": [
                    ixscan(
                        "created", {"created_at": ["[null, null]", "[undefined, undefined]"], "key": WHOLE}
                    ),
                    ixscan("created", {"created_at": TYPES, "key": WHOLE}),
                ],
            }
        ),
    },
    12,
    10,
    10,
)


def test_a_reply_reads_as_stages_keys_documents_and_intervals() -> None:
    """The winning plan's stages root first (the slot-based engine's wrapper unwrapped),
    indexes, counts, and the intervals its scans seek to (per scan, the product per field)."""
    read = explain.read_explain(POSITIVE)
    assert read["stages"] == ["FETCH", "IXSCAN"] and read["indexes"] == ["claim"] and read["ixscan"]
    assert (read["keys_examined"], read["docs_examined"], read["returned"]) == (30, 20, 20)
    assert read["intervals"] == 2 * len(TYPES)
    assert explain.read_explain(OR_PLAN)["intervals"] == 2 + len(TYPES)
    assert not explain.read_explain(COLLSCAN)["ixscan"]
    assert explain.read_explain({"ok": 1.0, "explainVersion": "1"}) == {
        "ixscan": False,
        "unsupported": ["explainVersion", "ok"],
    }


@pytest.mark.parametrize(
    ("canned", "within"),
    [(BY_KEY, True), (POSITIVE, True), (OR_PLAN, True), (NEGATED, False), (COLLSCAN, False)],
    ids=["by key", "positive types", "or of scans", "negated type", "collection scan"],
)
def test_the_ratio_allows_two_keys_per_document_and_one_per_interval(canned: Doc, within: bool) -> None:
    """A hot query keeps to 2 keys per document returned (1 at least) plus one per interval;
    a scan that reads every active key to return nothing, or no index scan at all, does not."""
    assert explain.within_ratio(explain.read_explain(canned)) is within


def test_the_report_fails_on_missing_scans_and_hot_queries_past_the_ratio_only() -> None:
    """Every plan must scan an index; only hot ones are held to the ratio."""
    plans = {
        label: explain.read_explain(r)
        for label, r in {"get": BY_KEY, "sweep": NEGATED, "list": NEGATED}.items()
    }
    assert explain.failures(plans, {"get", "sweep"}) == [
        "sweep: 10020 keys examined for 0 documents (2 intervals) through ['claim']"
    ]
    plans["purge"] = explain.read_explain(COLLSCAN)
    assert explain.failures(plans, {"get"})[0].startswith("purge: no index scan")


def test_the_bench_explains_the_stores_queries_and_holds_the_hot_ones() -> None:
    """The hot set holds the claims, their recovery, the sweep's ranges and every unsettled
    clause, the dashboard's pages (undated part too) and the parts of ``stats``; the rare
    ones are the keyless claim, candidates, the operator's listing and purge."""
    chosen, hot = explain.queries("todo:0000000", datetime(2026, 1, 1, tzinfo=UTC))
    unsettled = [body["filter"] for label, (_, body) in chosen.items() if label.startswith("sweep_unsettled")]
    assert unsettled == x.unsettled_branches()
    assert {"claim_by_key", "claim_batch", "claim_read_back", "sweep_pending", "stats_counts"} <= hot
    assert {"dashboard_created_undated", "dashboard_updated_next", "stats_recent"} <= hot
    assert set(chosen) - hot == {
        "claim_keyless",
        "candidates",
        "list_pending",
        "list_name_state",
        "list_worker",
        "purge",
    }
