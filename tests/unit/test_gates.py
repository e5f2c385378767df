"""Fleet-wide limits (taskrunner.limits.gates, taskrunner.limits.gatekeeper): workers lease lanes and
running slots and start tasks on them; exact sliding windows and running caps whatever
their clocks, with claims that come late or never and workers that die holding leases.
Driven by a memory store on a simulated server clock."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from taskrunner import TaskContext, TaskRunner, TaskState, Unreadable
from taskrunner.engine.claim_queue import Due, Place, Rank
from taskrunner.engine.execution import Execution, Stop
from taskrunner.engine.worker import Worker, owned_buckets
from taskrunner.errors import InvalidTask, StoreUnavailable
from taskrunner.limits.gatekeeper import GateKeeper
from taskrunner.limits.gates import (
    EPOCH,
    FENCE,
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
    lease_end,
    parse_rate,
)
from taskrunner.store.base import Claim, Window
from taskrunner.store.memory import MemoryStore
from taskrunner.store.rules import bucket_of
from taskrunner.testing import wait_for

T0 = datetime(2026, 11, 24, tzinfo=UTC)
NAME = "call_api"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class CutOff(MemoryStore):
    """A memory store whose gate documents cannot be read or written while ``cut``, and
    whose next ``lose`` gate writes are applied but their replies lost."""

    cut = False
    lose = 0
    hold: asyncio.Event | None = None  # gate writes wait for it (a write on its way)
    held = 0

    async def read_gate(self, gate: str) -> dict[str, Any] | None:
        if self.cut:
            raise StoreUnavailable("connection closed")
        return await super().read_gate(gate)

    async def update_gate(
        self, gate: str, expect: Mapping[str, Any], changes: Mapping[str, Any], *, create: bool = False
    ) -> dict[str, Any] | None:
        if self.cut:
            raise StoreUnavailable("connection closed")
        if self.hold is not None:
            self.held += 1
            await self.hold.wait()
        written = await super().update_gate(gate, expect, changes, create=create)
        if self.lose:
            self.lose -= 1
            raise StoreUnavailable("connection closed before the reply")
        return written


class Fleet:
    """Gate keepers sharing one memory store whose clock is ``self.t`` seconds past T0;
    a claim lands ``delay`` seconds later and the server takes it only within its window."""

    def __init__(self, limit: Limit) -> None:
        self.t, self.limit, self.starts, self.serial = 0.0, limit, list[float](), 0
        self.store = CutOff(clock=lambda: at(self.t))
        self.names: list[str] = []
        self.stopped: list[str] = []
        self.read: dict[str, float] = {}  # throttles' ends as the workers read them (gate -> server time)

    def keeper(self, worker: str, skew: float = 0.0, capacity: int = 10) -> GateKeeper:
        """A worker whose estimate of the server's clock is off by ``skew`` seconds; the
        runs it is told to stop go to ``self.stopped``."""
        self.names.append(worker)
        return GateKeeper(
            self.store,
            worker,
            lambda: at(self.t + skew).timestamp(),
            {NAME: self.limit},
            capacity=capacity,
            peers=lambda name: list(self.names),
            stop_run=self.stopped.append,
            throttled=self.read.get,
        )

    def due(self, count: int, gate: str = NAME) -> list[Due]:
        self.serial += count
        return [
            Due(0.0, Rank(Place.OWNED, 0, 1, 0.0), f"k{self.serial - i}", True, NAME, gate)
            for i in range(count)
        ]

    async def start(self, keeper: GateKeeper, count: int, delay: float = 0.0) -> list[Permit]:
        """Ask for ``count`` starts; the permits' claims land ``delay`` later."""
        ready, _ = await keeper.admit(self.due(count), count)
        for _, permit in ready:
            landed = at(self.t + delay)
            taken = permit.start <= landed <= permit.until
            if taken:
                self.starts.append(self.t + delay)
            keeper.used(permit, landed if taken else None, self.run_of(permit) if taken else None)
        return [permit for _, permit in ready]

    @staticmethod
    def run_of(permit: Permit) -> str:
        return f"run-{permit.id}"

    async def gate(self, gate: str = NAME) -> GateDoc:
        doc, problem = GateDoc.read(await self.store.read_gate(gate), gate, NAME)
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
    assert await fleet.start(alive, 1) == []
    fleet.names.remove("dead")  # the registry forgot it: the whole rate is alive's share
    fleet.t = LEASE + 0.1
    ready, later = await alive.admit(fleet.due(1), 1)
    assert ready == [] and min(t for _, t in later) >= at(LEASE + 1.0).timestamp()
    fleet.t = LEASE + 1.1
    assert len(await fleet.start(alive, 2)) == 2


