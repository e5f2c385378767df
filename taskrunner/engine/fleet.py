"""What the live fleet covers, from the worker registry: the task names its workers serve
and their ids. An operator's call that names something outside it (``pause sleeep``, a
task pinned to ``worker_ids=["ghost"]``) is told so with a ``NoLiveWorkerWarning``, and
``stats`` lists the tasks that wait on it."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Sequence

from taskrunner.errors import NoLiveWorkerWarning
from taskrunner.models import WorkerInfo


def not_live(
    workers: Sequence[WorkerInfo], *, names: Iterable[str] = (), worker_ids: Iterable[str] = ()
) -> NoLiveWorkerWarning | None:
    """The warning for ``names`` no live worker serves and ``worker_ids`` no live worker
    has, or None when the live fleet covers them all."""
    served = sorted({name for worker in workers for name in worker.names})
    live = sorted(worker.worker_id for worker in workers)
    missing_names = sorted(set(names) - set(served))
    missing_ids = sorted(set(worker_ids) - set(live))
    if not missing_names and not missing_ids:
        return None
    parts = [_missing("task name", n, "serves", served) for n in missing_names]
    parts += [_missing("worker id", i, "has", live) for i in missing_ids]
    fleet = "no worker is live" if not workers else f"live workers: {len(workers)}, see `taskrunner workers`"
    message = f"{'; '.join(parts)}; done anyway, it applies once such a worker runs ({fleet})"
    return NoLiveWorkerWarning(message, names=missing_names, worker_ids=missing_ids)


def _missing(what: str, value: str, verb: str, known: list[str]) -> str:
    close = difflib.get_close_matches(value, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"no live worker {verb} {what} {value!r}{hint}"


def warn(warning: NoLiveWorkerWarning | None, stacklevel: int) -> None:
    """Issue the warning (if any) at the caller's caller, ``stacklevel`` frames up."""
    if warning is not None:
        warnings.warn(warning, stacklevel=stacklevel + 1)
