"""Fleet-wide limits (taskrunner.gates, taskrunner.gatekeeper): workers lease lanes and
running slots and start tasks on them; exact sliding windows and running caps whatever
their clocks, with claims that come late or never and workers that die holding leases.
Driven by a memory store on a simulated server clock."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from taskrunner.claimqueue import Due
from taskrunner.errors import InvalidTask
from taskrunner.gatekeeper import GateKeeper
from taskrunner.gates import (
    EPOCH,
    IDLE,
    LEASE,
    Change,
    GateDoc,
    Lane,
    Limit,
    Permit,
    Rate,
    dealt,
    gate_id,
    parse_rate,
)
from taskrunner.store.memory import MemoryStore

T0 = datetime(2026, 11, 24, tzinfo=UTC)
NAME = "call_api"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class Fleet:
    """Gate keepers sharing one memory store whose clock is ``self.t`` seconds past T0;
    a claim lands ``delay`` seconds later and the server takes it only within its window."""

    def __init__(self, limit: Limit) -> None:
        self.t, self.limit, self.starts, self.serial = 0.0, limit, list[float](), 0
        self.store = MemoryStore(clock=lambda: at(self.t))
        self.names: list[str] = []

    def keeper(self, worker: str, skew: float = 0.0, capacity: int = 10) -> GateKeeper:
        """A worker whose estimate of the server's clock is off by ``skew`` seconds."""
        self.names.append(worker)
        return GateKeeper(
            self.store,
            worker,
            lambda: at(self.t + skew).timestamp(),
            {NAME: self.limit},
            capacity=capacity,
            peers=lambda name: list(self.names),
        )

    def due(self, count: int) -> list[Due]:
        self.serial += count
        return [Due(0.0, (1, 0, 1, 0.0), f"k{self.serial - i}", True, NAME, NAME) for i in range(count)]

    async def start(self, keeper: GateKeeper, count: int, delay: float = 0.0) -> list[Permit]:
        """Ask for ``count`` starts; the permits' claims land ``delay`` later."""
        ready, _ = await keeper.admit(self.due(count), count)
        for _, permit in ready:
            landed = at(self.t + delay)
            taken = permit.start <= landed <= permit.until
            if taken:
                self.starts.append(self.t + delay)
            keeper.used(permit, landed if taken else None, f"run{self.serial}-{permit.id}" if taken else None)
        return [permit for _, permit in ready]

    async def gate(self) -> GateDoc:
        doc, problem = GateDoc.read(await self.store.read_gate(NAME), NAME, NAME)
        assert problem is None
        return doc


def most_in_window(starts: list[float], period: float) -> int:
    times, best, lo = sorted(starts), 0, 0
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


async def test_a_fleet_with_skewed_clocks_late_claims_and_deaths_never_exceeds_n_per_window() -> None:
    """Four workers whose clocks are off by up to 0.3 s, claims landing up to 0.3 s late,
    one worker dying with its lanes and another joining: no window of the period holds
    more than N starts, and the fleet still starts most of what the rate allows."""
    rng = random.Random(7)
    fleet = Fleet(Limit(Rate(5, 1.0)))
    keepers = {w: fleet.keeper(w, rng.uniform(-0.3, 0.3)) for w in "abcd"}
    while fleet.t < 90:
        fleet.t += rng.uniform(0.0, 0.05)
        if fleet.t > 20 and "d" in keepers:
            del keepers["d"]  # dies: never renews, never gives back
        if fleet.t > 25 and "e" not in keepers:
            keepers["e"] = fleet.keeper("e", -0.2)
        keeper = keepers[rng.choice(sorted(keepers))]
        await fleet.start(keeper, rng.randint(1, 4), rng.uniform(0.0, 0.3))
        if rng.random() < 0.2:
            await keeper.tend()
    assert most_in_window(fleet.starts, 1.0) <= 5
    assert len(fleet.starts) >= 0.6 * 5 * 90


