"""An app with recurring schedules, for tests/processes/test_schedule_processes.py.

``tick`` fires every second (every worker declares it); ``hourly-latest``,
``hourly-all`` and ``hourly-none`` fire on the hour with each catch-up policy, so a
test can fake downtime by moving their stored ``last_tick`` back.
"""

from __future__ import annotations

from datetime import timedelta

from taskrunner import TaskContext, TaskRunner

runner = TaskRunner()


@runner.task("noop")
async def noop(params: dict[str, object], ctx: TaskContext) -> None:
    """Does nothing; the task document is the record."""


runner.schedule("noop", id="tick", every=timedelta(seconds=1))
runner.schedule("noop", id="hourly-latest", cron="0 * * * *", catch_up="latest")
runner.schedule("noop", id="hourly-all", cron="0 * * * *", catch_up="all", max_catch_up=5)
runner.schedule("noop", id="hourly-none", cron="0 * * * *", catch_up="none")
