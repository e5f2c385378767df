"""The dashboard over HTTP (no browser): pages, filters and paging, escaping, the action
token and CSRF, and live events from the one change stream (tests/browser/
drives a real browser)."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from taskrunner.dashboard import create_app, serve_dashboard
from taskrunner.dashboard.hub import Hub
from taskrunner.dashboard.server import exposure_warning
from taskrunner.dashboard.snapshots import EXPIRES_IN, Snapshots
from taskrunner.errors import NoLiveWorkerWarning, StoreError
from taskrunner.models import TaskState, WorkerInfo
from taskrunner.runner import TaskRunner
from taskrunner.store import fields as f
from taskrunner.store.base import ChangeStream, Listed, Listing, Store
from taskrunner.store.memory import MemoryStore
from taskrunner.store.mongo import MongoStore
from taskrunner.testing import ManualClock, wait_for

TOKEN = "secret-token"
PAGES = ["/", "/tasks", "/workers", "/schedules", "/tasks?state=PENDING&sort=updated"]
XSS = "<script>alert(1)</script>"
XSS_KEY = "javascript:alert(1)//<script>x</script>"


class Text(BaseModel):
    text: str = ""


def app_runner(store: MemoryStore | None = None) -> TaskRunner:
    """A memory runner whose ``ok`` handler returns its text and ``boom`` fails with it."""
    runner = TaskRunner(store=store or MemoryStore())

    @runner.task("ok")
    async def ok(params: Text, ctx: Any) -> dict[str, str]:
        return {"echo": params.text}

    @runner.task("boom", max_failures=1)
    async def boom(params: Text, ctx: Any) -> None:
        raise ValueError(params.text)

    return runner


async def populate(runner: TaskRunner) -> None:
    """Tasks in every finished state plus a pending one, an XSS payload in each field."""
    await runner.publish("ok", Text(text=XSS), key=XSS_KEY)
    await runner.publish("boom", Text(text="javascript:alert(2)" + XSS), key="fails")
    await runner.publish("ok", key="canceled")
    await runner.cancel("canceled")
    async with asyncio.timeout(30):
        await runner.run_worker(drain=True, worker_id="w1")
    await runner.publish("ok", key="pending", delay=3600)
    await runner.pause("boom", force=True)  # no worker is live here: the test means it
    await runner.store.beat(worker_info("w2"), 60)


def worker_info(worker_id: str) -> WorkerInfo:
    now = datetime.now(UTC)
    return WorkerInfo(worker_id=worker_id, host="h<b>", pid=1, started_at=now, names=["ok"], concurrency=2)


def client(runner: TaskRunner, **options: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(runner, **options))
    return httpx.AsyncClient(transport=transport, base_url="http://dash")


@pytest.fixture
async def populated() -> TaskRunner:
    runner = app_runner()
    await populate(runner)
    return runner


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "no CSRF field on the page"
    return found.group(1)


@pytest.mark.parametrize("path", PAGES)
async def test_every_page_renders_on_an_empty_store(path: str) -> None:
    """Each page answers 200 with no tasks, workers, schedules or limits."""
    async with client(TaskRunner(store=MemoryStore())) as http:
        response = await http.get(path)
    assert response.status_code == 200
    assert "<main" in response.text


@pytest.mark.parametrize("path", [*PAGES, "/tasks/fails", "/tasks/canceled", "/tasks/pending"])
async def test_every_page_renders_on_a_populated_store(populated: TaskRunner, path: str) -> None:
    """Each page (task pages included) answers 200 with tasks in every state."""
    async with client(populated) as http:
        response = await http.get(path)
    assert response.status_code == 200


async def test_overview_counts_each_state(populated: TaskRunner) -> None:
    """The overview has one count cell per state holding that state's number of tasks."""
    async with client(populated) as http:
        page = (await http.get("/")).text
    counts = dict(re.findall(r'<td data-count-state="(\w+)">(\d+)</td>', page))
    assert counts == {
        "WAITING": "0",
        "PENDING": "1",
        "RUNNING": "0",
        "SUCCESS": "1",
        "FAIL": "1",
        "CANCELED": "1",
    }
    assert "data-workers>1<" in page


