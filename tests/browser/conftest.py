"""Fixtures of the browser tests: a ``taskrunner dashboard`` process on the test's collection and a
headless Debian chromium page driven by Playwright (never a downloaded browser).

Every test here skips, saying why, when chromium, Playwright or the dashboard extra is missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from taskrunner.dev.processes import LoggedProcess, ProcessGroup, free_port, wait_http, worker_env

if TYPE_CHECKING:
    from playwright.async_api import Browser, Dialog, Page

CHROMIUM_ENV = "TASKRUNNER_CHROMIUM"
"""Path of the chromium binary to drive; default ``chromium`` on PATH, then /usr/bin/chromium."""
TESTS_DIR = Path(__file__).resolve().parents[1]


def chromium_path() -> str | None:
    """The system chromium to drive, if there is one."""
    configured = os.environ.get(CHROMIUM_ENV)
    if configured:
        return configured if Path(configured).exists() else None
    return shutil.which("chromium") or next(
        (p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None
    )


@pytest.fixture(scope="session")
def chromium() -> str:
    """The chromium binary (skips the browser tests without one, or without Playwright/the extra)."""
    pytest.importorskip("playwright.async_api", reason="Playwright is in the dev group: uv sync")
    pytest.importorskip("starlette", reason="the dashboard extra is missing: uv sync / taskrunner[dashboard]")
    path = chromium_path()
    if path is None:
        pytest.skip(f"no chromium: apt-get install -y chromium (.ci/run does), or set {CHROMIUM_ENV}")
    return path


@dataclass
class Dashboard:
    """A running ``taskrunner dashboard`` process."""

    url: str
    token: str
    process: LoggedProcess

    async def log_in(self, page: Page, token: str | None = None) -> None:
        """Open ``/login`` and post the token through its form, as an operator does (the
        token never goes in a URL). A read-only dashboard shows no form: nothing is posted."""
        await page.goto(f"{self.url}/login")
        form = page.locator('form[action="/login"]')
        if await form.count():
            await form.locator('input[name="token"]').fill(self.token if token is None else token)
            async with page.expect_navigation():
                await form.locator('button[type="submit"]').click()


@pytest.fixture
def dashboard_factory(
    chromium: str, mongo_uri: str, collection_name: str, tmp_path: Path
) -> Iterator[Callable[..., Dashboard]]:
    """``start(allow_actions=False)``: a dashboard process on the test's collection, stopped after the test."""
    env = worker_env(mongo_uri, collection=collection_name, python_path=[TESTS_DIR])
    with ProcessGroup(tmp_path / "dashboard", env) as group:

        def start(*, allow_actions: bool = False) -> Dashboard:
            port, token = free_port(), secrets.token_urlsafe(16)
            command = [sys.executable, "-m", "taskrunner", "dashboard", "--port", str(port)]
            name = f"dashboard-{port}"
            process = group.start(
                name,
                [*command, "--allow-actions"] if allow_actions else command,
                env={"TASKRUNNER_DASHBOARD_TOKEN": token},
            )
            url = f"http://127.0.0.1:{port}"
            try:
                wait_http(url + "/", within=30)
            except OSError:
                raise AssertionError(f"the dashboard did not answer:\n{process.tail(40)}") from None
            return Dashboard(url, token, process)

        yield start
        for process in group.processes.values():  # pytest shows it only when the test failed
            print(f"--- {process.name} (exit {process.returncode}) ---", process.tail(40), sep="\n")


@pytest.fixture
async def browser(chromium: str) -> AsyncIterator[Browser]:
    """Headless chromium from the system, launched by Playwright."""
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        yield launched
        await launched.close()


@dataclass
class Watched:
    """A page plus what it must never do: open a dialog (alert/confirm fired by markup) or throw."""

    page: Page
    dialogs: list[str]
    errors: list[str]


@pytest.fixture
async def watched(browser: Browser) -> AsyncIterator[Watched]:
    """A fresh page that records every dialog (and accepts it) and every uncaught page error."""
    context = await browser.new_context()
    page = await context.new_page()
    page.set_default_timeout(15_000)
    watched = Watched(page, [], [])

    async def on_dialog(dialog: Dialog) -> None:
        watched.dialogs.append(f"{dialog.type}: {dialog.message}")
        await dialog.accept()

    page.on("dialog", on_dialog)
    page.on("pageerror", lambda error: watched.errors.append(str(error)))
    yield watched
    await context.close()