async def test_a_lane_opens_a_period_after_its_start_and_costs_no_write_per_task() -> None:
    """Leasing the lane is one write; starts on it are the claims alone, a period apart."""
    fleet = Fleet(Limit(Rate(1, 1.0)))
    keeper = fleet.keeper("w")
    assert len(await fleet.start(keeper, 1)) == 1
    fleet.t = 0.5
    ready, later = await keeper.admit(fleet.due(1), 1)
    assert ready == [] and later[0][1] == pytest.approx(at(1.0).timestamp(), abs=0.05)
    fleet.t = 1.05
    assert len(await fleet.start(keeper, 1)) == 1
    assert keeper.counts["writes"] == 1 and fleet.starts == [0.0, 1.05]


async def test_a_dead_workers_lanes_open_a_period_after_its_lease_ends() -> None:
    """Nobody renews: the lanes stay its own until the lease lapses, then open a period
    later, after anything it could still have started."""
    fleet = Fleet(Limit(Rate(2, 1.0)))
    dead, alive = fleet.keeper("dead"), fleet.keeper("alive")
    fleet.names.remove("alive")  # it joined later: the dead one took the whole rate
    await fleet.start(dead, 2)
    fleet.names.append("alive")
    fleet.t = 5.0
    assert await fleet.start(alive, 1) == [] and not alive.spare(NAME)
    fleet.names.remove("dead")  # the registry forgot it: the whole rate is alive's share
    fleet.t = LEASE + 0.1
    ready, later = await alive.admit(fleet.due(1), 1)
    assert ready == [] and min(t for _, t in later) >= at(LEASE + 1.0).timestamp()
    fleet.t = LEASE + 1.1
    assert len(await fleet.start(alive, 2)) == 2


async def test_max_running_holds_a_slot_per_run_until_it_finishes() -> None:
    """At most M runs at once across workers; a finished run frees its slot for its own
    worker at once, and a worker holding none waits (and steals nothing)."""
    fleet = Fleet(Limit(max_running=2))
    a, b = fleet.keeper("a", capacity=5), fleet.keeper("b", capacity=5)
    fleet.names.remove("b")
    first = await fleet.start(a, 5)
    assert len(first) == 2
    assert await fleet.start(a, 1) == []
    fleet.names.append("b")
    assert await fleet.start(b, 1) == [] and not b.spare(NAME)
    a.finished(next(iter(a._leases[NAME].slots.values())).run or "")
    assert len(await fleet.start(a, 3)) == 1


async def test_unused_lanes_go_back_after_idle_with_their_next_start() -> None:
    """A worker with no task for IDLE seconds gives its lanes back; the worker they are
    dealt to next takes them and starts no sooner than a period after the last start."""
    fleet = Fleet(Limit(Rate(1, 100.0)))
    a, b = fleet.keeper("a"), fleet.keeper("b")
    fleet.names.remove("b")
    await fleet.start(a, 1)
    fleet.names.append("b")
    fleet.t = IDLE + 0.5
    await a.tend()
    assert (await fleet.gate()).lanes[0].holder is None and (await fleet.gate()).lanes[0].next == at(100.0)
    fleet.names[:] = ["b"]  # a stopped: the lane is dealt to b now
    ready, later = await b.admit(fleet.due(1), 1)
    assert ready == [] and later[0][1] >= at(100.0).timestamp()


async def test_renewal_keeps_the_lease_and_a_lapsed_lane_taken_by_another_is_let_go() -> None:
    """Renewed every third of LEASE, lanes stay a worker's for good; a lane it failed to
    renew in time and that another worker took is dropped at the next renewal."""
    fleet = Fleet(Limit(Rate(2, 1.0)))
    a, b = fleet.keeper("a"), fleet.keeper("b")
    fleet.names.remove("b")
    for step in range(1, 12):
        fleet.t = step * LEASE / 4
        await fleet.start(a, 1)
        await a.tend()
    assert {lane.holder for lane in (await fleet.gate()).lanes} == {"a"}
    fleet.t += LEASE + 2  # a stalls past its lease and drops out of the registry; b takes all
    fleet.names[:] = ["b"]
    assert len(await fleet.start(b, 2)) == 2
    await a.tend()
    assert not a._leases.get(NAME) and {lane.holder for lane in (await fleet.gate()).lanes} == {"b"}