async def test_fragment_is_the_page_body_alone(populated: TaskRunner) -> None:
    """``?fragment=1`` returns the main content without the page around it (for live swaps)."""
    async with client(populated) as http:
        fragment = (await http.get("/?fragment=1")).text
    assert 'data-count-state="SUCCESS"' in fragment
    assert "<html" not in fragment and "<main" not in fragment


async def test_task_page_shows_runs_error_and_result(populated: TaskRunner) -> None:
    """The task page lists each run with its worker and state, the error and traceback."""
    async with client(populated) as http:
        page = (await http.get("/tasks/fails")).text
    assert '<li data-entry-worker="w1" data-entry-state="FAIL">' in page
    assert "ValueError" in page and "Traceback" in page


async def test_unknown_task_is_a_404(populated: TaskRunner) -> None:
    """A key nobody published answers 404 with the error page."""
    async with client(populated) as http:
        response = await http.get("/tasks/nobody")
    assert response.status_code == 404


@pytest.mark.parametrize("path", ["/", "/tasks", f"/tasks/{XSS_KEY.replace('/', '%2F')}", "/tasks/fails"])
async def test_document_values_render_as_text(populated: TaskRunner, path: str) -> None:
    """Keys, params, errors and results holding <script> and javascript: render escaped, and
    no link target comes from a document unquoted."""
    async with client(populated) as http:
        page = (await http.get(path)).text
    assert "<script>alert" not in page and "<script>x" not in page
    assert not re.search(r'(href|src|action)="\s*javascript:', page)
    assert "&lt;script&gt;" in page or path == "/"


async def test_xss_key_links_to_its_page(populated: TaskRunner) -> None:
    """The task list links the XSS key by its quoted path, and that link opens its page."""
    async with client(populated) as http:
        listing = (await http.get("/tasks")).text
        link = re.search(r'href="(/tasks/javascript[^"]+)"', listing)
        assert link is not None
        page = await http.get(link.group(1))
    assert page.status_code == 200
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text


async def test_task_list_filters_by_state_name_prefix_and_worker(populated: TaskRunner) -> None:
    """Each filter narrows the list to the tasks it names."""
    cases = {
        "state=FAIL": {"fails"},
        "name=boom": {"fails"},
        "prefix=can": {"canceled"},
        "worker=w1": {XSS_KEY, "fails"},
        "state=SUCCESS&worker=w2": set(),
    }
    async with client(populated) as http:
        for query, keys in cases.items():
            page = (await http.get(f"/tasks?{query}")).text
            assert listed(page) == keys, query


def listed(page: str) -> set[str]:
    import html

    return {html.unescape(key) for key in re.findall(r'<tr data-task-key="([^"]*)"', page)}


async def test_task_list_pages_by_position_without_repeats() -> None:
    """120 tasks: three pages of at most 50, newest first, each task exactly once."""
    runner = TaskRunner(store=MemoryStore())
    await runner.publish_many([{"name": "ok", "key": f"k{i:03}"} for i in range(120)], allow_unknown=True)
    seen: list[str] = []
    path: str | None = "/tasks?sort=created"
    async with client(runner) as http:
        while path is not None:
            page = (await http.get(path)).text
            seen += re.findall(r'<tr data-task-key="([^"]*)"', page)
            following = re.search(r'href="(/tasks\?[^"]*)" rel="next"', page)
            path = following.group(1).replace("&amp;", "&") if following else None
    assert seen == [f"k{i:03}" for i in reversed(range(120))]


async def test_schedules_page_shows_the_rate_used_in_the_last_period() -> None:
    """A rate-limited name shows how many of its lanes started within the last period, on
    its busiest gate (lanes whose next start is still ahead of the server's clock)."""
    store = MemoryStore()
    runner = TaskRunner(store=store)
    await store.declare_limits("call_api", {"rate_limit": "3/s"})
    now = await store.server_time()
    lanes = [{"next": now + timedelta(seconds=0.5)}, {"next": now - timedelta(seconds=1)}, {}]
    await store.update_gate('call_api#"acme"', {}, {"name": "call_api", "lanes": lanes}, create=True)
    await store.update_gate('call_api#"zeta"', {}, {"name": "call_api", "lanes": [{}, {}, {}]}, create=True)
    async with client(runner) as http:
        page = (await http.get("/schedules")).text
    cell = re.search(r'<td data-rate-use="call_api">([^<]*)</td>', page)
    assert cell is not None and cell.group(1) == "1 / 3 (busiest of 2 gates)"


