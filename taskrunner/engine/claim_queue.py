"""The claim-time queue: when each known task next becomes claimable for this worker.

A heap ordered by time with one live entry per key: re-scheduling a key replaces
its entry (older heap items are skipped when they surface). Entries whose time has
come move to a second heap ordered by preference, so the best due tasks are found
without sorting the queue. Keys whose time comes while the worker is busy stay
until claimed or re-scheduled;
when the queue overflows it evicts the farthest and asks discovery to rescan.

An entry of a limited name that waits for one of its gate's permits is *parked*: put
back for a time (when a lane opens, or a fallback) and kept among its gate's parked
entries by preference, so that the moment a permit opens sooner (a running slot freed,
a claim that took nothing) ``wake`` brings the best of them back at once.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
from dataclasses import dataclass
from typing import NamedTuple


class Place(enum.IntEnum):
    """Whose task an entry is, best first."""

    NAMED = 0
    """The task names this worker (``worker_ids``)."""
    OWNED = 1
    """This worker owns it among the live peers, or takes over an orphan."""
    TAKEN_ON = 2
    """Another worker owns it; this one starts it with its own permits of the task's gate."""


class Rank(NamedTuple):
    """An entry's preference among the due ones: lower first, field by field."""

    place: Place
    priority: int
    """Minus the task's priority (higher priority first)."""
    takeover: int
    """0 for a takeover (an expired lease), 1 for a task nobody runs."""
    created: float
    """The task's ``created_at`` (POSIX): older first."""


class Kind(enum.Enum):
    """What a claim-queue entry asks the claimer for."""

    TASK = "task"
    """Claim the task whose key the entry holds."""
    KEYLESS = "keyless"
    """One claim without a key: the server picks the best claimable task."""
    SWEEP = "sweep"
    """Sweep for tasks (orphans, expired leases, what events missed)."""


@dataclass(frozen=True, order=True, slots=True)
class Due:
    at: float
    """Server-clock POSIX time the key becomes claimable."""
    rank: Rank
    """Lower first. A takeover (an expired lease) goes before new tasks of its priority, as
    a stalled job does in BullMQ: its run was already under way, and a batch published
    together shares one created_at, so it would otherwise wait for the batch."""
    key: str
    fresh: bool = False
    """Nobody had run the task when it was queued: claimed with the small update."""
    name: str = ""
    """The task's name (flow control drops the entries of a paused name)."""
    gate: str = ""
    """The task's gate when its name has fleet-wide limits (``taskrunner.limits.gates``), else ""."""
    since: float = 0.0
    """When the task became claimable for this worker (server time): ``at`` is later
    once the entry was put back to look again."""
    kind: Kind = Kind.TASK
    """A task's entry, or one of the claimer's own requests (``key`` then names the kind)."""