async def test_max_running_holds_a_slot_per_run_until_it_finishes() -> None:
    """At most M runs at once across workers; a finished run frees its slot for its own
    worker at once, and a worker whose dealt slot another holds waits."""
    fleet = Fleet(Limit(max_running=2))
    a, b = fleet.keeper("a", capacity=5), fleet.keeper("b", capacity=5)
    fleet.names.remove("b")
    first = await fleet.start(a, 5)
    assert len(first) == 2
    assert await fleet.start(a, 1) == []
    fleet.names.append("b")
    assert await fleet.start(b, 1) == []
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
    assert ready == [] and at(30.25).timestamp() < later[0][1] < at(30.3).timestamp()
    [state] = (await fleet.store.limits([NAME])).values()
    assert not isinstance(state, Unreadable) and [t.gate for t in state.throttled_gates] == [NAME]
    fleet.t = 30.3  # the stored end, and a quarter second for the worker's clock
    assert len(await fleet.start(a, 1)) == 1


async def test_a_throttled_gate_starts_at_the_stored_end_once_the_workers_read_it() -> None:
    """Once the workers have read a throttle's stored end (server time), the worker that
    stored it and any other start its tasks as soon as their estimate of the server's
    clock is past that end by its error bound, not a fixed quarter second later."""
    fleet = Fleet(Limit(Rate(10, 1.0)))
    a, b = fleet.keeper("a"), fleet.keeper("b")
    await a.throttle(NAME, NAME, 1.0)
    fleet.read[NAME] = at(1.0).timestamp()  # the stored end: the server's now at the write, plus 1 s
    for keeper in (a, b):
        ready, later = await keeper.admit(fleet.due(1), 1)
        assert ready == [] and at(1.0).timestamp() < later[0][1] <= at(1.05).timestamp()
    fleet.t = 1.05
    for keeper in (a, b):
        [permit] = await fleet.start(keeper, 1)
        assert permit.throttled and permit.start == at(1.0)
    assert fleet.starts == [1.05, 1.05]


async def test_a_lowered_rate_applies_at_once_to_the_lanes_held() -> None:
    """4/s lowered to 1/s: the very next claim gets one permit, not one per lane held."""
    fleet = Fleet(Limit(Rate(4, 1.0)))
    keeper = fleet.keeper("w")
    ready, _ = await keeper.admit(fleet.due(4), 4)
    keeper.unused(permit for _, permit in ready)  # four lanes held and open
    keeper.set_limits({NAME: Limit(Rate(1, 1.0))})
    assert len((await keeper.admit(fleet.due(4), 4))[0]) == 1


async def test_a_lowered_max_running_counts_the_runs_still_on_held_slots() -> None:
    """max_running 2 lowered to 1 while one run holds a slot: no new run starts until it
    ends (not on the other slot this worker holds, nor on one asked for), then one does."""
    fleet = Fleet(Limit(max_running=2))
    keeper = fleet.keeper("w")
    [running, ended] = await fleet.start(keeper, 2)
    keeper.finished(fleet.run_of(ended))
    keeper.set_limits({NAME: Limit(max_running=1)})
    assert (await keeper.admit(fleet.due(1), 1))[0] == []
    await keeper.tend()  # gives back the free slot (the limit changed)
    fleet.t = 2.0
    assert (await keeper.admit(fleet.due(1), 1))[0] == []
    keeper.finished(fleet.run_of(running))
    await keeper.tend()
    fleet.t = 8.0
    assert len((await keeper.admit(fleet.due(2), 2))[0]) == 1
    assert (await fleet.gate()).shape == "0/1"