async def test_bad_filter_is_a_400() -> None:
    """An unknown state, sort or cursor answers 400, not a stack trace."""
    async with client(TaskRunner(store=MemoryStore())) as http:
        for query in (
            "state=DONE",
            "sort=key",
            "after=yesterday",
            "sort=failed",
            "state=SUCCESS&sort=failed",
        ):
            assert (await http.get(f"/tasks?{query}")).status_code == 400, query


async def test_failed_view_lists_failed_tasks_newest_failed_first_with_their_errors() -> None:
    """``/tasks?state=FAIL&sort=failed`` (the nav's Failed link) lists FAIL tasks, the latest
    failure first, each with its last error; other states are not in it."""
    clock = ManualClock()
    runner = app_runner(MemoryStore(clock=clock))
    for key in ("early", "late"):
        await runner.publish("boom", Text(text=f"{key} broke"), key=key)
        async with asyncio.timeout(30):
            await runner.run_worker(drain=True, worker_id="w1")
        clock.advance(60)
    await runner.publish("ok", key="fine")
    async with client(runner) as http:
        overview = (await http.get("/")).text
        page = (await http.get("/tasks?state=FAIL&sort=failed")).text
    assert 'href="/tasks?state=FAIL&amp;sort=failed"' in overview
    assert re.findall(r'<tr data-task-key="([^"]+)">', page) == ["late", "early"]
    assert "ValueError: late broke" in page and 'value="failed" selected' in page


async def test_browse_pages_newest_first_on_each_store(store: Store) -> None:
    """``Store.browse`` on memory and MongoDB: newest created first, ties by key, keyset paging."""
    runner = TaskRunner(store=store)
    await runner.publish_many([{"name": "ok", "key": f"b{i}"} for i in range(5)], allow_unknown=True)
    first = await store.browse(Listing(key_prefix="b", limit=3))
    assert first.after == (first.tasks[-1].created_at, first.tasks[-1].key)
    rest = await store.browse(Listing(key_prefix="b", limit=3, after=first.after))
    assert rest.after is None
    order = [(t.created_at, t.key) for t in first.tasks + rest.tasks]
    assert order == sorted(order, reverse=True)
    assert sorted(key for _, key in order) == [f"b{i}" for i in range(5)]
    assert [t.key for t in (await store.browse(Listing(sort=f.UPDATED_AT, key_prefix="b4"))).tasks] == ["b4"]


@pytest.mark.parametrize("sort", [f.CREATED_AT, f.UPDATED_AT])
async def test_browse_pages_past_documents_whose_sort_value_is_not_a_date(store: Store, sort: str) -> None:
    """Pages of one task each list every document once: dates newest first, then those
    whose sort value is not a date (missing, null, text, a number) by key descending. On
    MongoDB a range on a date matches only dates (type bracketing), so a cursor on dates
    alone would drop those from page 2 on, which a server matching such ranges loosely hides."""
    runner = TaskRunner(store=store)
    await runner.publish_many([{"name": "ok", "key": f"d{i}"} for i in range(3)], allow_unknown=True)
    odd: dict[str, Any] = {"n-null": None, "n-text": "yesterday", "n-num": 5, "n-missing": ...}
    for key, value in odd.items():
        doc = {"key": key, "name": "ok", "state": "PENDING"}
        doc |= {} if value is ... else {f.CREATED_AT: value, f.UPDATED_AT: value}
        if isinstance(store, MemoryStore):
            store.insert_document(doc)
        else:
            assert isinstance(store, MongoStore)
            await store.collection.insert_one(doc)
    keys: list[str] = []
    page = await store.browse(Listing(sort=sort, limit=1))
    while page.after is not None:
        keys += [t.key for t in page.tasks]
        assert len(keys) < 10, "the listing does not progress"
        page = await store.browse(Listing(sort=sort, limit=1, after=page.after))
    keys += [t.key for t in page.tasks]
    assert keys == ["d2", "d1", "d0", "n-text", "n-num", "n-null", "n-missing"]