async def test_a_smaller_rate_takes_effect_once_holders_give_lanes_back() -> None:
    """New limits give every lane back at the next tick; the gate then has the new size."""
    fleet = Fleet(Limit(Rate(4, 1.0)))
    a = fleet.keeper("a")
    await fleet.start(a, 4)
    a.set_limits({NAME: Limit(Rate(1, 1.0))})
    await a.tend()
    fleet.t = 1.5
    await fleet.start(a, 4)
    assert (await fleet.gate()).shape == "1/0" and len((await fleet.gate()).lanes) == 1


async def test_a_throttled_gate_starts_nothing_until_the_throttle_ends() -> None:
    """RateLimited for a limit_by value: the worker stops at once, the limits document
    lists the gate for others, and starts resume after the throttle."""
    fleet = Fleet(Limit(Rate(10, 1.0)))
    a = fleet.keeper("a")
    await a.throttle(NAME, NAME, 30.0)
    ready, later = await a.admit(fleet.due(1), 1)
    assert ready == [] and later[0][1] == pytest.approx(at(30.25).timestamp())
    [state] = (await fleet.store.limits([NAME])).values()
    assert not isinstance(state, str) and [t.gate for t in state.throttled_gates] == [NAME]
    fleet.t = 30.3  # the stored end, and a quarter second for the worker's clock
    assert len(await fleet.start(a, 1)) == 1


def test_writes_expect_only_the_lanes_they_touch() -> None:
    """A change of one lane expects that lane as read (and the shape);
    the first write of a gate creates it whole."""
    doc, _ = GateDoc.read(None, NAME, NAME)
    first = Change.of(doc)
    first.work.lanes = [Lane() for _ in range(3)]
    created = first.write()
    assert created is not None and created.create and created.expect == {"shape": None}
    stored = first.work
    second = Change.of(stored)
    second.work.lanes[1].holder = "w"
    second.lanes.add(1)
    write = second.write()
    assert write is not None and not write.create
    assert write.expect == {
        "shape": "3/0",
        "lanes.1.holder": None,
        "lanes.1.until": None,
        "lanes.1.next": EPOCH,
        "lanes.1.freed": EPOCH,
    }
    assert list(write.changes) == ["lanes.1"]


def test_an_unreadable_gate_starts_over_and_says_why() -> None:
    """A hand-broken gate document is replaced whole (over the shape it had), not a crash."""
    doc, problem = GateDoc.read({"_id": "g", "shape": "3/0", "lanes": "oops"}, "g", "g")
    assert problem is not None and "lanes" in problem
    assert doc.shape == "3/0" and doc.lanes == []
    overwrite = Change.of(doc).write()
    assert overwrite is not None and overwrite.expect == {"shape": "3/0"} and overwrite.changes["lanes"] == []


def test_lanes_are_dealt_to_exactly_one_live_worker_each_and_evenly() -> None:
    """Every worker computes the same split from the registry: each lane goes to one
    worker, shares differ by at most one, and gates with few lanes spread over workers."""
    peers = [f"w{i}" for i in range(8)]
    split = {w: dealt("call_api", 50, w, peers) for w in peers}
    assert sorted(i for lanes in split.values() for i in lanes) == list(range(50))
    assert {len(lanes) for lanes in split.values()} == {6, 7}
    takers = {w for g in range(40) for w in peers if dealt(f'call_api#"{g}"', 1, w, peers)}
    assert len(takers) >= 6