async def test_a_lowered_max_running_counts_another_workers_runs_on_slots_past_it() -> None:
    """Two workers each run on one of two slots when max_running drops to 1: the first to
    finish does not start another while the other's run holds the slot past the limit."""
    fleet = Fleet(Limit(max_running=2))
    # a: the worker dealt slot 0, under either limit; b holds slot 1.
    a, b = sorted(["x", "y"], key=lambda w: not dealt(NAME, 1, w, ["x", "y"]))
    keepers = {w: fleet.keeper(w) for w in (a, b)}
    [on_a], [on_b] = await fleet.start(keepers[a], 1), await fleet.start(keepers[b], 1)
    assert (on_a.slot, on_b.slot) == (0, 1)
    for keeper in keepers.values():
        keeper.set_limits({NAME: Limit(max_running=1)})
    keepers[a].finished(fleet.run_of(on_a))
    await keepers[a].tend()
    fleet.t = 8.0
    assert await fleet.start(keepers[a], 1) + await fleet.start(keepers[b], 1) == []
    keepers[b].finished(fleet.run_of(on_b))
    await keepers[b].tend()
    fleet.t = 16.0
    assert len(await fleet.start(keepers[a], 1) + await fleet.start(keepers[b], 1)) == 1


async def test_a_run_stops_when_its_running_slot_is_lost_or_about_to_lapse() -> None:
    """A worker cut off from the gate stops the run on a slot FENCE seconds before its
    lease ends; a worker whose renewal finds its slot taken stops that slot's run; and
    a run asks before writing its outcome: a slot it still holds answers yes."""
    fleet = Fleet(Limit(max_running=1))
    keeper = fleet.keeper("a")
    [permit] = await fleet.start(keeper, 1)
    run = fleet.run_of(permit)
    assert await keeper.holds_slot(run) and await keeper.holds_slot("not-a-gated-run")
    fleet.store.cut = True
    fleet.t = LEASE - FENCE - 0.5
    with pytest.raises(StoreUnavailable):
        await keeper.tend()
    assert fleet.stopped == []
    fleet.t = LEASE - FENCE + 0.1
    with pytest.raises(StoreUnavailable):
        await keeper.tend()
    assert fleet.stopped == [run] and not await keeper.holds_slot(run)

    fleet.store.cut, fleet.stopped[:] = False, []
    other = Fleet(Limit(max_running=1))
    a, b = other.keeper("a"), other.keeper("b")
    other.names.remove("b")
    [permit] = await other.start(a, 1)
    run = other.run_of(permit)
    other.t = LEASE + 1  # a was frozen past its lease and left the registry: b takes the slot
    other.names[:] = ["b"]
    assert len(await other.start(b, 1)) == 1
    other.names.append("a")
    assert not await a.holds_slot(run)  # it tries to renew, and finds the slot taken
    assert other.stopped == [run]


async def test_a_renewal_whose_reply_was_lost_keeps_the_lanes_and_slots_it_renewed() -> None:
    """A renewal lands but its reply is lost: the gate names the worker with a later
    lease than it knows, which is still its own; the next renewal keeps every lane and
    slot, and the run on the slot goes on."""
    fleet = Fleet(Limit(Rate(1, 1.0), max_running=1))
    keeper = fleet.keeper("a")
    [permit] = await fleet.start(keeper, 1)
    fleet.t = LEASE / 3 + 0.1
    fleet.store.lose = 1
    with pytest.raises(StoreUnavailable):
        await keeper.tend()
    fleet.t += 1.0
    await keeper.tend()
    gate = await fleet.gate()
    assert [lane.holder for lane in gate.lanes] == ["a"] and [slot.holder for slot in gate.running] == ["a"]
    assert fleet.stopped == [] and await keeper.holds_slot(fleet.run_of(permit))
    assert gate.running[0].until == gate.lanes[0].until == lease_end(at(fleet.t))


async def test_lanes_and_slots_being_given_back_start_nothing_meanwhile() -> None:
    """A worker joined, so at its renewal the first worker gives back the lane and slot
    now dealt to the newcomer: while that write is on its way, they start nothing (the
    newcomer may take them as it lands); the lane and slot it keeps still do."""
    fleet = Fleet(Limit(Rate(2, 1.0), max_running=2))
    keeper = fleet.keeper("a")
    ready, _ = await keeper.admit(fleet.due(2), 2)
    keeper.unused(permit for _, permit in ready)
    fleet.names.append("b")
    fleet.t = LEASE / 3 + 0.5
    fleet.store.hold = asyncio.Event()
    tending = asyncio.create_task(keeper.tend())
    await wait_for(lambda: fleet.store.held, 5, "the release to be on its way")
    assert len((await keeper.admit(fleet.due(2), 2))[0]) == 1
    fleet.store.hold.set()
    await tending
    gate = await fleet.gate()
    assert sorted(map(str, (lane.holder for lane in gate.lanes))) == ["None", "a"]
    assert sorted(map(str, (slot.holder for slot in gate.running))) == ["None", "a"]


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