async def test_read_only_shows_no_buttons_and_refuses_actions(populated: TaskRunner) -> None:
    """Without allow_actions no page has an action button and every action answers 403."""
    async with client(populated) as http:
        pages = [(await http.get(path)).text for path in [*PAGES, "/tasks/pending"]]
        refused = await http.post("/actions/cancel", data={"key": "pending", "token": TOKEN})
        login = await http.get(f"/login?token={TOKEN}")
    assert not any("data-action=" in page for page in pages)
    assert refused.status_code == 403 and login.status_code == 403
    assert (await populated.get("pending")).state is TaskState.PENDING


async def test_action_without_token_is_refused(populated: TaskRunner) -> None:
    """Actions allowed, but no token: no buttons, and a POST with a CSRF token answers 403."""
    async with client(populated, allow_actions=True, token=TOKEN) as http:
        page = (await http.get("/tasks/pending")).text
        csrf = http.cookies["taskrunner_csrf"]
        response = await http.post("/actions/cancel", data={"key": "pending", "csrf": csrf})
    assert "data-action=" not in page
    assert response.status_code == 403
    assert (await populated.get("pending")).state is TaskState.PENDING


async def test_action_with_token_but_without_csrf_is_refused(populated: TaskRunner) -> None:
    """The token cookie alone (a cross-site form would carry it) is not enough: 403."""
    async with client(populated, allow_actions=True, token=TOKEN) as http:
        await log_in(http)
        missing = await http.post("/actions/cancel", data={"key": "pending"})
        wrong = await http.post("/actions/cancel", data={"key": "pending", "csrf": "guess"})
    assert missing.status_code == 403 and wrong.status_code == 403
    assert (await populated.get("pending")).state is TaskState.PENDING


async def log_in(http: httpx.AsyncClient, token: str = TOKEN) -> httpx.Response:
    """Open the login form and post the token with the form's CSRF token, as a browser does."""
    form = await http.get("/login")
    return await http.post("/login", data={"token": token, "csrf": csrf_of(form.text)})


async def test_wrong_token_does_not_log_in(populated: TaskRunner) -> None:
    """The login form posted with another token answers 403 and sets no token cookie."""
    async with client(populated, allow_actions=True, token=TOKEN) as http:
        response = await log_in(http, "nope")
    assert response.status_code == 403
    assert "taskrunner_token" not in response.headers.get("set-cookie", "")


async def test_login_takes_the_token_from_a_posted_form_never_from_the_url(populated: TaskRunner) -> None:
    """A token in ``/login``'s URL logs nobody in (it would land in logs and history); the
    posted form with its CSRF token sets an HttpOnly, SameSite=Strict cookie that acts."""
    async with client(populated, allow_actions=True, token=TOKEN) as http:
        in_url = await http.get(f"/login?token={TOKEN}")
        assert in_url.status_code == 400 and "taskrunner_token" not in http.cookies
        assert 'name="token"' in in_url.text and "never accepted" in in_url.text
        forged = await http.post("/login", data={"token": TOKEN, "csrf": "guess"})
        assert forged.status_code == 403 and "taskrunner_token" not in http.cookies
        response = await log_in(http)
        cookie = response.headers["set-cookie"].lower()
        page = (await http.get("/tasks/pending")).text
        cancel = await http.post("/actions/cancel", data={"key": "pending", "csrf": csrf_of(page)})
    assert response.status_code == 303 and response.headers["location"] == "/"
    assert cookie.startswith("taskrunner_token=") and "httponly" in cookie and "samesite=strict" in cookie
    assert TOKEN not in response.headers["location"]
    assert cancel.status_code == 303
    assert (await populated.get("pending")).state is TaskState.CANCELED


async def test_served_dashboard_prints_no_token_in_a_url(capsys: pytest.CaptureFixture[str]) -> None:
    """With actions, the printed login address carries no token; a made-up token is printed
    on its own line, one from the environment not at all."""
    for given in (None, TOKEN):
        serving = asyncio.create_task(
            serve_dashboard(TaskRunner(store=MemoryStore()), port=0, allow_actions=True, token=given)
        )
        try:
            out = await printed(capsys, "action token:")
        finally:
            serving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await serving
        urls = re.findall(r"http://\S+", out)
        assert urls and all("token" not in url for url in urls), out
        line = re.search(r"action token: (.+)", out)
        assert line is not None, out
        if given is None:
            assert re.fullmatch(r"[\w-]{20,}", line.group(1)), out  # the made-up one, to paste
        else:
            assert TOKEN not in out


