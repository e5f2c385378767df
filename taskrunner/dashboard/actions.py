"""The actions: each one call to the public TaskRunner coroutine the CLI uses; returns
where the browser goes next (a path built from quoted values only)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import quote

from taskrunner.errors import InvalidTask
from taskrunner.models import TaskState, parse_duration
from taskrunner.runner import TaskRunner

Form = dict[str, str]


def field(form: Form, name: str) -> str:
    value = form.get(name, "").strip()
    if not value:
        raise InvalidTask(name, "missing")
    return value


async def cancel(runner: TaskRunner, form: Form) -> str:
    task = await runner.cancel(field(form, "key"))
    return f"/tasks/{quote(task.key, safe='')}"


async def retry(runner: TaskRunner, form: Form) -> str:
    task = await runner.retry(field(form, "key"))
    return f"/tasks/{quote(task.key, safe='')}"


async def purge(runner: TaskRunner, form: Form) -> str:
    try:
        state, older_than = TaskState(field(form, "state")), parse_duration(field(form, "older_than"))
    except ValueError as exc:
        raise InvalidTask("purge", str(exc)) from None
    await runner.purge([state], older_than)
    return "/tasks"


async def pause(runner: TaskRunner, form: Form) -> str:
    await runner.pause(field(form, "name"))
    return "/schedules"


async def resume(runner: TaskRunner, form: Form) -> str:
    await runner.resume(field(form, "name"))
    return "/schedules"


async def stop_worker(runner: TaskRunner, form: Form) -> str:
    await runner.stop_worker(field(form, "worker_id"))
    return "/workers"


async def trigger(runner: TaskRunner, form: Form) -> str:
    task = await runner.trigger_schedule(field(form, "schedule_id"))
    return f"/tasks/{quote(task.key, safe='')}"


ACTIONS: dict[str, Callable[[TaskRunner, Form], Awaitable[str]]] = {
    "cancel": cancel,
    "retry": retry,
    "purge": purge,
    "pause": pause,
    "resume": resume,
    "stop-worker": stop_worker,
    "trigger": trigger,
}
