"""The ASGI app: pages, their fragments (for live refresh), server-sent events and actions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from taskrunner.dashboard import flows, pages
from taskrunner.dashboard.actions import ACTIONS
from taskrunner.dashboard.hub import Hub, fresh_message
from taskrunner.dashboard.security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    csrf_token,
    log_in,
    may_act,
    new_token,
    remember_csrf,
    same,
)
from taskrunner.dashboard.snapshots import Read, Snapshots
from taskrunner.errors import FlowNotFound, TaskNotFound, TaskRunnerError
from taskrunner.models import TaskState
from taskrunner.observability.redact import redact
from taskrunner.runner import TaskRunner

HERE = Path(__file__).parent
KEEPALIVE_SECONDS = 15.0
RENDER_WAIT = 0.2  # a page's first read: wait this long, then render it as being read
WARM_SECONDS = 60.0  # at start, wait this long at most for the first reads before serving
URL_TOKEN_REFUSED = "a token in a URL is never accepted (URLs land in logs and history): enter it here"


def environment() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))
    env.filters["keyurl"] = lambda key: quote(str(key), safe="")
    env.filters["query"] = lambda params: urlencode(params)
    env.filters["pretty"] = lambda value: json.dumps(value, indent=2, sort_keys=True, default=str)
    return env


class Dashboard:
    """The app's state: the runner, the hub, the templates and who may act."""

    def __init__(self, runner: TaskRunner, allow_actions: bool, token: str | None) -> None:
        self.runner, self.allow_actions, self.token = runner, allow_actions, token
        self.hub = Hub(runner.store)
        self.env = environment()
        self.snapshots = Snapshots(
            lambda: self.hub.changes, lambda page: self.hub.announce(fresh_message(page))
        )

    async def warm(self) -> None:
        """Read the pages with counts before serving (for at most ``WARM_SECONDS``), so the
        first visits render their figures at once; a server away only delays that."""
        default = pages.TaskFilter()
        reads = {
            "overview": partial(pages.overview, self.runner),
            "schedules": partial(pages.schedules, self.runner),
            default.page(): partial(pages.task_list, self.runner, default),
        }
        await self.snapshots.warm(reads, within=WARM_SECONDS)

    def render(self, request: Request, template: str, status: int = 200, **context: Any) -> Response:
        csrf = csrf_token(request)
        page = self.env.get_template(template).render(
            request=request,
            actions=self.allow_actions,
            csrf=csrf,
            logged_in=same(request.cookies.get("taskrunner_token"), self.token),
            source=redact(f"{self.runner.mongo_uri} {self.runner.database}.{self.runner.collection}"),
            states=[s.value for s in TaskState],
            fragment="fragment" in request.query_params,
            **context,
        )
        response = HTMLResponse(page, status_code=status)
        remember_csrf(request, response, csrf)
        return response

    async def overview(self, request: Request) -> Response:
        read = partial(pages.overview, self.runner)
        return await self._snapshot(request, "overview.html", "overview", "Overview", read)

    async def tasks(self, request: Request) -> Response:
        chosen = pages.TaskFilter.parse(dict(request.query_params))
        read = partial(pages.task_list, self.runner, chosen)
        return await self._snapshot(request, "tasks.html", chosen.page(), "Tasks", read)

    async def task(self, request: Request) -> Response:
        task = await self.runner.get(request.path_params["key"])
        document = task.model_dump(mode="json", by_alias=True)
        links = await flows.task_links(self.runner, task)
        return self.render(
            request, "task.html", task=task, document=document, progress=pages.progress(task), links=links
        )

    async def flow(self, request: Request) -> Response:
        """A flow's graph and steps from its snapshot (a flow of 10,000 steps is a large read)."""
        flow_id = request.path_params["flow"]
        page = f"flows/{flow_id}"
        read = partial(flows.flow_page, self.runner, flow_id)
        data = await self.snapshots.get(page, read, within=RENDER_WAIT)
        if data is None:
            return self.render(request, "reading.html", page=page, title=f"Flow {flow_id}")
        if data["view"] is None:
            self.snapshots.drop(page)  # a flow published next is read afresh, not found stale
            return self.render(request, "error.html", 404, message=str(FlowNotFound(flow_id)))
        return self.render(request, "flow.html", page=page, **data)

    async def workers(self, request: Request) -> Response:
        return self.render(request, "workers.html", workers=await self.runner.workers())

    async def schedules(self, request: Request) -> Response:
        read = partial(pages.schedules, self.runner)
        return await self._snapshot(request, "schedules.html", "schedules", "Schedules and limits", read)

    async def _snapshot(self, request: Request, template: str, page: str, title: str, read: Read) -> Response:
        """``template`` over the page's snapshot; a page whose first read takes longer than
        ``RENDER_WAIT`` renders as being read and fills in when the read lands."""
        data = await self.snapshots.get(page, read, within=RENDER_WAIT)
        if data is None:
            return self.render(request, "reading.html", page=page, title=title)
        return self.render(request, template, page=page, **data)

    async def login(self, request: Request) -> Response:
        """The login form (GET). A token in the URL is never taken: a URL lands in server
        logs, proxies' logs and the browser's history."""
        if not self.allow_actions:
            return self.render(request, "error.html", 403, message="actions are off (--allow-actions)")
        note = URL_TOKEN_REFUSED if "token" in request.query_params else None
        return self.render(request, "login.html", 400 if note else 200, message=note)

    async def submit_login(self, request: Request) -> Response:
        """The login form posted: the token and the CSRF token in the body; a cookie back."""
        form = await read_form(request)
        if not self.allow_actions:
            return self.render(request, "error.html", 403, message="actions are off (--allow-actions)")
        if not same(form.get(CSRF_FIELD), request.cookies.get(CSRF_COOKIE)):
            return self.render(request, "login.html", 403, message="the form expired: log in again")
        if not same(form.get("token"), self.token):
            return self.render(request, "login.html", 403, message="wrong token")
        response = RedirectResponse("/", status_code=303)
        log_in(response, self.token or "")
        return response

    async def act(self, request: Request) -> Response:
        form = await read_form(request)
        if not self.allow_actions or not may_act(request, form, self.token):
            return self.render(request, "error.html", 403, message="actions need the token and a CSRF token")
        action = ACTIONS.get(request.path_params["action"])
        if action is None:
            return self.render(request, "error.html", 404, message="no such action")
        target = await action(self.runner, form)
        self.snapshots.forget()  # the page the action leads to shows its effect
        return RedirectResponse(target, status_code=303)

    async def events(self, request: Request) -> Response:
        return StreamingResponse(self._stream(request), media_type="text/event-stream")

    async def _stream(self, request: Request) -> AsyncIterator[str]:
        queue = self.hub.subscribe()
        try:
            yield "event: open\ndata: {}\n\n"
            while not await request.is_disconnected():
                try:
                    message = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                yield f"event: change\ndata: {message}\n\n"
        finally:
            self.hub.unsubscribe(queue)


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (the pages post nothing else; no multipart parser needed)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        return {}
    body = await request.body()
    return dict(parse_qsl(body.decode("utf-8", errors="replace"), max_num_fields=100))


