"""The dashboard in headless chromium against real worker processes.

Each test starts ``taskrunner dashboard`` (a process, as an operator would) on its own
collection of the embedded server, and ``taskrunner worker`` processes where work must run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from playwright.async_api import expect
from workers import WorkerPool, wait_for

from taskrunner import EntryState, TaskRunner, TaskState, WorkerEntry

from .conftest import Dashboard, Watched

pytestmark = pytest.mark.mongo

LEASE: dict[str, Any] = {"ping_interval": 0.5, "ping_timeout": 2.0}
"""Short leases, so that a SIGKILLed worker's task is taken over within seconds."""
HOSTILE = {
    "script": "<script>alert('params')</script>",
    "link": "javascript:alert('params')",
    "img": "<img src=x onerror=alert('params')>",
}
HOSTILE_KEY = "xss<img src=x onerror=alert('key')>"


def count_cell(page: Any, state: str) -> Any:
    return page.locator(f'td[data-count-state="{state}"]')


async def open_live(watched: Watched, url: str) -> None:
    """Open ``url`` and wait for its live connection; mark the window to detect any reload."""
    await watched.page.goto(url)
    await expect(watched.page.locator("body")).to_have_attribute("data-live", "on")
    await watched.page.evaluate("window.__notReloaded = true")


async def not_reloaded(watched: Watched) -> bool:
    return bool(await watched.page.evaluate("window.__notReloaded === true"))


async def test_overview_counts_change_live_when_a_worker_finishes_a_task(
    runner: TaskRunner,
    dashboard_factory: Callable[..., Dashboard],
    watched: Watched,
    mongo_uri: str,
    collection_name: str,
    tmp_path: Path,
) -> None:
    """The SUCCESS count goes 0 -> 1 on the open overview, without a reload, when a worker finishes."""
    dashboard = dashboard_factory()
    gate = tmp_path / "go"
    await runner.publish("sleep", {"seconds": 0, "first_gate": str(gate)}, key="live")
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        pool.start("w1")
        await wait_for(lambda: _running_entry(runner, "live"), 30, "the claim")
        await open_live(watched, dashboard.url + "/")
        await expect(count_cell(watched.page, "RUNNING")).to_have_text("1")
        await expect(count_cell(watched.page, "SUCCESS")).to_have_text("0")
        gate.touch()
        await expect(count_cell(watched.page, "SUCCESS")).to_have_text("1")
        await expect(count_cell(watched.page, "RUNNING")).to_have_text("0")
    assert await not_reloaded(watched)
    assert (await runner.get("live")).state is TaskState.SUCCESS


async def test_task_page_shows_a_takeover_after_sigkill(
    runner: TaskRunner,
    dashboard_factory: Callable[..., Dashboard],
    watched: Watched,
    mongo_uri: str,
    collection_name: str,
    tmp_path: Path,
) -> None:
    """After SIGKILL of the worker running it, the open task page shows the other worker's entry taking over."""
    dashboard = dashboard_factory()
    await runner.publish("sleep", {"seconds": 0.3, "first_seconds": 60}, key="victim", **LEASE)
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        workers = {w.worker_id: w for w in pool.start_many(["w1", "w2"])}
        first = await wait_for(lambda: _running_entry(runner, "victim"), 30, "a first claim")
        victim = workers.pop(first.worker_id)
        [survivor] = workers.values()
        await open_live(watched, f"{dashboard.url}/tasks/victim")
        entry = f'li[data-entry-worker="{victim.worker_id}"][data-entry-state="RUNNING"]'
        await expect(watched.page.locator(entry)).to_be_visible()
        victim.kill()
        taken = watched.page.locator(f'li[data-entry-worker="{survivor.worker_id}"]')
        await expect(taken).to_have_attribute("data-entry-state", "SUCCESS", timeout=30_000)
    # The takeover is visible: the surviving entry names the worker it took over from.
    await expect(taken).to_contain_text(victim.worker_id)
    assert await not_reloaded(watched)
    done = await runner.get("victim")
    assert done.workers[-1].took_over == [victim.worker_id]