class ClaimQueue:
    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self.overflowed = False
        self.changed = asyncio.Event()
        self._live: dict[str, Due] = {}
        self._heap: list[Due] = []  # by time
        self._ready: list[tuple[Rank, float, str, Due]] = []  # due entries, by preference
        self._gates: dict[str, set[str]] = {}  # gate -> its live keys
        self._parked: dict[str, list[tuple[Rank, str, Due]]] = {}  # gate -> parked entries, by preference

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def put(
        self,
        key: str,
        at: float,
        rank: Rank,
        *,
        fresh: bool = False,
        name: str = "",
        gate: str = "",
        since: float | None = None,
        kind: Kind = Kind.TASK,
    ) -> None:
        entry = Due(at, rank, key, fresh, name, gate, at if since is None else since, kind)
        old = self._live.get(key)
        if old == entry:
            return
        if old is not None:
            self._unindex(old)
        self._live[key] = entry
        self._index(entry)
        heapq.heappush(self._heap, entry)
        if len(self._live) > self.capacity:
            self._evict()
        elif len(self._heap) + len(self._ready) > 2 * len(self._live) + 64:
            self._rebuild()
        self.changed.set()

    def again(self, entry: Due, at: float) -> None:
        """Put ``entry`` back for ``at`` (server time), all else as it was."""
        self.put(
            entry.key,
            at,
            entry.rank,
            fresh=entry.fresh,
            name=entry.name,
            gate=entry.gate,
            since=entry.since,
            kind=entry.kind,
        )

    def park(self, entry: Due, until: float) -> None:
        """Put ``entry`` back for ``until`` among its gate's parked entries (see ``wake``)."""
        self.again(entry, until)
        parked = self._live.get(entry.key)
        if parked is None or not parked.gate:  # evicted, or no gate to wake it
            return
        heap = self._parked.setdefault(parked.gate, [])
        heapq.heappush(heap, (parked.rank, parked.key, parked))
        if len(heap) > 2 * len(self._gates.get(parked.gate, ())) + 64:
            self._parked[parked.gate] = [item for item in heap if self._live.get(item[1]) == item[2]]
            heapq.heapify(self._parked[parked.gate])

    def wake(self, gate: str, count: int, now: float) -> int:
        """Make the best ``count`` entries of ``gate`` still parked due at ``now`` (server
        time): a permit of the gate opened sooner than they were told. Returns how many."""
        heap, woken = self._parked.get(gate, []), 0
        while heap and woken < count:
            _, key, entry = heapq.heappop(heap)
            if self._live.get(key) == entry and entry.at > now:  # still parked as it was
                self.again(entry, now)
                woken += 1
        if not heap:
            self._parked.pop(gate, None)
        return woken

    def count(self, gate: str) -> int:
        """How many entries of ``gate`` are queued."""
        return len(self._gates.get(gate, ()))

    def gates(self) -> dict[str, list[Due]]:
        """The entries queued per gate."""
        return {gate: [self._live[key] for key in keys] for gate, keys in self._gates.items()}

    def get(self, key: str) -> Due | None:
        return self._live.get(key)

    def discard(self, key: str) -> None:
        if (entry := self._live.pop(key, None)) is not None:
            self._unindex(entry)
            self.changed.set()

    def drop_names(self, names: frozenset[str]) -> None:
        """Forget every entry of these task names (they are paused)."""
        gone = [key for key, entry in self._live.items() if entry.name in names]
        for key in gone:
            self._unindex(self._live.pop(key))
        if gone:
            self.changed.set()

    def _index(self, entry: Due) -> None:
        if entry.gate:
            self._gates.setdefault(entry.gate, set()).add(entry.key)

    def _unindex(self, entry: Due) -> None:
        keys = self._gates.get(entry.gate)
        if keys is not None:
            keys.discard(entry.key)
            if not keys:
                del self._gates[entry.gate]
                self._parked.pop(entry.gate, None)

    def next_at(self) -> float | None:
        """When the next entry is due; a past time when some already are."""
        self._skip_stale()
        times = [self._heap[0].at] if self._heap else []
        if self._ready:
            times.append(self._ready[0][1])
        return min(times) if times else None

    def due(self, now: float, limit: int | None = None) -> list[Due]:
        """The best ``limit`` (default all) entries due at ``now``, best first; entries stay
        until discarded or re-scheduled. Costs O(limit log n), not a sort of the queue."""
        while self._heap and self._heap[0].at <= now:
            entry = heapq.heappop(self._heap)
            if self._live.get(entry.key) == entry:
                heapq.heappush(self._ready, (entry.rank, entry.at, entry.key, entry))
        best: dict[str, Due] = {}
        while self._ready and (limit is None or len(best) < limit):
            entry = heapq.heappop(self._ready)[3]
            if self._live.get(entry.key) == entry:
                best[entry.key] = entry
        for entry in best.values():  # they stay queued
            heapq.heappush(self._ready, (entry.rank, entry.at, entry.key, entry))
        return list(best.values())

    def _skip_stale(self) -> None:
        while self._heap and self._live.get(self._heap[0].key) != self._heap[0]:
            heapq.heappop(self._heap)
        while self._ready and self._live.get(self._ready[0][2]) != self._ready[0][3]:
            heapq.heappop(self._ready)

    def _rebuild(self) -> None:
        self._heap, self._ready = list(self._live.values()), []
        heapq.heapify(self._heap)

    def _evict(self) -> None:
        # Evict in bulk (down to 90 %) so a long scan past capacity stays O(n log n).
        keep = heapq.nsmallest(int(self.capacity * 0.9), self._live.values())
        self._live = {e.key: e for e in keep}
        self._gates, self._parked = {}, {}
        for entry in keep:
            self._index(entry)
        self._rebuild()
        self.overflowed = True
