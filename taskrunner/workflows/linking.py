"""Publishing tasks that run after others: what a batch may name, and what it marks.

A task may run only after tasks that exist when it is published, or that come earlier in
the same call, and its ``after`` never changes afterwards. Every dependency therefore points
from a task to an older one (or an earlier one in its batch): no cycle can ever be built,
and none has to be searched for.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from taskrunner.errors import InvalidTask, UnknownUpstream
from taskrunner.models import NewTask


def outside(batch: Sequence[NewTask]) -> list[str]:
    """The ``after`` keys a batch names that are not its own tasks (they must be stored)."""
    own = {t.key for t in batch}
    return sorted({k for t in batch for k in t.after if k not in own})


def linked(batch: Sequence[NewTask], stored: Collection[str]) -> list[NewTask]:
    """``batch`` with each task another of it runs after marked ``dependents``; raises
    ``UnknownUpstream`` for a key neither ``stored`` nor earlier in the batch, and
    ``InvalidTask`` for one later in it (nothing is published then)."""
    position = {task.key: i for i, task in enumerate(batch)}
    upstreams: set[str] = set()
    for i, task in enumerate(batch):
        for key in task.after:
            at = position.get(key)
            if at is None:
                if key not in stored:
                    raise UnknownUpstream(task.key, key)
            elif at > i:
                raise InvalidTask(
                    "after",
                    f"task {task.key!r} runs after {key!r}, which comes later in this call: "
                    "list upstreams before the tasks that run after them",
                )
            else:
                upstreams.add(key)
    return [t.model_copy(update={"dependents": True}) if t.key in upstreams else t for t in batch]


def check_republish(batch: Sequence[NewTask], republish_finished: bool) -> None:
    """``republish_finished`` replaces a finished task whole, ``after`` included: refused for
    tasks with an ``after``, so that no dependency can point to a newer task."""
    if republish_finished and any(t.after for t in batch):
        raise InvalidTask(
            "after",
            "republish_finished cannot publish a task with after (it could make a cycle); "
            "publish the new run under a new key (a new flow id)",
        )
