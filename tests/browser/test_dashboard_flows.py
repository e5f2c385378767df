"""A flow on the dashboard in headless chromium: the flow page draws the graph and follows the
steps' states live, and a task page follows the tasks that run after it.

The dashboard process starts before the flow is published, so its change stream learns each
task's key from the insert and every later change names its task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import support
from playwright.async_api import Page, expect

from taskrunner import TaskRunner, TaskState
from taskrunner.engine.worker import Worker

from .conftest import Dashboard, Watched

pytestmark = pytest.mark.mongo


async def open_live(page: Page, url: str) -> None:
    """Open ``url``, wait for its live connection, and mark the window to detect any reload."""
    await page.goto(url)
    await expect(page.locator("body")).to_have_attribute("data-live", "on")
    await page.evaluate("window.__notReloaded = true")


async def not_reloaded(page: Page) -> bool:
    return bool(await page.evaluate("window.__notReloaded === true"))


async def run_until(mongo_uri: str, collection: str, names: list[str], key: str, state: TaskState) -> None:
    """A worker in this process with a handler for ``names`` only, run until task ``key`` is in ``state``."""
    runner = TaskRunner(mongo_uri, collection=collection)

    async def ok(params: dict[str, Any], ctx: Any) -> None:
        return None

    for name in names:
        runner.task(name)(ok)

    async def reached() -> bool:
        return (await runner.get(key)).state is state

    async with runner:
        await support.run_until(Worker(runner, worker_id="-".join(names)), reached, within=60)


async def test_flow_page_draws_the_graph_and_shows_each_state_change_live(
    runner: TaskRunner,
    dashboard_factory: Callable[..., Dashboard],
    watched: Watched,
    mongo_uri: str,
    collection_name: str,
) -> None:
    """The flow page draws extract -> 3 transforms -> load as three columns of boxes joined by six
    arrows; as workers run the flow, the boxes change state on the open page; a transform's open
    task page shows load, which runs after it, turn SUCCESS too (a change of load alone)."""
    dashboard = dashboard_factory()
    flow = runner.flow("f")
    extract = flow.add("extract", {})
    parts = flow.group(*[("transform", {"part": n}) for n in range(3)], after=extract)
    flow.add("load", {}, after=parts)
    await flow.publish()

    page = watched.page
    await open_live(page, f"{dashboard.url}/flows/f")
    await expect(page.locator("svg g.node[data-step-key]")).to_have_count(5)
    await expect(page.locator("svg path.edge")).to_have_count(6)
    columns = {}
    for key in ("f/extract", "f/transform", "f/transform-3", "f/load"):
        box = await page.locator(f'g.node[data-step-key="{key}"] rect').bounding_box()
        assert box is not None and box["width"] > 0, key
        columns[key] = box["x"]
    assert columns["f/extract"] < columns["f/transform"] == columns["f/transform-3"] < columns["f/load"]
    load = page.locator('g.node[data-step-key="f/load"]')
    await expect(load).to_have_attribute("data-state", "WAITING")

    # A worker for extract and transform only: load is released, and left PENDING.
    await run_until(mongo_uri, collection_name, ["extract", "transform"], "f/load", TaskState.PENDING)
    await expect(page.locator('g.node[data-step-key="f/extract"]')).to_have_attribute("data-state", "SUCCESS")
    await expect(load).to_have_attribute("data-state", "PENDING")

    task_page = await page.context.new_page()
    await open_live(task_page, f"{dashboard.url}/tasks/f%2Ftransform")
    downstream = task_page.locator('li[data-dependent="f/load"]')
    await expect(downstream).to_contain_text("PENDING")
    await run_until(mongo_uri, collection_name, ["load"], "f/load", TaskState.SUCCESS)
    await expect(downstream).to_contain_text("SUCCESS")
    await expect(load).to_have_attribute("data-state", "SUCCESS")
    await expect(page.locator("[data-flow-state]")).to_have_attribute("data-flow-state", "SUCCESS")
    assert await not_reloaded(page) and await not_reloaded(task_page)
    assert (await runner.get("f/load")).state is TaskState.SUCCESS
    assert watched.errors == [] and watched.dialogs == []
