"""Dashboard render time with 10,000 tasks, and the load open pages put on the server.

Starts the embedded server (``taskrunner dev-server --port 0``; ``--uri`` uses a running
one and fills its collection up to ``--tasks``), publishes ``--tasks`` tasks (four names,
some delayed, some canceled), starts ``--workers`` ``taskrunner worker`` processes, then
serves the dashboard (``serve_dashboard``, uvicorn) in a thread of this process on a store
whose commands a ``RoundTripCounter`` counts. Render: each page is fetched over HTTP once
(``<page>_first_ms``: a page or filter nobody opened yet is read before it renders) and then
``--repeat`` times (``<page>_p50_ms``/``<page>_p95_ms``), wall times of whole responses.
Live load: ``--tabs`` headless chromium tabs of each page type (overview, task list, task
page) stay open while a publisher writes ``--rate`` no-op tasks per second for ``--seconds``
and the workers run them; ``live_render_*`` are the overview's and task list's response
times meanwhile, ``live_commands_per_s`` what the dashboard sent the server, and
``change_streams_opened`` the change streams it opened in all; ``*_pending`` count the
responses that were the "being read" placeholder instead of the page's figures (the dashboard's budget: one
change stream and one query per second per open page type, docs/dashboard.md). The live part is skipped
(figures null) without chromium. ``--hog`` keeps both cores busy with two spinning processes
while timing.

    uv run python bench/dashboard.py [--tasks 10000] [--repeat 30] [--tabs 2] [--rate 10]
                                     [--seconds 10] [--workers 2] [--uri URI] [--hog]
                                     [--smoke] [--results PATH]

Publishing 10,000 tasks to the embedded server takes minutes; the rest about one.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import threading
import time
import uuid
from collections import Counter
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from common import add_common_args, emit, percentile
from processes import Processes, dev_server
from pymongo import monitoring
from versus import cpu_hog

from taskrunner import TaskRunner
from taskrunner.dashboard import serve_dashboard
from taskrunner.dev.processes import free_port
from taskrunner.observability.roundtrips import RoundTripCounter
from taskrunner.store.mongo import MongoStore

COLLECTION = "dashboard"
NAMES = ("send_email", "resize_image", "build_report", "charge_card")
LIVE_PAGES = ("/", "/tasks", "/tasks/t00000")
BUDGET_MS = 300.0


class ChangeStreams(monitoring.CommandListener):
    """Counts ``aggregate`` commands that open a change stream."""

    def __init__(self) -> None:
        self.opened = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pipeline = event.command.get("pipeline") if event.command_name == "aggregate" else None
        if pipeline and "$changeStream" in pipeline[0]:
            self.opened += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        return None

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        return None


async def populate(uri: str, tasks: int) -> None:
    """``tasks`` tasks in batches: every tenth delayed a day, every fiftieth canceled
    (from the first missing one: a server given with ``--uri`` may hold them already)."""
    # A generous timeout: a bulk upsert of 250 documents can take seconds on a busy embedded server.
    async with TaskRunner(uri, collection=COLLECTION, timeout=300) as runner:
        await runner.init()
        have = (await runner.store.stats()).counts
        first = sum(sum(counts.values()) for counts in have.values())
        for start in range(first, tasks, 250):
            batch = [
                {"name": NAMES[i % len(NAMES)], "key": f"t{i:05}", "params": {"n": i}}
                | ({"delay": timedelta(days=1)} if i % 10 == 0 else {})
                for i in range(start, min(start + 250, tasks))
            ]
            await runner.publish_many(batch, allow_unknown=True)
        for i in range(1, tasks, 50):
            if i >= first:
                await runner.cancel(f"t{i:05}")


class DashboardThread:
    """``serve_dashboard`` on its own event loop in a thread, its commands counted."""

    def __init__(self, uri: str) -> None:
        self.uri, self.port = uri, free_port()
        self.counter, self.streams = RoundTripCounter(), ChangeStreams()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._serve(),), daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        listeners = [self.counter, self.streams]
        store = MongoStore.connect(self.uri, collection=COLLECTION, timeout=120, event_listeners=listeners)
        async with TaskRunner(self.uri, collection=COLLECTION, store=store) as runner:
            await serve_dashboard(runner, port=self.port)

    def __enter__(self) -> DashboardThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.url + "/", timeout=5)
                return self
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        return None  # a daemon thread: it ends with the process, after the figures are out


def pages(client: httpx.Client) -> dict[str, str]:
    """The pages to time: every route, a filtered list, the second page of the list, fragments."""
    first = client.get("/tasks").text
    after = re.search(r'href="(/tasks\?[^"]*after=[^"]*)"', first)
    found = {
        "overview": "/",
        "overview_fragment": "/?fragment=1",
        "tasks": "/tasks",
        "tasks_filtered": "/tasks?state=PENDING&name=resize_image&prefix=t0",
        "tasks_by_updated": "/tasks?sort=updated",
        "task": "/tasks/t00042",
        "workers": "/workers",
        "schedules": "/schedules",
    }
    if after:
        found["tasks_page2"] = after.group(1).replace("&amp;", "&")
    return found


PENDING: Counter[str] = Counter()  # responses that said "being read" (data-pending), by path


def fetch_ms(client: httpx.Client, path: str) -> float:
    """One whole HTTP response's wall time (ms); anything but 200 is an error. A page whose
    first read outlasted the render budget answers with a placeholder: counted in PENDING."""
    started = time.perf_counter()
    response = client.get(path)
    if response.status_code != 200:
        raise RuntimeError(f"{path} answered {response.status_code}")
    PENDING[path] += "data-pending" in response.text
    return (time.perf_counter() - started) * 1000


def time_pages(url: str, repeat: int) -> dict[str, float]:
    """Each page's first response (``<page>_first_ms``: a page or filter nobody opened yet
    is read before it renders) and p50/p95 of the ``repeat`` after it."""
    figures: dict[str, float] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for name, path in pages(client).items():
            figures[f"{name}_first_ms"] = round(fetch_ms(client, path), 1)
            times = [fetch_ms(client, path) for _ in range(repeat)]
            figures[f"{name}_p50_ms"] = round(percentile(times, 50), 1)
            figures[f"{name}_p95_ms"] = round(percentile(times, 95), 1)
            figures[f"{name}_pending"] = PENDING[path]  # of 1 + repeat responses
    return figures


def time_while_changing(url: str, stop: threading.Event) -> list[float]:
    """Response times of the overview and the task list, fetched in turn until ``stop``."""
    times: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            times += [fetch_ms(client, "/"), fetch_ms(client, "/tasks")]
            time.sleep(0.2)
    return times


async def live_load(dashboard: DashboardThread, args: argparse.Namespace, chromium: str) -> dict[str, Any]:
    """Commands the dashboard sends while ``--tabs`` tabs per page type watch a stream of publishes."""
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium, headless=True, args=["--no-sandbox"]
        )
        tabs = []
        for path in LIVE_PAGES * args.tabs:
            tab = await browser.new_page()
            await tab.goto(dashboard.url + path)
            await tab.wait_for_selector('body[data-live="on"]', timeout=15_000)
            tabs.append(tab)
        opened_before = dashboard.streams.opened
        dashboard.counter.reset()
        started, stop = time.monotonic(), threading.Event()
        pending_before = PENDING["/"] + PENDING["/tasks"]
        timing = asyncio.create_task(asyncio.to_thread(time_while_changing, dashboard.url, stop))
        await publish_stream(dashboard.uri, args.rate, args.seconds)
        elapsed = time.monotonic() - started
        counts = Counter(dashboard.counter.reset())
        stop.set()
        renders = await timing
        await browser.close()
    return {
        "live_pending": PENDING["/"] + PENDING["/tasks"] - pending_before,
        "live_render_p50_ms": round(percentile(renders, 50), 1),
        "live_render_p95_ms": round(percentile(renders, 95), 1),
        "live_commands_per_s": round(sum(counts.values()) / elapsed, 2),
        "live_commands_by_name_per_s": {k: round(v / elapsed, 2) for k, v in sorted(counts.items())},
        "change_streams_opened": dashboard.streams.opened,
        "change_streams_opened_while_live": dashboard.streams.opened - opened_before,
        "open_tabs": len(tabs),
    }


async def publish_stream(uri: str, rate: float, seconds: float) -> None:
    """``noop`` tasks (the worker processes run them) at ``rate`` a second for ``seconds``."""
    run = uuid.uuid4().hex[:6]  # new keys each run, on a server given with --uri too
    async with TaskRunner(uri, collection=COLLECTION, timeout=120) as runner:
        for i in range(int(rate * seconds)):
            await runner.publish("noop", {"n": i}, key=f"live-{run}-{i:05}", allow_unknown=True)
            await asyncio.sleep(1 / rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=30, help="fetches of each page")
    parser.add_argument("--tabs", type=int, default=2, help="open chromium tabs per page type (0: skip)")
    parser.add_argument("--rate", type=float, default=10.0, help="tasks published per second while live")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the live part lasts")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--uri", help="a running server to use (its collection is filled up to --tasks)")
    parser.add_argument("--hog", action="store_true", help="keep both cores busy while timing")
    parser.add_argument("--workers", type=int, default=2, help="worker processes running the live tasks")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.tasks, args.repeat, args.tabs, args.seconds = 200, 3, min(args.tabs, 1), 2.0
    with nullcontext(args.uri) if args.uri else dev_server() as uri:
        asyncio.run(populate(uri, args.tasks))
        live = args.tabs > 0 and Path(args.chromium).exists()
        with DashboardThread(uri) as dashboard, Processes(uri, COLLECTION) as procs, cpu_hog(args.hog):
            for i in range(args.workers if live else 0):  # they run the live part's tasks
                procs.worker(f"w{i}", "--concurrency", "4")
            figures: dict[str, Any] = time_pages(dashboard.url, args.repeat)
            figures |= asyncio.run(live_load(dashboard, args, args.chromium)) if live else {}
    worst = max(v for k, v in figures.items() if k.endswith("_p95_ms"))
    figures |= {"worst_p95_ms": worst, "within_budget": worst < BUDGET_MS}
    config = {
        "tasks": args.tasks,
        "tabs": args.tabs,
        "rate": args.rate,
        "hog": args.hog,
        "workers": args.workers,
    }
    emit("dashboard", config, figures, results=args.results, smoke=args.smoke)


if __name__ == "__main__":
    main()