async def test_permits_made_before_a_gate_write_fails_are_given_back() -> None:
    """A claim's permits come from the lanes of one gate, then the ask for another gate
    fails: every permit made goes back, so the lanes start tasks again as soon as the
    server answers, and shutdown gives every lane back to its gate."""
    fleet = Fleet(Limit(Rate(2, 1.0), limit_by="tenant"))
    keeper = fleet.keeper("w")
    a, b = 'call_api#"a"', 'call_api#"b"'
    [(_, first)] = (await keeper.admit(fleet.due(1, a), 1))[0]
    keeper.used(first, None)  # claimed nothing: both lanes of a are held and open
    fleet.store.cut = True
    with pytest.raises(StoreUnavailable):
        await keeper.admit([*fleet.due(1, a), *fleet.due(1, b)], 2)
    fleet.store.cut = False
    ready, _ = await keeper.admit(fleet.due(2, a), 2)
    assert len(ready) == 2
    keeper.unused(permit for _, permit in ready)
    await keeper.close()
    assert [lane.holder for lane in (await fleet.gate(a)).lanes] == [None, None]


async def test_permits_made_before_asking_their_own_gate_for_more_are_given_back() -> None:
    """A worker holds one of its two running slots and asks for the other, which fails:
    the permit of the slot it held goes back too, and both start tasks once it is healed."""
    fleet = Fleet(Limit(max_running=2))
    keeper = fleet.keeper("w")
    fleet.names.append("x")  # a peer: w is dealt one slot
    [(_, first)] = (await keeper.admit(fleet.due(1), 1))[0]
    keeper.used(first, None)
    fleet.names.remove("x")  # the peer left: both slots are w's now
    fleet.t = 2.0  # asking again may give more
    fleet.store.cut = True
    with pytest.raises(StoreUnavailable):
        await keeper.admit(fleet.due(2), 2)
    fleet.store.cut = False
    fleet.t = 5.0  # past the back-off of the failed ask
    assert len((await keeper.admit(fleet.due(2), 2))[0]) == 2


# -- a worker's permits on error paths (a Worker on a memory store, real time) ---------------------
class Faulty(MemoryStore):
    """Claims with a gate's window raise a bug's error (``bugs``), lose their reply after
    landing (``lost``) or hang (``hang``); ``claims`` counts them."""

    bugs = lost = claims = 0
    hang = False

    async def claim(
        self,
        worker_id: str,
        *,
        key: str | None = None,
        names: Sequence[str] | None = None,
        fresh: bool = False,
        window: Window | None = None,
        keys: Sequence[str] | None = None,
    ) -> Claim | None:
        if window is not None:
            self.claims += 1
            if self.bugs:
                self.bugs -= 1
                raise RuntimeError("a bug below the store seam")
            if self.hang:
                await asyncio.Event().wait()
        claim = await super().claim(worker_id, key=key, names=names, fresh=fresh, window=window, keys=keys)
        if window is not None and self.lost:
            self.lost -= 1
            raise StoreUnavailable("connection closed before the reply")
        return claim


def limited(store: MemoryStore, ran: list[str], **limit: Any) -> TaskRunner:
    runner = TaskRunner(store=store)

    @runner.task("limited", ping_interval=0.3, ping_timeout=1.0, **limit)
    async def handler(params: dict[str, Any], ctx: TaskContext) -> None:
        ran.append(ctx.key)

    return runner


async def run_worker_until(worker: Worker, condition: Any, within: float = 20.0) -> None:
    running = asyncio.create_task(worker.run())
    try:
        await wait_for(condition, within, "the worker to get there", interval=0.02)
    finally:
        worker.stop()
        await asyncio.wait_for(running, 10)


async def test_a_claim_that_raises_an_unexpected_error_gives_its_permit_back() -> None:
    """The claimer crashes on an error no one expected (and is restarted): the permit of
    its claim is settled, so the gate's single running slot starts the task after all."""
    store, ran = Faulty(), list[str]()
    store.bugs = 1
    runner = limited(store, ran, max_running=1)
    await runner.publish("limited", key="only")
    await run_worker_until(Worker(runner, worker_id="w"), lambda: ran == ["only"])
    assert store.claims == 2 and (await runner.get("only")).state is TaskState.SUCCESS


