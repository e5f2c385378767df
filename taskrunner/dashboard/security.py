"""Who may act: the action token (a cookie set by ``POST /login``) plus a double-submit CSRF token.

Reading needs nothing (bind to 127.0.0.1, the default). An action needs the dashboard to be
started with ``allow_actions``, the token printed at start (or ``TASKRUNNER_DASHBOARD_TOKEN``)
and a CSRF token equal to the ``csrf`` cookie, so another site's form cannot act for a
browser that holds the token cookie. The token travels in a form body and then in an
HttpOnly, SameSite=Strict cookie, never in a URL (URLs land in access logs and history).
"""

from __future__ import annotations

import secrets

from starlette.requests import Request
from starlette.responses import Response

TOKEN_COOKIE = "taskrunner_token"
CSRF_COOKIE = "taskrunner_csrf"
CSRF_FIELD = "csrf"


def new_token() -> str:
    return secrets.token_urlsafe(24)


def same(given: object, expected: str | None) -> bool:
    """Constant-time equality of two non-empty strings."""
    if not isinstance(given, str) or not given or not expected:
        return False
    return secrets.compare_digest(given.encode(), expected.encode())


def csrf_token(request: Request) -> str:
    """The browser's CSRF token, made up when it has none yet (``remember_csrf`` stores it)."""
    current = request.cookies.get(CSRF_COOKIE)
    return current if current else new_token()


def remember_csrf(request: Request, response: Response, token: str) -> None:
    if request.cookies.get(CSRF_COOKIE) != token:
        response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict")


def may_act(request: Request, form: dict[str, str], token: str | None) -> bool:
    """The request carries the action token (cookie or form field) and a matching CSRF token."""
    presented = request.cookies.get(TOKEN_COOKIE) or form.get("token")
    return same(presented, token) and same(form.get(CSRF_FIELD), request.cookies.get(CSRF_COOKIE))


def log_in(response: Response, token: str) -> None:
    response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
