"""Screenshots of every dashboard page, light and dark, into docs/dashboard/*.png.

Rerun it any time the pages change::

    uv run python scripts/screenshots.py            # embedded server, Debian chromium
    uv run python scripts/screenshots.py --out /tmp/shots --chromium /usr/bin/chromium

It starts the embedded server, two ``taskrunner worker`` processes running this very
module's ``runner`` (sample handlers, a rate limit, two schedules), publishes sample
tasks and waits until they settle into every state, then starts ``taskrunner dashboard``
and photographs each page with chromium emulating ``prefers-color-scheme`` light and
dark. Nothing is fetched from the internet; Playwright drives the system chromium.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from taskrunner import Fail, TaskContext, TaskRunner, TaskState
from taskrunner.dev.processes import ProcessGroup, free_port, wait_http, worker_env

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "dashboard"
APP = "screenshots:runner"
SCHEMES: tuple[Literal["light", "dark"], ...] = ("light", "dark")
RUNNING_KEY = "report-2026-11"

runner = TaskRunner()


class Work(BaseModel):
    seconds: float = 0.1
    fraction: float | None = None


@runner.task("send_email", rate_limit="20/s")
async def send_email(params: Work, ctx: TaskContext) -> dict[str, Any]:
    await asyncio.sleep(params.seconds)
    return {"delivered": True, "worker": ctx.worker_id}


@runner.task("build_report", max_running=2)
async def build_report(params: Work, ctx: TaskContext) -> dict[str, Any]:
    """Reports progress, then works for a long time (the screenshots catch it running)."""
    if params.fraction is not None:
        await ctx.progress(params.fraction, "rendering pages")
    await asyncio.sleep(params.seconds)
    return {"pages": 12}


@runner.task("charge_card")
async def charge_card(params: Work, ctx: TaskContext) -> None:
    raise Fail("card declined: insufficient funds")


@runner.task("resize_image")
async def resize_image(params: Work, ctx: TaskContext) -> dict[str, int]:
    await asyncio.sleep(params.seconds)
    return {"width": 640, "height": 480}


runner.schedule("build_report", id="nightly-report", cron="0 2 * * *", params={"seconds": 1})
runner.schedule("send_email", id="digest", every=timedelta(minutes=15), params={"seconds": 0.1})


async def publish_samples(publisher: TaskRunner) -> None:
    """Tasks that end in every state: done, failed, running with progress, waiting, canceled."""
    for i in range(24):
        await publisher.publish("send_email", {"seconds": 0.05}, key=f"email-{i:03d}")
    for i in range(6):
        await publisher.publish("resize_image", {"seconds": 0.2}, key=f"image-{i:03d}")
    for i in range(3):
        await publisher.publish("charge_card", {}, key=f"order-{1041 + i}", max_failures=1)
    await publisher.publish("build_report", {"seconds": 3600, "fraction": 0.4}, key=RUNNING_KEY)
    await publisher.publish("build_report", {"seconds": 1}, key="report-later", delay=timedelta(hours=6))
    await publisher.publish("resize_image", {"seconds": 1}, key="image-canceled", delay=timedelta(hours=1))
    await publisher.cancel("image-canceled")


async def settle(publisher: TaskRunner, within: float = 60) -> None:
    """Wait until the samples that finish have finished and the long report runs with its progress."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        stats = await publisher.stats()
        report = await publisher.get(RUNNING_KEY)
        finished = sum(
            by_state.get("SUCCESS", 0) + by_state.get("FAIL", 0) for by_state in stats.counts.values()
        )
        if finished >= 33 and report.state is TaskState.RUNNING and any(w.progress for w in report.workers):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("the sample tasks did not settle within a minute")


async def photograph(base: str, chromium: str, out: Path) -> list[Path]:
    """One full-page PNG per page and colour scheme."""
    from playwright.async_api import async_playwright

    pages = {
        "overview": "/",
        "tasks": "/tasks",
        "task": f"/tasks/{RUNNING_KEY}",
        "workers": "/workers",
        "schedules": "/schedules",
    }
    written = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=chromium, headless=True, args=["--no-sandbox"]
        )
        for scheme in SCHEMES:
            context = await browser.new_context(color_scheme=scheme, viewport={"width": 1280, "height": 800})
            page = await context.new_page()
            for name, path in pages.items():
                await page.goto(base + path)
                await page.wait_for_load_state("networkidle")
                target = out / f"{name}-{scheme}.png"
                await page.screenshot(path=str(target), full_page=True)
                written.append(target)
            await context.close()
        await browser.close()
    return written


async def run(uri: str, chromium: str, out: Path, logs: Path) -> list[Path]:
    collection = "tasks"
    env = worker_env(uri, collection=collection, python_path=[Path(__file__).parent])
    async with TaskRunner(uri, collection=collection) as publisher:
        await publisher.init()
        with ProcessGroup(logs, env) as group:
            for worker_id in ("worker-a", "worker-b"):
                group.worker(worker_id, APP, "--concurrency", "4")
            await publish_samples(publisher)
            await settle(publisher)
            await publisher.pause("resize_image")
            port = free_port()
            command = [sys.executable, "-m", "taskrunner", "dashboard", "--port", str(port)]
            dashboard = group.start("dashboard", command)
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/", dashboard)
            return await photograph(f"http://127.0.0.1:{port}", chromium, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=OUT, help="directory for the PNG files")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--uri", help="a MongoDB URI to use instead of a fresh embedded server")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="taskrunner-shots-") as logs:
        if args.uri:
            written = asyncio.run(run(args.uri, args.chromium, args.out, Path(logs)))
        else:
            from taskrunner.dev.server import ServerThread

            with ServerThread() as server:
                written = asyncio.run(run(server.uri, args.chromium, args.out, Path(logs)))
    for path in written:
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


if __name__ == "__main__":
    main()
