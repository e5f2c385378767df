"""The claim-time queue: when each known task next becomes claimable for this worker.

A heap ordered by time with one live entry per key: re-scheduling a key replaces
its entry (older heap items are skipped when they surface). Entries whose time has
come move to a second heap ordered by preference, so the best due tasks are found
without sorting the queue. Keys whose time comes while the worker is busy stay
until claimed or re-scheduled;
when the queue overflows it evicts the farthest and asks discovery to rescan.
"""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass

Rank = tuple[int, int, int, float]


@dataclass(frozen=True, order=True, slots=True)
class Due:
    at: float
    """Server-clock POSIX time the key becomes claimable."""
    rank: Rank
    """(0 if the task names this worker else 1, -priority, 0 if it is a takeover else 1,
    created_at): lower first. A takeover (an expired lease) goes before new tasks of its
    priority, as a stalled job does in BullMQ: its run was already under way, and a batch
    published together shares one created_at, so it would otherwise wait for the batch."""
    key: str
    fresh: bool = False
    """Nobody had run the task when it was queued: claimed with the small update."""
    name: str = ""
    """The task's name (flow control drops the entries of a paused name)."""
    gate: str = ""
    """The task's gate when its name has fleet-wide limits (``taskrunner.gates``), else ""."""


class ClaimQueue:
    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self.overflowed = False
        self.changed = asyncio.Event()
        self._live: dict[str, Due] = {}
        self._heap: list[Due] = []  # by time
        self._ready: list[tuple[Rank, float, str, Due]] = []  # due entries, by preference

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def put(
        self, key: str, at: float, rank: Rank, *, fresh: bool = False, name: str = "", gate: str = ""
    ) -> None:
        entry = Due(at, rank, key, fresh, name, gate)
        if self._live.get(key) == entry:
            return
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._live) > self.capacity:
            self._evict()
        elif len(self._heap) + len(self._ready) > 2 * len(self._live) + 64:
            self._rebuild()
        self.changed.set()

    def again(self, entry: Due, at: float) -> None:
        """Put ``entry`` back for ``at`` (server time), all else as it was."""
        self.put(entry.key, at, entry.rank, fresh=entry.fresh, name=entry.name, gate=entry.gate)

    def discard(self, key: str) -> None:
        if self._live.pop(key, None) is not None:
            self.changed.set()

    def drop_names(self, names: frozenset[str]) -> None:
        """Forget every entry of these task names (they are paused)."""
        gone = [key for key, entry in self._live.items() if entry.name in names]
        for key in gone:
            del self._live[key]
        if gone:
            self.changed.set()

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
        self._rebuild()
        self.overflowed = True
