"""``serve_dashboard``: the dashboard on uvicorn until cancelled (the CLI's coroutine)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable

import uvicorn

from taskrunner.dashboard.app import create_app
from taskrunner.dashboard.security import new_token
from taskrunner.runner import TaskRunner

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def exposure_warning(host: str) -> str | None:
    """The warning for binding beyond this machine, None for a loopback address."""
    if host in LOCAL_HOSTS:
        return None
    return (
        f"WARNING: the dashboard listens on {host!r}: anyone who can reach it sees every task's "
        "params, results and errors. Bind 127.0.0.1 (the default) unless that is what you want."
    )


async def serve_dashboard(
    runner: TaskRunner,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    allow_actions: bool = False,
    token: str | None = None,
) -> None:
    """Serve the dashboard for ``runner`` on ``host:port`` until cancelled; print its URL
    (and the action token when ``allow_actions``: made up when not given)."""
    made_up = allow_actions and not token
    if made_up:
        token = new_token()
    app = create_app(runner, allow_actions=allow_actions, token=token)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    warning = exposure_warning(host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    shown = token if made_up else None
    await _Server(config, lambda bound: _announce(host, bound, allow_actions, shown)).serve()


class _Server(uvicorn.Server):
    """uvicorn's server, announcing its URL once it listens (port 0: the one chosen)."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[int], None]) -> None:
        super().__init__(config)
        self.announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.announce(self._bound_port())

    def _bound_port(self) -> int:
        for listener in self.servers:
            for sock in listener.sockets:
                return int(sock.getsockname()[1])
        return self.config.port


def _announce(host: str, port: int, allow_actions: bool, made_up: str | None) -> None:
    """The URL, and with actions where to log in: the token goes in the login form, never
    in a URL. A token given by the environment is not printed (its owner has it)."""
    shown = f"[{host}]" if ":" in host else host
    print(f"dashboard: http://{shown}:{port}/", flush=True)
    if allow_actions:
        print(f"actions allowed; log in at http://{shown}:{port}/login", flush=True)
        given = "the one given (TASKRUNNER_DASHBOARD_TOKEN)"
        print(f"action token: {made_up or given}", flush=True)
