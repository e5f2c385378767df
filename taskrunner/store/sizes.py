"""What fits in one task document: MongoDB stores no document over 16 MiB.

A task's document holds its params and an entry per run (docs/publishing.md, "How big
params and results may be"). A write that would make it larger is refused by the server,
and an outcome write refused for ever would leave its run RUNNING until its lease expired,
then run it again. So the document is budgeted when the task is published, for every run
its options allow:

* at most ``concurrency`` entries that are RUNNING or SUCCESS, each with its progress and,
  once it succeeded, its result;
* at most ``failed_runs(options)`` FAIL entries, each with its progress and its error: a
  budget cycle records at most ``max_failures + concurrency - 1`` failed runs (claims stop
  once ``failures`` reaches ``max_failures``; the runs already started may still fail),
  and a retry keeps the last cycle's (``rules.retry``), so twice that;
* the fields every document has, at their largest (``base_bytes``), with ``HEADROOM`` for
  what a task gains as it runs (dates, counters, ``fatal``).

Progress and errors have fixed caps (an error's share shrinks when the options allow many
failed runs); params take what they take; results share what is left, one share per
successful run the task needs. Publishing refuses params that would leave a result less
than ``MIN_RESULT_BYTES``, and options whose failed runs alone would not fit.

Sizes are BSON bytes. A payload's size is what it adds to its entry, whose field already
holds null (``added_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import bson

from taskrunner.store import fields as f

MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
"""MongoDB's limit on a stored document (``maxBsonObjectSize``)."""
HEADROOM = 16 * 1024
"""Kept free: fields a task gains as it runs, beyond those ``base_bytes`` counts."""
MAX_WORKER_ID_BYTES = 128
"""A worker id, as UTF-8: every entry names its worker and the workers it took over from."""
PROGRESS_BYTES = 512
"""A run's progress (``{fraction, message}``) at most; a longer message is cut to fit."""
ERROR_BYTES = 16 * 1024
"""A failed run's error (``{type, message, traceback}``) at most: the message and the
traceback are cut to fit (the traceback keeps its end, where the exception was raised)."""
ERRORS_SHARE = 4 * 1024 * 1024
"""What the errors of all the failed runs a task may keep share, when the options allow so
many that ``ERROR_BYTES`` each would not fit."""
MIN_ERROR_BYTES = 512
"""An error's share never goes below this: options needing less are refused."""
MIN_RESULT_BYTES = 64 * 1024
"""Publishing refuses params that leave a successful run's result less than this, or,
when ``concurrency`` runs must each succeed, less than their share of ``RESULTS_SHARE``
(``min_result``)."""
RESULTS_SHARE = 8 * 1024 * 1024
MIN_RESULT_SHARE = 1024

_LATEST = datetime(9999, 12, 31, tzinfo=UTC)
_LONGEST_STATE = "CANCELED"


def check_worker_id(worker_id: str) -> str:
    """``worker_id`` if it fits ``MAX_WORKER_ID_BYTES``; else raises ``ValueError``."""
    size = len(worker_id.encode("utf-8", "surrogatepass"))
    if size > MAX_WORKER_ID_BYTES:
        raise ValueError(
            f"a worker id is at most {MAX_WORKER_ID_BYTES} bytes as UTF-8, got {size}: {worker_id[:40]!r}..."
        )
    return worker_id


def added_bytes(value: Any) -> int:
    """What ``value`` adds to a document where its field held null (BSON bytes); raises
    ``bson.errors.InvalidDocument`` (or ``OverflowError``, ``TypeError``) for a value BSON
    cannot hold."""
    return len(bson.encode({"v": value})) - len(bson.encode({"v": None}))


def params_bytes(params: dict[str, Any]) -> int:
    """What ``params`` adds to a document whose params are empty."""
    return len(bson.encode(params)) - len(bson.encode({}))