def guarded(dashboard: Dashboard, view: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
    """``view`` with the taskrunner errors a request can cause shown as an error page."""

    async def endpoint(request: Request) -> Response:
        try:
            return await view(request)
        except TaskNotFound as exc:
            return dashboard.render(request, "error.html", 404, message=str(exc))
        except TaskRunnerError as exc:
            return dashboard.render(request, "error.html", 400, message=redact(str(exc)))

    return endpoint


def create_app(runner: TaskRunner, *, allow_actions: bool = False, token: str | None = None) -> Starlette:
    """The dashboard for ``runner``: read-only unless ``allow_actions`` (then actions need
    ``token``, made up when not given, and a CSRF token)."""
    if allow_actions and not token:
        token = new_token()
    dashboard = Dashboard(runner, allow_actions, token)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        hub = asyncio.create_task(dashboard.hub.run())
        await dashboard.warm()
        try:
            yield
        finally:
            await dashboard.snapshots.close()
            hub.cancel()
            with suppress(asyncio.CancelledError):
                await hub

    def page(
        path: str, view: Callable[[Request], Awaitable[Response]], methods: list[str] | None = None
    ) -> Route:
        return Route(path, guarded(dashboard, view), methods=methods or ["GET"])

    routes = [
        page("/", dashboard.overview),
        page("/tasks", dashboard.tasks),
        page("/tasks/{key:path}", dashboard.task),
        page("/flows/{flow:path}", dashboard.flow),
        page("/workers", dashboard.workers),
        page("/schedules", dashboard.schedules),
        page("/login", dashboard.login),
        page("/login", dashboard.submit_login, ["POST"]),
        page("/actions/{action}", dashboard.act, ["POST"]),
        Route("/events", dashboard.events),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.dashboard = dashboard
    return app