async def test_cancel_from_the_task_page_stops_the_running_handler(
    runner: TaskRunner,
    dashboard_factory: Callable[..., Dashboard],
    watched: Watched,
    mongo_uri: str,
    collection_name: str,
    tmp_path: Path,
) -> None:
    """With actions allowed and the token presented, the page's cancel button cancels the handler's run."""
    dashboard = dashboard_factory(allow_actions=True)
    await runner.publish("sleep", {"seconds": 60}, key="long")
    with WorkerPool(mongo_uri, collection_name, tmp_path) as pool:
        pool.start("w1")
        await wait_for(lambda: _running_entry(runner, "long"), 30, "the claim")
        await dashboard.log_in(watched.page)
        await watched.page.goto(f"{dashboard.url}/tasks/long")
        await watched.page.locator('button[data-action="cancel"]').click()
        await wait_for(lambda: pool.marks(key="long", event="cancelled"), 30, "the handler to be cancelled")
        await wait_for(lambda: _in_state(runner, "long", TaskState.CANCELED), 30, "CANCELED")
    [mark] = pool.marks(key="long", event="cancelled")
    assert mark["ctx_cancelled"] is True
    assert not pool.marks(key="long", event="finish")
    await expect(watched.page.locator("body")).to_contain_text("CANCELED")
    assert not watched.errors


async def test_markup_in_a_task_renders_as_inert_text(
    runner: TaskRunner,
    dashboard_factory: Callable[..., Dashboard],
    watched: Watched,
    mongo_uri: str,
    collection_name: str,
    tmp_path: Path,
) -> None:
    """Script and javascript: in a task's key, params, error and result show as text: no dialog, no such link."""
    dashboard = dashboard_factory(allow_actions=True)
    await runner.publish("echo", HOSTILE, key=HOSTILE_KEY, allow_unknown=True)
    await runner.publish(
        "explode", {"text": HOSTILE["script"]}, key="xss-error", max_failures=1, allow_unknown=True
    )
    with WorkerPool(mongo_uri, collection_name, tmp_path, app="apps.hostile_app:runner") as pool:
        pool.start("w1")
        await wait_for(lambda: _in_state(runner, HOSTILE_KEY, TaskState.SUCCESS), 30, "the echo")
        await wait_for(lambda: _in_state(runner, "xss-error", TaskState.FAIL), 30, "the failure")
    await dashboard.log_in(watched.page)
    pages = ["/", "/tasks", f"/tasks/{quote(HOSTILE_KEY, safe='')}", "/tasks/xss-error"]
    for path in pages:
        await watched.page.goto(dashboard.url + path)
        await watched.page.wait_for_load_state("networkidle")
        assert await watched.page.locator('a[href^="javascript:" i], [src="x"]').count() == 0, path
    body = watched.page.locator("body")
    await expect(body).to_contain_text(HOSTILE["script"])
    await watched.page.goto(f"{dashboard.url}/tasks/{quote(HOSTILE_KEY, safe='')}")
    for text in [HOSTILE_KEY, *HOSTILE.values()]:
        await expect(body).to_contain_text(text)
    assert watched.dialogs == [], "markup from a document ran"


async def test_an_action_without_the_token_is_refused(
    runner: TaskRunner, dashboard_factory: Callable[..., Dashboard], watched: Watched
) -> None:
    """A cancel posted by the browser gets 403 without the token, with a wrong one, and when actions are off."""
    allowed, read_only = dashboard_factory(allow_actions=True), dashboard_factory()
    await runner.publish("sleep", {"seconds": 60}, key="kept", allow_unknown=True)
    attempts = [(allowed, None), (allowed, "not-the-token"), (read_only, read_only.token)]
    for dashboard, login in attempts:
        if login is not None:
            await dashboard.log_in(watched.page, login)
        await watched.page.goto(f"{dashboard.url}/tasks/kept")
        refused = await watched.page.request.post(
            f"{dashboard.url}/actions/cancel", form={"key": "kept"}, fail_on_status_code=False
        )
        assert refused.status == 403, (dashboard.url, login)
    await expect(watched.page.locator("[data-action]")).to_have_count(0)  # read-only offers none
    assert (await runner.get("kept")).state is TaskState.PENDING


async def _running_entry(runner: TaskRunner, key: str) -> WorkerEntry | None:
    task = await runner.get(key)
    return next((w for w in task.workers if w.state is EntryState.RUNNING), None)


async def _in_state(runner: TaskRunner, key: str, state: TaskState) -> Any:
    task = await runner.get(key)
    return task if task.state is state else None