async def test_shutdown_during_a_claim_gives_every_lane_and_slot_back() -> None:
    """A worker stopped while a gated claim is on its way gives its lanes and running slot
    back to the gate (a lane records its next start), so other workers need not wait for
    its lease to lapse."""
    store, ran = Faulty(), list[str]()
    store.hang = True
    runner = limited(store, ran, rate_limit="1/s", max_running=1)
    await runner.publish("limited", key="only")
    await run_worker_until(Worker(runner, worker_id="w", shutdown_timeout=0.1), lambda: store.claims == 1)
    gate = await store.read_gate("limited")
    assert gate is not None and gate["lanes"] and gate["running"]
    assert [lane["holder"] for lane in gate["lanes"]] == [None]
    assert [slot["holder"] for slot in gate["running"]] == [None]


async def test_a_claim_whose_reply_was_lost_runs_on_its_single_owners_slot() -> None:
    """A claim lands but its reply is lost, on a gate whose one running slot only this
    worker holds: once the orphaned claim's lease expires, the worker's own sweep finds
    the task and runs it (it is not left RUNNING for good)."""
    store, ran = Faulty(), list[str]()
    store.lost = 1
    runner = limited(store, ran, max_running=1)
    await runner.publish("limited", key="orphan")
    await run_worker_until(Worker(runner, worker_id="w"), lambda: ran == ["orphan"])
    task = await runner.get("orphan")
    assert store.lost == 0, "no claim's reply was lost"
    assert task.state is TaskState.SUCCESS and [e.worker_id for e in task.workers] == ["w"]
    assert task.attempts == 2 and task.workers[0].took_over == ["w"]  # the run took the orphan over


async def test_a_worker_with_an_open_slot_takes_on_another_owners_backlog_of_the_gate() -> None:
    """Two workers hold one running slot each of a max_running=2 gate; one owns six tasks
    and the other one. Once its own task is done, the other worker's open slot takes on
    part of the first one's backlog (seeing that backlog in its sweeps does not count as
    having its own)."""
    store = MemoryStore()
    runner = TaskRunner(store=store)
    ran: dict[str, str] = {}

    @runner.task("pair", max_running=2)
    async def pair(params: dict[str, Any], ctx: TaskContext) -> None:
        await asyncio.sleep(0.6)
        ran[ctx.key] = ctx.worker_id

    workers = [Worker(runner, worker_id=w, beat_interval=0.2) for w in ("w1", "w2")]
    running = [asyncio.create_task(w.run()) for w in workers]
    try:
        await wait_for(lambda: all(w.peers for w in workers), 10, "the workers to see each other")
        mine = {w: set(owned_buckets(w, [o for o in ("w1", "w2") if o != w])) for w in ("w1", "w2")}
        keys = (f"k{i}" for i in range(1000))
        w1_keys = [k for k in keys if bucket_of(k) in mine["w1"]][:6]
        w2_key = next(k for k in (f"j{i}" for i in range(1000)) if bucket_of(k) in mine["w2"])
        await runner.publish_many([{"name": "pair", "key": k} for k in [w2_key, *w1_keys]])
        await wait_for(lambda: len(ran) == 7, 30, "every task to run")
    finally:
        for w in workers:
            w.stop()
        await asyncio.gather(*running)
    assert ran[w2_key] == "w2"
    assert any(ran[k] == "w2" for k in w1_keys)


async def test_a_run_whose_slot_was_lost_releases_its_claim_instead_of_its_outcome() -> None:
    """A handler that finishes after its running slot was lost (its worker frozen past
    the slot's lease, say) records no outcome: its claim is released, nothing spent, so
    the task runs again on a slot rather than count as a run beyond max_running."""
    store, ran = MemoryStore(), list[str]()
    runner = limited(store, ran, max_running=1)
    await runner.publish("limited", key="late")
    claim = await store.claim("w", key="late")
    assert claim is not None
    asked: list[str] = []

    async def holds_slot(run_id: str) -> bool:
        asked.append(run_id)
        return False

    execution = Execution(claim, store=store, handlers=runner.handlers, worker_id="w", holds_slot=holds_slot)
    await execution.run()
    task = await runner.get("late")
    assert ran == ["late"] and asked == [claim.run_id] and execution.stopped is Stop.SLOT_LOST
    assert task.state is TaskState.PENDING and task.workers == [] and task.failures == 0
