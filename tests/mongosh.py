"""Locate or install a pinned ``mongosh`` so tests can drive the server with the Node driver.

The first call runs ``npm ci`` into ``<repo>/.cache/mongosh`` (gitignored, about a
minute) from the committed ``tests/mongosh_lock/package.json`` and ``package-lock.json``,
so every machine installs the same tree; later calls reuse it.  The lock exists because a
plain ``npm install mongosh@2.5.8`` resolves its dependencies' ranges afresh, and the
registry once offered a ``@babel/*`` release whose own dependency was not there yet (the
package.json pins ``@babel/*`` through ``overrides``).  Tests skip only when npm itself is
missing: a failed installation is a failure, not a reason to skip.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
from pathlib import Path

import pytest

_LOCK = Path(__file__).resolve().parent / "mongosh_lock"
MONGOSH_VERSION: str = json.loads((_LOCK / "package.json").read_text())["dependencies"]["mongosh"]
_PREFIX = Path(__file__).resolve().parent.parent / ".cache" / "mongosh"
_BINARY = _PREFIX / "node_modules" / ".bin" / "mongosh"
_PACKAGE_JSON = _PREFIX / "node_modules" / "mongosh" / "package.json"
INSTALL_TIMEOUT_S = 480


def _installed_version() -> str | None:
    try:
        version = json.loads(_PACKAGE_JSON.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None
    return str(version) if _BINARY.exists() else None


def _install(npm: str) -> None:
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(_LOCK / name, _PREFIX / name)
    result = subprocess.run(
        [npm, "ci", "--prefix", str(_PREFIX), "--no-audit", "--no-fund"],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0 or _installed_version() != MONGOSH_VERSION:
        pytest.fail(f"installing mongosh@{MONGOSH_VERSION} failed:\n{result.stderr[-3000:]}")


def mongosh_path() -> Path:
    """Return the pinned mongosh binary, installing it on first use (skips if npm is missing)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm not found: cannot install mongosh")
    _PREFIX.mkdir(parents=True, exist_ok=True)
    # Parallel test processes must not run two npm installs into one prefix.
    with (_PREFIX / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed_version() != MONGOSH_VERSION:
            _install(npm)
    return _BINARY