def _entry() -> dict[str, Any]:
    """A run's entry at its largest, its payloads (progress, result, error) null."""
    worker_id = "w" * MAX_WORKER_ID_BYTES
    return {
        f.WORKER_ID: worker_id,
        f.RUN_ID: "r" * 32,  # a uuid4 hex
        f.STATE: "SUCCESS",
        f.CLAIMED_AT: _LATEST,
        f.PING_AT: _LATEST,
        f.EXPIRES_AT: _LATEST,
        f.ATTEMPT: bson.Int64(2**62),
        f.PROGRESS: None,
        f.RESULT: None,
        f.ERROR: None,
        f.FINISHED_AT: _LATEST,
        # A claim lists the workers whose expired leases it dropped; each of those spent a
        # failure, so the kept entries name about one each.
        f.TOOK_OVER: [worker_id],
    }


ENTRY_BYTES = len(bson.encode({"99999": _entry()})) - len(bson.encode({}))
"""One run's entry in the ``workers`` array (index key included), without its payloads."""


def base_bytes(key: str, name: str, priority: int, options: dict[str, Any]) -> int:
    """Every field of a task document but its params' content and its runs' entries, each
    at its largest (``rules.new_document`` plus what claims and outcomes add)."""
    doc = {
        f.ID: bson.ObjectId(),
        f.KEY: key,
        f.NAME: name,
        f.PARAMS: {},
        f.PRIORITY: bson.Int64(priority),
        f.CREATED_AT: _LATEST,
        f.UPDATED_AT: _LATEST,
        f.RUN_AT: _LATEST,
        f.OPTIONS: options,
        f.WORKERS: [],
        f.STATE: _LONGEST_STATE,
        f.FAILURES: bson.Int64(0),
        f.ATTEMPTS: bson.Int64(0),
        f.CLAIMABLE_AT: _LATEST,
        f.PUBLISH_ID: "p" * 32,
        f.BUCKET: bson.Int64(0),
        f.FATAL: True,
        f.SNOOZES: bson.Int64(0),
        f.FINISHED_AT: _LATEST,
    }
    return len(bson.encode(doc))


