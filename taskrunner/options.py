"""The task options and a task as typed keywords, for type checkers and editors.

``TaskOptions`` validates at run time; these ``TypedDict`` s describe the same names to mypy
and pyright, so a misspelled option or a wrong type is caught before the code runs
(tests/unit/test_typed_api.py holds them to ``TaskOptions`` and ``publish``). No
``from __future__ import annotations`` here: ``Required`` must be evaluated for
``TaskSpec.__required_keys__`` to name ``name`` at run time.
"""

from datetime import datetime
from typing import Any, Literal, Required, TypedDict

from taskrunner.models import Duration, UpstreamPolicy


class TaskOptionsDict(TypedDict, total=False):
    """``TaskOptions`` as keywords: what ``publish``, ``publish_many`` items,
    ``@runner.task``, ``runner.schedule`` and ``Flow.add`` take as ``**options``, so a type
    checker rejects a misspelled option or a wrong type and editors complete them. Callers
    without a type checker get the same check at run time (``InvalidTask`` naming the
    option). Durations are seconds or a ``timedelta``."""

    concurrency: int
    max_failures: int
    local_retries: int
    retry_backoff: Duration
    backoff: Literal["exponential", "fixed"] | Duration
    backoff_factor: float
    backoff_cap: Duration
    ping_interval: Duration
    ping_timeout: Duration
    worker_ids: list[str]
    timeout: Duration | None


class PublishOptions(TaskOptionsDict, total=False):
    """When and how urgently a task runs, plus its ``TaskOptionsDict``: what ``Flow.add``
    passes on to ``publish``."""

    priority: int | None
    run_at: datetime | None
    delay: Duration | None


class TaskSpec(PublishOptions, total=False):
    """One item of ``publish_many``: ``publish``'s arguments as a dict, ``name`` required
    (``{"name": "send_email", "params": {...}, "key": "order-42", "max_failures": 5}``)."""

    name: Required[str]
    params: Any
    key: str | None
    after: list[str] | None
    on_upstream_failure: UpstreamPolicy | None
