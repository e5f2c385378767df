"""The gate arithmetic (taskrunner.gates): exact sliding windows and running caps, with
workers that claim late, never, or die holding permits."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from taskrunner.errors import InvalidTask
from taskrunner.gates import (
    EARLY,
    HOLD,
    SLACK,
    Change,
    GateDoc,
    Grant,
    Limit,
    Rate,
    Settlement,
    gate_id,
    grant,
    parse_rate,
    settle,
)

T0 = datetime(2026, 11, 24, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def fresh(name: str = "call_api") -> GateDoc:
    doc, problem = GateDoc.read(None, name, name)
    assert problem is None
    return doc


def ask(
    gate: GateDoc, limit: Limit, want: int, worker: str, now: datetime, owed: Settlement | None = None
) -> Grant:
    """One worker's write, applied to ``gate`` as the store would (it is the only writer)."""
    change = Change(gate, gate)
    settle(change, owed or Settlement(), limit.rate, now)
    return grant(change, limit, want, worker, now)


def most_in_window(starts: list[datetime], period: float) -> int:
    times = sorted(s.timestamp() for s in starts)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= period:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def test_parse_rate_reads_periods_and_names_the_field_when_wrong() -> None:
    """Rates are N/period with s, m, h or a number of seconds; bad ones name rate_limit."""
    assert parse_rate("100/m") == Rate(100, 60.0)
    assert parse_rate("50/s") == Rate(50, 1.0)
    assert parse_rate("10/5s") == Rate(10, 5.0)
    for bad in ("100", "0/s", "x/s", "10/forever", 5):
        with pytest.raises(InvalidTask) as caught:
            parse_rate(bad)
        assert caught.value.field == "rate_limit"


def test_gate_id_is_the_name_or_the_name_and_the_limit_by_value() -> None:
    """Tasks of one limit_by value share a gate; other values and the bare name do not."""
    assert gate_id("call_api", None, {"customer_id": 1}) == "call_api"
    assert gate_id("call_api", "customer_id", {"customer_id": "acme"}) == 'call_api#"acme"'
    assert gate_id("call_api", "customer_id", {"customer_id": 7}) != gate_id("call_api", "customer_id", {})


def test_a_fleet_of_sloppy_workers_never_puts_more_than_n_starts_in_a_window() -> None:
    """Random asks, late claims, unused permits and dead holders: any window of the period
    holds at most N starts, and a steady asker gets close to the full rate."""
    rng = random.Random(7)
    limit = Limit(Rate(5, 1.0))
    gate, starts, now = fresh(), [], 0.0
    owed: dict[str, Settlement] = {w: Settlement() for w in "abcd"}
    while now < 60:
        now += rng.uniform(0.0, 0.05)
        worker = rng.choice("abcd")
        granted = ask(gate, limit, rng.randint(1, 4), worker, at(now), owed[worker])
        owed[worker] = Settlement()
        for permit in granted.permits:
            fate = rng.random()
            if fate < 0.02:
                continue  # the worker died holding it: never settled
            if fate < 0.1:
                owed[worker].used[permit.id] = None  # claimed nothing
                continue
            # The claim lands somewhere in the permit's window (the server checks it).
            started = permit.start + (permit.until - permit.start) * rng.random() ** 4
            starts.append(started)
            owed[worker].used[permit.id] = started
    assert most_in_window(starts, 1.0) <= 5
    assert len(starts) >= 0.7 * 5 * 60  # dead holders and late claims cost some


def test_a_lane_settled_at_once_is_reused_a_period_after_its_start() -> None:
    """A start at c frees its lane at c + period: the next permit opens then, not later."""
    limit = Limit(Rate(1, 1.0))
    gate = fresh()
    first = ask(gate, limit, 1, "w", at(0)).permits[0]
    assert first.start == at(-EARLY)
    assert first.until == at(SLACK)
    second = ask(gate, limit, 1, "w", at(0.02), Settlement(used={first.id: at(0.01)})).permits[0]
    assert second.start == at(1.01)  # within the horizon: granted now, to start then
    nothing = ask(gate, limit, 1, "w", at(0.03))
    assert nothing.permits == []
    assert nothing.retry_at is not None and nothing.retry_at > at(1.01)  # after that start