def min_result(concurrency: int) -> int:
    """The least room publishing leaves each successful run's result."""
    return max(MIN_RESULT_SHARE, min(MIN_RESULT_BYTES, RESULTS_SHARE // concurrency))


def failed_runs(concurrency: int, max_failures: int) -> int:
    """The FAIL entries a task document may hold: this budget cycle's and, after a retry,
    the last cycle's."""
    return 2 * (max_failures + concurrency - 1)


def error_bytes(concurrency: int, max_failures: int) -> int:
    """The most one failed run's error may take."""
    share = ERRORS_SHARE // failed_runs(concurrency, max_failures)
    return max(MIN_ERROR_BYTES, min(ERROR_BYTES, share))


@dataclass(frozen=True, slots=True)
class Budget:
    """How one task's document is shared out (see the module's docstring)."""

    base: int
    params: int
    concurrency: int
    max_failures: int
    failed: int
    """FAIL entries the document may hold."""
    error: int
    """The most one failed run's error may take."""

    @property
    def reserved(self) -> int:
        """Everything but the results: fields, params, every entry with its progress, errors."""
        entries = (self.concurrency + self.failed) * (ENTRY_BYTES + PROGRESS_BYTES)
        return self.base + self.params + entries + self.failed * self.error

    @property
    def result(self) -> int:
        """The most one successful run's result may take (negative: none fits)."""
        return (MAX_DOCUMENT_BYTES - HEADROOM - self.reserved) // self.concurrency

    @property
    def params_limit(self) -> int:
        """The largest params these options leave a result of ``MIN_RESULT_BYTES`` room for."""
        spare = MAX_DOCUMENT_BYTES - HEADROOM - (self.reserved - self.params)
        return spare - self.concurrency * min_result(self.concurrency)

    def refusal(self) -> tuple[str, str] | None:
        """Why a task with this budget cannot be published (the field and the reason), or None."""
        results = f"{self.concurrency} result(s) of at least {min_result(self.concurrency):,} bytes"
        if self.params_limit < 0:
            failed_share = self.failed * (ENTRY_BYTES + PROGRESS_BYTES + self.error)
            return f.OPTIONS, (
                f"concurrency {self.concurrency} and max_failures {self.max_failures} keep up to "
                f"{self.failed:,} failed runs ({failed_share:,} bytes with their errors) and need "
                f"room for {results}: more than a task document holds ({MAX_DOCUMENT_BYTES:,} bytes, "
                "MongoDB's limit); lower them"
            )
        if self.params > self.params_limit:
            return f.PARAMS, (
                f"{self.params:,} bytes as BSON; at most {self.params_limit:,} fit with these options "
                f"(a task document holds {MAX_DOCUMENT_BYTES:,} bytes, MongoDB's limit, and keeps room "
                f"for its runs: up to {self.failed:,} failed runs' errors and {results})"
            )
        return None


def budget(*, key: str, name: str, priority: int, options: dict[str, Any], params: int) -> Budget:
    """The budget of a task (``options`` as stored: ``TaskOptions.model_dump()``; ``params``
    what its params add, ``params_bytes``)."""
    concurrency, max_failures = int(options[f.CONCURRENCY]), int(options[f.MAX_FAILURES])
    return Budget(
        base=base_bytes(key, name, priority, options),
        params=params,
        concurrency=concurrency,
        max_failures=max_failures,
        failed=failed_runs(concurrency, max_failures),
        error=error_bytes(concurrency, max_failures),
    )


def cut_head(text: str, limit: int) -> str:
    """``text`` within ``limit`` UTF-8 bytes, keeping its start and saying what was cut."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    note = f" [... {len(data):,} bytes, cut to fit the task document]"
    if limit < 2 * len(note):
        return data[: max(0, limit)].decode("utf-8", "ignore")
    return data[: limit - len(note)].decode("utf-8", "ignore") + note


def cut_tail(text: str, limit: int) -> str:
    """``text`` within ``limit`` UTF-8 bytes, keeping its end and saying what was cut."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    note = f"[{len(data):,} bytes, cut to fit the task document; the end follows ...]\n"
    if limit < 2 * len(note):
        return data[len(data) - max(0, limit) :].decode("utf-8", "ignore")
    return note + data[len(data) - (limit - len(note)) :].decode("utf-8", "ignore")


def fit_error(kind: str, message: str, traceback: str | None, limit: int) -> tuple[str, str, str | None]:
    """An error's type, message and traceback cut so that the error takes at most ``limit``
    bytes: the type and the message keep their start, the traceback its end."""
    skeleton = {
        f.ERROR_TYPE: "",
        f.ERROR_MESSAGE: "",
        f.ERROR_TRACEBACK: "" if traceback is not None else None,
    }
    room = limit - added_bytes(skeleton)
    kind = cut_head(kind, min(256, room // 4))
    room -= _utf8(kind)
    # The message gets what the traceback leaves, and at least a quarter of the room.
    tb_size = 0 if traceback is None else _utf8(traceback)
    cut = cut_head(message, max(room // 4, room - tb_size))
    room -= _utf8(cut)
    if traceback is None:
        return kind, cut, None
    ending = traceback.rstrip("\n")
    if cut != message and message and ending.endswith(message):
        # A traceback ends with the message: cut there too, so its end still shows the frames.
        traceback = ending[: -len(message)] + cut + "\n"
    return kind, cut, cut_tail(traceback, room)


def fit_progress(progress: dict[str, Any]) -> dict[str, Any]:
    """``progress`` (``{fraction, message}``) with its message cut to fit ``PROGRESS_BYTES``."""
    message = progress.get("message")
    if not isinstance(message, str) or added_bytes(progress) <= PROGRESS_BYTES:
        return progress
    room = PROGRESS_BYTES - added_bytes({**progress, "message": ""})
    return {**progress, "message": cut_head(message, room)}


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
