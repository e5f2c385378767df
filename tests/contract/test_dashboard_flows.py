"""Workflows on the dashboard over HTTP (no browser): the flow page draws the graph by level with
its steps' states and stays readable for a flow of 10,000 steps; a task page links the tasks it
runs after, those that run after it, and its flow; everything from a document is escaped."""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from taskrunner import MemoryStore, TaskRunner
from taskrunner.dashboard import create_app
from taskrunner.dashboard.flows import (
    BOX_HEIGHT,
    BOX_WIDTH,
    DEPENDENTS_COUNTED,
    LINKED,
    MAX_LEVELS,
    MAX_ROWS,
    PER_LEVEL,
)
from taskrunner.testing import wait_for

XSS_FLOW = "<script>alert('flow')</script>"
XSS_KEY = "x'><script>alert('key')</script>"
NODE = re.compile(
    r'<g class="node state-(\w+)" transform="translate\(([\d.]+),([\d.]+)\)" data-state="\1" '
    r'(?:data-step-key="([^"]*)"|data-rest="(\d+)")>'
)


def app_runner() -> TaskRunner:
    """A memory runner whose ``ok`` handler succeeds and ``boom`` fails at once."""
    runner = TaskRunner(store=MemoryStore())

    @runner.task("ok")
    async def ok(params: dict[str, Any], ctx: Any) -> dict[str, bool]:
        return {"ok": True}

    @runner.task("boom", max_failures=1)
    async def boom(params: dict[str, Any], ctx: Any) -> None:
        raise ValueError("broke")

    return runner


async def publish_fan(runner: TaskRunner, flow_id: str = "f", width: int = 3) -> None:
    """``<flow>/ok`` -> ``width`` steps -> one last step, all of handler ``ok``."""
    flow = runner.flow(flow_id)
    first = flow.add("ok", {})
    middle = flow.group(*[("ok", {"part": i}) for i in range(width)], after=first)
    flow.add("ok", {}, after=middle)
    await flow.publish(allow_unknown=True)


async def run_flow(runner: TaskRunner) -> None:
    """A worker in this process until nothing is left to claim (the flow's steps and compensations)."""
    async with asyncio.timeout(60):
        await runner.run_worker(drain=True, worker_id="w1")


