"""A flow's steps by level, the shape the CLI and the dashboard draw it in.

A step's level is one more than the highest level among the steps of the same flow it runs
after (the longest path to it): the first level runs after no step of the flow, and every
step of level n runs after at least one step of level n - 1. A 1 -> 10 -> 1 flow is three
levels of 1, 10 and 1 steps. Upstreams outside the flow (stored tasks named in ``after``)
do not count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TypeVar

from taskrunner.models import StoredTask

T = TypeVar("T", bound=StoredTask)


def levels(steps: Sequence[T]) -> list[list[T]]:
    """``steps`` by level, each level in the order of ``steps``.

    A cycle cannot be published (``after`` names older tasks and never changes); should
    hand-written documents make one, its steps come in one last level, so none is lost.
    """
    index = {step.key: i for i, step in enumerate(steps)}
    after_me: list[list[int]] = [[] for _ in steps]
    missing = [0] * len(steps)
    for i, step in enumerate(steps):
        upstream = {index[key] for key in step.after if key in index and index[key] != i}
        missing[i] = len(upstream)
        for j in upstream:
            after_me[j].append(i)
    level = [0] * len(steps)
    ready = deque(i for i, count in enumerate(missing) if count == 0)
    while ready:  # Kahn's order: a step is placed once every upstream of the flow is
        i = ready.popleft()
        for j in after_me[i]:
            level[j] = max(level[j], level[i] + 1)
            missing[j] -= 1
            if missing[j] == 0:
                ready.append(j)
    placed = [i for i, count in enumerate(missing) if count == 0]
    depth = max((level[i] for i in placed), default=-1) + 1
    for i, count in enumerate(missing):
        if count:
            level[i] = depth
    found: list[list[T]] = [[] for _ in range(max(level, default=-1) + 1)]
    for i, step in enumerate(steps):
        found[level[i]].append(step)
    return found