async def test_action_with_token_and_csrf_cancels_the_task(populated: TaskRunner) -> None:
    """Logged in with the token, the page's cancel form cancels the task."""
    async with client(populated, allow_actions=True, token=TOKEN) as http:
        await log_in(http)
        page = (await http.get("/tasks/pending")).text
        assert '<button type="submit" data-action="cancel">' in page
        response = await http.post("/actions/cancel", data={"key": "pending", "csrf": csrf_of(page)})
    assert response.status_code == 303 and response.headers["location"] == "/tasks/pending"
    assert (await populated.get("pending")).state is TaskState.CANCELED


async def test_pause_and_resume_actions(populated: TaskRunner) -> None:
    """Resume and pause from the schedules page call the runner's pause and resume."""
    async with client(populated, allow_actions=True, token=TOKEN) as http:
        await log_in(http)
        csrf = csrf_of((await http.get("/schedules")).text)
        await http.post("/actions/resume", data={"name": "boom", "csrf": csrf})
        assert await populated.paused() == []
        await http.post("/actions/pause", data={"name": "ok", "csrf": csrf})
    assert await populated.paused() == ["ok"]


async def test_action_on_a_finished_task_is_a_400(populated: TaskRunner) -> None:
    """Cancelling a task that succeeded is refused by the runner: an error page, not a crash."""
    async with client(populated, allow_actions=True, token=TOKEN) as http:
        await log_in(http)
        csrf = csrf_of((await http.get("/tasks/pending")).text)
        response = await http.post("/actions/cancel", data={"key": XSS_KEY, "csrf": csrf})
    assert response.status_code == 400
    assert "&lt;script&gt;" in response.text and "<script>x" not in response.text


async def test_credentials_in_the_uri_are_never_shown() -> None:
    """The header names the server with the URI's user and password redacted."""
    runner = TaskRunner("mongodb://admin:hunter2@db.example:27017", store=MemoryStore())
    async with client(runner) as http:
        page = (await http.get("/")).text
    assert "hunter2" not in page and "admin:" not in page
    assert "mongodb://***@db.example:27017" in page


async def test_hub_fans_one_stream_out_to_every_subscriber() -> None:
    """Two subscribers each get the change; a full queue drops its oldest message."""
    store = WatchedStore()
    hub = Hub(store, queue_size=2)
    first, second = hub.subscribe(), hub.subscribe()
    following = asyncio.create_task(hub.run())
    try:
        await asyncio.wait_for(store.watching.wait(), 10)
        await TaskRunner(store=store).publish("ok", key="a", allow_unknown=True)
        message = await asyncio.wait_for(first.get(), 5)
        assert '"key": "a"' in message
        assert await asyncio.wait_for(second.get(), 5) == message
    finally:
        following.cancel()
    for n in range(3):
        hub.publish(str(n))
    assert [first.get_nowait(), first.get_nowait()] == ["1", "2"]


async def test_served_dashboard_streams_a_change_to_the_browser(capsys: pytest.CaptureFixture[str]) -> None:
    """``serve_dashboard`` on a free port prints its URL; /events sends ``open``, then a
    ``change`` naming the task a publish wrote."""
    runner = TaskRunner(store=MemoryStore())
    serving = asyncio.create_task(serve_dashboard(runner, port=0))
    try:
        url = await printed_url(capsys)
        async with httpx.AsyncClient(base_url=url) as http, http.stream("GET", "/events") as events:
            lines = events.aiter_lines()
            assert await anext(lines) == "event: open"
            await runner.publish("ok", key="live", allow_unknown=True)
            async with asyncio.timeout(5):
                async for line in lines:
                    if line.startswith("data:") and '"live"' in line:
                        break
    finally:
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving


async def printed(capsys: pytest.CaptureFixture[str], text: str) -> str:
    """Everything printed until ``text`` was."""
    out: list[str] = []

    def seen() -> bool:
        out.append(capsys.readouterr().out)
        return text in "".join(out)

    await wait_for(seen, 10, f"{text!r} to be printed")
    return "".join(out)


