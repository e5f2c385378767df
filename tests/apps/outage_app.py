"""The app of tests/faults/test_outage_logs.py: one of every side task a worker runs.

A limited name (the gate keeper declares its limits and leases lanes), a schedule that
fires every second (the scheduler talks to the server all the time), and a plain name;
discovery, claiming, the registry, the limits watch and the clock come with any worker.
Handlers record ``start``/``finish`` marks as tests/apps/acceptance_app.py's do.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from apps.acceptance_app import mark
from taskrunner import TaskContext, TaskRunner

runner = TaskRunner()


@runner.task("quick")
async def quick(params: dict[str, Any], ctx: TaskContext) -> None:
    mark("start", ctx)
    mark("finish", ctx)


@runner.task("paced", rate_limit="20/s")
async def paced(params: dict[str, Any], ctx: TaskContext) -> None:
    """At most 20 starts in any second across the fleet."""
    mark("start", ctx)
    mark("finish", ctx)


runner.schedule("quick", id="every-second", every=timedelta(seconds=1))