@asynccontextmanager
async def served(runner: TaskRunner, *, live: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """The dashboard over HTTP; ``live``: with its lifespan (the hub follows the store's changes,
    and the overview and task list are read before it serves)."""
    app = create_app(runner)
    transport = httpx.ASGITransport(app=app)
    async with contextlib.AsyncExitStack() as stack:
        if live:
            await stack.enter_async_context(app.router.lifespan_context(app))
        yield await stack.enter_async_context(httpx.AsyncClient(transport=transport, base_url="http://dash"))


async def page_of(http: httpx.AsyncClient, path: str) -> str:
    """The page once read (a page being read first renders a ``data-pending`` placeholder)."""

    async def filled() -> str | None:
        response = await http.get(path)
        assert response.status_code == 200, response.text
        return None if "data-pending" in response.text else response.text

    return await wait_for(filled, 60, f"{path} to be read")


def boxes(page: str) -> dict[str, tuple[str, float, float]]:
    """The graph's boxes of steps: key -> (state, x, y)."""
    return {
        html.unescape(key): (state, float(x), float(y)) for state, x, y, key, _ in NODE.findall(page) if key
    }


def rest_boxes(page: str) -> list[tuple[float, int]]:
    """The boxes standing for the rest of a level: (x, how many steps)."""
    return [(float(x), int(rest)) for _, x, _, key, rest in NODE.findall(page) if not key]


async def test_flow_page_draws_each_level_as_a_column_with_an_arrow_per_dependency() -> None:
    """1 -> 3 -> 1: the first step in the first column, the three in the second, the last in the
    third, each box with its state and a link to its task page; six arrows; the table lists each
    step with its level."""
    runner = app_runner()
    await publish_fan(runner)
    async with served(runner) as http:
        page = await page_of(http, "/flows/f")
    drawn = boxes(page)
    columns = sorted({x for _, x, _ in drawn.values()})
    assert len(columns) == 3
    by_column = {x: sorted(key for key, (_, kx, _) in drawn.items() if kx == x) for x in columns}
    assert list(by_column.values()) == [["f/ok"], ["f/ok-2", "f/ok-3", "f/ok-4"], ["f/ok-5"]]
    assert drawn["f/ok"][0] == "PENDING" and {drawn[k][0] for k in drawn if k != "f/ok"} == {"WAITING"}
    assert page.count('class="edge"') == 6
    for key in drawn:
        assert f'<a href="/tasks/{key.replace("/", "%2F")}">' in page
    levels = dict(re.findall(r'<tr data-step="([^"]+)">.*?<td data-level>(\d+)</td>', page, re.S))
    assert levels == {"f/ok": "1", "f/ok-2": "2", "f/ok-3": "2", "f/ok-4": "2", "f/ok-5": "3"}
    assert 'data-flow-state="RUNNING"' in page and 'data-refresh="any" data-page="flows/f"' in page


async def test_an_arrow_that_passes_a_level_runs_above_every_box() -> None:
    """A step after both the first step and its dependent: the arrow from the first step passes
    the middle column through a lane above every box, the other two go straight to their target."""
    runner = app_runner()
    flow = runner.flow("skip")
    first = flow.add("ok", {}, key="skip/a")
    second = flow.add("ok", {}, key="skip/b", after=[first])
    flow.add("ok", {}, key="skip/c", after=[first, second])
    await flow.publish()
    async with served(runner) as http:
        page = await page_of(http, "/flows/skip")
    drawn = boxes(page)
    top = min(y for _, _, y in drawn.values())
    paths = re.findall(r'<path class="edge" d="([^"]+)"', page)
    assert len(paths) == 3
    [passing] = [path for path in paths if " L" in path]
    middle = top + BOX_HEIGHT / 2  # every box is on the one row: every arrow starts and ends there
    lane = {float(y) for y in re.findall(r"[\d.]+,([\d.]+)", passing)} - {middle}
    assert lane and max(lane) < top, (passing, top)
    start, end = f"M{drawn['skip/a'][1] + BOX_WIDTH:g},{middle:g} ", f" {drawn['skip/c'][1]:g},{middle:g}"
    assert passing.startswith(start) and passing.endswith(end)


async def test_flow_page_shows_new_states_once_a_worker_ran_the_flow() -> None:
    """The page's live fragment (what an open tab fetches on a change) shows every step SUCCESS
    and the flow SUCCESS after a worker ran it, without the page being opened anew."""
    runner = app_runner()
    await publish_fan(runner)
    async with served(runner) as http:
        before = await page_of(http, "/flows/f?fragment=1")
        assert boxes(before)["f/ok-5"][0] == "WAITING"
        await run_flow(runner)

        async def all_succeeded() -> str | None:
            fragment = (await http.get("/flows/f?fragment=1")).text
            states = {state for state, _, _ in boxes(fragment).values()}
            return fragment if states == {"SUCCESS"} else None

        after = await wait_for(all_succeeded, 30, "the fragment to show every step SUCCESS")
    assert 'data-flow-state="SUCCESS"' in after and "<html" not in after


async def test_flow_page_says_why_steps_were_canceled_and_lists_compensations() -> None:
    """A failed step cancels what runs after it (the note names the upstream); a flow with a
    compensation lists it with the step it undoes, and the flow reads COMPENSATED."""
    runner = app_runner()
    saga = runner.flow("saga")
    charge = saga.add("ok", {}, key="saga/charge", compensate=("ok", {"refund": True}))
    ship = saga.add("boom", {}, key="saga/ship", after=[charge])
    saga.add("ok", {}, key="saga/notify", after=[ship])
    await saga.publish()
    await run_flow(runner)
    async with served(runner) as http:
        page = await page_of(http, "/flows/saga")
        task = (await http.get("/tasks/saga%2Fnotify")).text
    assert 'data-flow-state="COMPENSATED"' in page
    notify = re.search(r'<tr data-step="saga/notify">.*?</tr>', page, re.S)
    assert notify is not None and "UpstreamFailed: upstream &#39;saga/ship&#39; ended FAIL" in notify.group(0)
    undo = re.search(r'<tr data-compensation="saga/charge/undo">.*?</tr>', page, re.S)
    assert undo is not None and 'href="/tasks/saga%2Fcharge"' in undo.group(0) and "SUCCESS" in undo.group(0)
    upstream = re.search(r'<li data-upstream="saga/ship">.*?</li>', task, re.S)
    assert upstream is not None and "FAIL" in upstream.group(0) and "canceled this task" in upstream.group(0)


async def test_task_page_links_its_upstream_downstream_and_flow() -> None:
    """A middle step links the task it runs after (waited on), the task that runs after it and
    its flow; the first step says how many run after it; the page refreshes on their changes."""
    runner = app_runner()
    await publish_fan(runner)
    async with served(runner) as http:
        middle = (await http.get("/tasks/f%2Fok-2")).text
        first = (await http.get("/tasks/f%2Fok")).text
    assert '<a href="/flows/f" data-flow-link>f</a>' in middle
    upstream = re.search(r'<li data-upstream="f/ok">(.*?)</li>', middle, re.S)
    assert upstream is not None and 'href="/tasks/f%2Fok"' in upstream.group(1)
    assert "PENDING" in upstream.group(1) and "waited on" in upstream.group(1)
    assert re.search(r'<li data-dependent="f/ok-5"><a href="/tasks/f%2Fok-5">', middle)
    related = re.search(r"data-keys='([^']*)'", middle)
    assert related is not None and json.loads(html.unescape(related.group(1))) == ["f/ok", "f/ok-5"]
    assert "3 tasks run after it" in first
    assert re.findall(r'<li data-dependent="([^"]+)">', first) == ["f/ok-2", "f/ok-3", "f/ok-4"]


async def test_a_flow_of_10000_steps_draws_a_capped_graph_and_says_so() -> None:
    """1 -> 10,000 -> 1: the wide level draws ``PER_LEVEL`` boxes and one counting the rest, the
    page says how many steps it drew and lists the first ``MAX_ROWS``, in a page of bounded size;
    the task pages at either end link the first ``LINKED`` of the 10,000 and count them."""
    runner = app_runner()
    await publish_fan(runner, "big", width=10_000)
    async with served(runner, live=False) as http:
        page = await page_of(http, "/flows/big")
        root = (await http.get("/tasks/big%2Fok")).text
        fan_in = (await http.get("/tasks/big%2Fok-10002")).text
    assert len(re.findall(r'<li data-dependent="', root)) == LINKED
    assert f"{DEPENDENTS_COUNTED} or more tasks run after it; the first {LINKED}:" in root
    assert len(re.findall(r'<li data-upstream="', fan_in)) == LINKED
    counted = re.search(r"runs after 10000 tasks: 10000 <span[^>]*>WAITING</span>", fan_in)
    assert counted is not None and f"<li>and {10_000 - LINKED} more</li>" in fan_in
    assert len(boxes(page)) == PER_LEVEL + 2
    assert [count for _, count in rest_boxes(page)] == [10_000 - PER_LEVEL]
    assert f"Drawn: {PER_LEVEL + 2} of 10002 steps in boxes of their own." in page
    assert page.count("<tr data-step=") == MAX_ROWS and f"the first {MAX_ROWS} of 10002" in page
    assert len(page) < 300_000


async def test_a_flow_deeper_than_the_drawing_draws_its_first_levels_and_says_so() -> None:
    """A chain longer than ``MAX_LEVELS`` draws that many columns and names how many it has."""
    runner = app_runner()
    chain = runner.flow("deep")
    chain.chain(*[("ok", {"n": n}) for n in range(MAX_LEVELS + 5)])
    await chain.publish()
    async with served(runner) as http:
        page = await page_of(http, "/flows/deep")
    assert len({x for _, x, _ in boxes(page).values()}) == MAX_LEVELS
    assert f"only the first {MAX_LEVELS} of {MAX_LEVELS + 5} levels are drawn" in page
    assert page.count("<tr data-step=") == MAX_LEVELS + 5


async def test_an_unknown_flow_is_a_404_until_it_is_published() -> None:
    """A flow id no task has answers 404 naming it; once published, the same URL draws it."""
    runner = app_runner()
    async with served(runner) as http:
        missing = await http.get("/flows/later")
        assert missing.status_code == 404 and "no flow with id &#39;later&#39;" in missing.text
        await publish_fan(runner, "later")
        page = await page_of(http, "/flows/later")
    assert len(boxes(page)) == 5


async def test_markup_in_flow_ids_and_keys_renders_as_text() -> None:
    """A flow id and step keys holding <script> and quotes render escaped on the flow page and
    the task page (the related keys' JSON too), and every link is to a quoted path."""
    runner = app_runner()
    flow = runner.flow(XSS_FLOW)
    first = flow.add("ok", {}, key=XSS_KEY)
    flow.add("ok", {}, key="javascript:alert(1)", after=[first])
    await flow.publish()
    quoted = "%3Cscript%3Ealert%28%27flow%27%29%3C%2Fscript%3E"
    async with served(runner) as http:
        pages = [
            await page_of(http, f"/flows/{quoted}"),
            (await http.get("/tasks/x%27%3E%3Cscript%3Ealert%28%27key%27%29%3C%2Fscript%3E")).text,
            (await http.get("/tasks/javascript%3Aalert%281%29")).text,
        ]
    for page in pages:
        assert "<script>alert" not in page
        assert not re.search(r'(href|src|action)="\s*javascript:', page)
        assert "&lt;script&gt;" in page
    assert boxes(pages[0]) == {
        XSS_KEY: ("PENDING", 10.0, 10.0),
        "javascript:alert(1)": ("WAITING", 210.0, 10.0),
    }
    related = re.search(r"data-keys='([^']*)'", pages[1])
    assert related is not None and json.loads(html.unescape(related.group(1))) == ["javascript:alert(1)"]