async def printed_url(capsys: pytest.CaptureFixture[str]) -> str:
    found = re.search(r"dashboard: (http://\S+)", await printed(capsys, "dashboard: http://"))
    assert found is not None
    return found.group(1)


class WatchedStore(MemoryStore):
    """A memory store that says when a change stream was opened on it."""

    def __init__(self) -> None:
        super().__init__()
        self.watching = asyncio.Event()

    async def watch(self, **kwargs: Any) -> ChangeStream:
        stream = await super().watch(**kwargs)
        self.watching.set()
        return stream


def test_binding_beyond_loopback_warns() -> None:
    """Loopback addresses bind quietly; anything else gets the loud warning."""
    assert exposure_warning("127.0.0.1") is None and exposure_warning("localhost") is None
    warning = exposure_warning("0.0.0.0")
    assert warning is not None and warning.startswith("WARNING")


class Counted:
    """A page read that counts its calls (and fails when told to)."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.fail:
            raise StoreError("server away")
        return {"n": self.calls}


def data(snapshot: dict[str, Any] | None) -> dict[str, Any]:
    assert snapshot is not None, "no snapshot"
    return {k: v for k, v in snapshot.items() if k not in ("as_of", "refreshing")}


async def test_tabs_share_one_read_of_a_page() -> None:
    """However many tabs ask at once, a page with no snapshot is read once."""
    read = Counted()
    snapshots = Snapshots(lambda: 0)
    results = await asyncio.gather(*(snapshots.get("overview", read) for _ in range(5)))
    assert [data(r) for r in results] == [{"n": 1}] * 5 and read.calls == 1
    assert data(await snapshots.get("overview", read)) == {"n": 1} and read.calls == 1


async def test_after_a_change_the_old_snapshot_renders_and_a_fresh_one_is_announced() -> None:
    """A request after a change gets the last snapshot at once, one background read starts,
    and when it lands the page is announced fresh and served from then on."""
    changes, fresh, read = [0], asyncio.Queue[str](), Counted()
    snapshots = Snapshots(lambda: changes[0], fresh.put_nowait, fresh_for=0.0)
    await snapshots.get("overview", read)
    assert await fresh.get() == "overview"  # the first read announces itself too
    changes[0] += 1
    stale = await snapshots.get("overview", read)
    assert data(stale) == {"n": 1} and stale is not None and stale["refreshing"] is True
    assert await asyncio.wait_for(fresh.get(), 10) == "overview"
    assert data(await snapshots.get("overview", read)) == {"n": 2} and read.calls == 2


async def test_re_reads_are_spaced_by_fresh_for() -> None:
    """Changes in a burst cause one re-read per ``fresh_for``, not one per change or request."""
    changes, fresh, read = [0], asyncio.Queue[str](), Counted()
    snapshots = Snapshots(lambda: changes[0], fresh.put_nowait, fresh_for=0.5)
    await snapshots.get("overview", read)
    await fresh.get()
    started = asyncio.get_running_loop().time()
    for _ in range(10):
        changes[0] += 1
        await snapshots.get("overview", read)
    await asyncio.wait_for(fresh.get(), 10)
    assert read.calls == 2
    assert asyncio.get_running_loop().time() - started >= 0.4  # waited out the first read's gap


async def test_a_slow_first_read_renders_as_being_read_and_is_announced() -> None:
    """A page whose first read outlasts ``within`` comes back as None at once (the page says
    it is being read); the read goes on, is announced fresh, and then serves the page."""
    fresh, release = asyncio.Queue[str](), asyncio.Event()

    async def slow() -> dict[str, Any]:
        await release.wait()
        return {"n": 1}

    snapshots = Snapshots(lambda: 0, fresh.put_nowait)
    assert await snapshots.get("tasks?state=FAIL", slow, within=0.05) is None
    release.set()
    assert await asyncio.wait_for(fresh.get(), 10) == "tasks?state=FAIL"
    assert data(await snapshots.get("tasks?state=FAIL", slow, within=0.05)) == {"n": 1}


async def test_a_page_being_read_renders_a_placeholder_the_script_fills_in() -> None:
    """Over HTTP, a list whose read takes longer than the render budget answers 200 at once
    with a ``data-pending`` placeholder for its page; once read, the same URL shows the tasks."""
    store = MemoryStore()
    runner = TaskRunner(store=store)
    await runner.publish("ok", {}, key="slow-1", allow_unknown=True)
    release = asyncio.Event()
    browse = store.browse

    async def slow_browse(listing: Listing) -> Listed:
        await release.wait()
        return await browse(listing)

    store.browse = slow_browse  # type: ignore[method-assign]
    async with client(runner) as http:
        first = await http.get("/tasks?name=ok")
        assert first.status_code == 200 and "data-pending" in first.text
        assert 'data-page="tasks?name=ok' in first.text and "slow-1" not in first.text
        release.set()
        page = await wait_for(lambda: _filled(http, "/tasks?name=ok"), 10, "the list to be read")
    assert "slow-1" in page


async def _filled(http: httpx.AsyncClient, path: str) -> str | None:
    text = (await http.get(path)).text
    return None if "data-pending" in text else text


async def test_forget_makes_the_next_request_read_first() -> None:
    """After an action the next request reads the page before rendering it."""
    read = Counted()
    snapshots = Snapshots(lambda: 0)
    await snapshots.get("schedules", read)
    snapshots.forget()
    assert data(await snapshots.get("schedules", read)) == {"n": 2}


async def test_a_failed_background_read_keeps_the_last_snapshot() -> None:
    """The server going away during a re-read leaves the page showing its last read."""
    changes, read = [0], Counted()
    snapshots = Snapshots(lambda: changes[0], fresh_for=0.0)
    await snapshots.get("overview", read)
    read.fail, changes[0] = True, 1
    await snapshots.get("overview", read)
    await wait_for(lambda: not snapshots.reading, 10, "the background read to end")
    assert data(await snapshots.get("overview", read)) == {"n": 1}
    assert read.calls >= 2


async def test_schedules_page_shows_only_throttles_that_still_hold() -> None:
    """A ``RateLimited`` throttle that ended by server time is not shown; one that holds
    (on the name or on one ``limit_by`` gate) is, with its end."""
    clock = ManualClock()
    runner = TaskRunner(store=MemoryStore(clock=clock))
    await runner.store.throttle("ended", 5)
    ended = clock.now + timedelta(seconds=5)
    clock.advance(10)
    await runner.store.throttle("held", 60)
    await runner.store.throttle("held", 30, gate='held#"acme"')
    async with client(runner) as http:
        page = (await http.get("/schedules")).text
    assert 'data-limit="ended"' in page and ended.isoformat() not in page
    assert page.count('data-throttled="held"') == 2 and "held#&#34;acme&#34;:" in page
    assert (clock.now + timedelta(seconds=60)).isoformat() in page
    assert 'data-throttled="ended"' not in page


async def test_a_read_that_expires_is_read_again_then_and_announced() -> None:
    """A page read naming when its figures go out of date (a throttle's end) is read again
    at that time without any request or change, and the tabs are told."""
    fresh, calls = asyncio.Queue[str](), [0]

    async def read() -> dict[str, Any]:
        calls[0] += 1
        return {"n": calls[0], EXPIRES_IN: 0.2 if calls[0] == 1 else None}

    snapshots = Snapshots(lambda: 0, fresh.put_nowait, max_age=3600)
    assert data(await snapshots.get("schedules", read))["n"] == 1
    assert await asyncio.wait_for(fresh.get(), 10) == "schedules"  # the first read
    assert await asyncio.wait_for(fresh.get(), 10) == "schedules"  # the one at its expiry
    assert data(await snapshots.get("schedules", read))["n"] == 2 and calls[0] == 2
    await snapshots.close()


async def test_overview_lists_tasks_pinned_to_no_live_worker() -> None:
    """The overview names the worker_ids that unfinished tasks wait on when no live worker has them."""
    runner = TaskRunner(store=MemoryStore())
    await runner.store.beat(worker_info("w1"), 60)
    with pytest.warns(NoLiveWorkerWarning):
        await runner.publish("ok", key="lost", worker_ids=["ghost"], allow_unknown=True)
    await runner.publish("ok", key="mine", worker_ids=["w1"], allow_unknown=True)
    async with client(runner) as http:
        page = (await http.get("/")).text
    assert '<tr data-pinned-away="ghost">' in page and 'href="/tasks/lost"' in page
    assert "w1</td>" not in page