def test_an_unused_permit_gives_its_lane_back_as_it_was() -> None:
    """Settling a permit as unused restores the lane, so nothing is lost to a missed claim."""
    limit = Limit(Rate(1, 10.0))
    gate = fresh()
    permit = ask(gate, limit, 1, "w", at(0)).permits[0]
    again = ask(gate, limit, 1, "w", at(0.2), Settlement(used={permit.id: None}))
    assert again.permits[0].start == at(0.2 - EARLY)


def test_a_dead_holders_lane_frees_after_its_hold_at_the_latest_start_plus_the_period() -> None:
    """Nobody settles: the lane is free again after until + HOLD, and opens a period after
    the latest moment its claim could have started."""
    limit = Limit(Rate(1, 1.0))
    gate = fresh()
    permit = ask(gate, limit, 1, "dead", at(0)).permits[0]
    assert ask(gate, limit, 1, "w", at(1.0)).permits == []
    later = permit.until + timedelta(seconds=HOLD + 0.01)
    assert ask(gate, limit, 1, "w", later).permits[0].start == permit.until + timedelta(seconds=1)


def test_max_running_caps_slots_until_runs_end_or_their_lease_lapses() -> None:
    """At most M slots; a finished run's slot is free at once, a dead worker's after its lease."""
    limit = Limit(max_running=2)
    gate = fresh()
    permits = ask(gate, limit, 5, "w", at(0)).permits
    assert len(permits) == 2 and all(slot.id for slot in gate.running)
    refused = ask(gate, limit, 1, "w", at(1))
    assert refused.permits == [] and refused.retry_at is not None and refused.retry_at > at(1)
    assert len(ask(gate, limit, 5, "w", at(2), Settlement(released={permits[0].id})).permits) == 1
    assert len(ask(gate, limit, 5, "w", at(100)).permits) == 2  # the unrenewed slots lapsed


def test_a_throttled_gate_grants_nothing_until_the_throttle_ends() -> None:
    """RateLimited for a limit_by value: no permit before throttled_until."""
    limit = Limit(Rate(10, 1.0))
    gate = fresh()
    gate.throttled_until = at(30)
    refused = ask(gate, limit, 1, "w", at(1))
    assert refused.permits == [] and refused.retry_at == at(30)
    assert ask(gate, limit, 1, "w", at(30.1)).permits


def test_a_smaller_rate_drops_free_lanes_and_never_a_held_one() -> None:
    """Lowering N keeps held lanes (their claims may still come) and drops free ones."""
    gate = fresh()
    held = ask(gate, Limit(Rate(4, 1.0)), 2, "w", at(0)).permits
    ask(gate, Limit(Rate(1, 1.0)), 0, "w", at(0.1))
    assert sorted(lane.holder for lane in gate.lanes if lane.holder) == sorted(p.id for p in held)


def test_writes_expect_only_what_they_touch() -> None:
    """A grant's write sets the lanes it takes, expecting each as it was read (and the
    gate's shape); the first write of a gate creates it whole."""
    limit = Limit(Rate(3, 1.0))
    first = Change.of(fresh())
    grant(first, limit, 1, "w", at(0))
    created = first.write()
    assert created is not None and created.create and created.expect == {"shape": None}
    stored = first.work
    second = Change.of(stored)
    [permit] = grant(second, limit, 1, "w", at(0.1)).permits
    write = second.write()
    assert write is not None and not write.create
    [path] = [p for p in write.changes if p.startswith("lanes.")]
    index = path.split(".")[1]
    assert write.expect == {
        "shape": "3/0",
        f"lanes.{index}.holder": None,
        f"lanes.{index}.at": stored.lanes[int(index)].at,
    }
    assert write.changes[path]["holder"] == permit.id


def test_an_unreadable_gate_starts_over_and_says_why() -> None:
    """A hand-broken gate document is replaced (keeping its version), not a crash."""
    doc, problem = GateDoc.read({"_id": "g", "shape": "3/0", "lanes": "oops"}, "g", "g")
    assert problem is not None and "lanes" in problem
    assert doc.shape == "3/0" and doc.lanes == []
    overwrite = Change.of(doc).write()  # whole, over the shape it saw
    assert overwrite is not None and overwrite.expect == {"shape": "3/0"} and overwrite.changes["lanes"] == []
