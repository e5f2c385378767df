"""Load the ``TaskRunner`` an ``--app MODULE:OBJECT`` reference names."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from taskrunner.errors import ConfigurationError
from taskrunner.runner import TaskRunner


def load_app(reference: str) -> TaskRunner:
    """Import ``MODULE:OBJECT`` (the current directory is importable) and check its type."""
    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"--app must look like MODULE:OBJECT, got {reference!r}")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import app module {module_name!r}: {exc}") from exc
    app = getattr(module, attr, None)
    if not isinstance(app, TaskRunner):
        raise ConfigurationError(f"{reference!r} is {type(app).__name__}, not a TaskRunner")
    return app
