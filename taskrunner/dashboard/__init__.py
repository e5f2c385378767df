"""A live web dashboard of tasks, workers and schedules (``taskrunner dashboard``).

Needs the ``dashboard`` extra (Starlette, Jinja2, uvicorn). ``create_app`` builds the ASGI
app for a runner; ``serve_dashboard`` serves it (the coroutine the CLI calls). docs/dashboard.md
describes the pages, the live updates and the action token.
"""

from __future__ import annotations

from taskrunner.dashboard.app import create_app
from taskrunner.dashboard.server import serve_dashboard

__all__ = ["create_app", "serve_dashboard"]
