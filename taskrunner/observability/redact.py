"""Keep credentials out of logs, errors and CLI output."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(mongodb(?:\+srv)?://)([^@/\s]+)@")


def redact(text: str) -> str:
    """Replace ``user:password@`` in MongoDB URIs with ``***@``."""
    return _USERINFO.sub(r"\1***@", text)
