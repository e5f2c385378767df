"""Load the ``TaskRunner`` an ``--app MODULE:OBJECT`` reference names."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from taskrunner.errors import ConfigurationError
from taskrunner.runner import TaskRunner


def load_app(reference: str) -> TaskRunner:
    """Import ``MODULE:OBJECT`` (the current directory is importable) and check its type."""
    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"--app must look like MODULE:OBJECT, got {reference!r}")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    module = _import(module_name, reference)
    if not hasattr(module, attr):
        raise ConfigurationError(
            f"--app {reference}: module {module_name!r} has no attribute {attr!r}{_hint(module)}"
        )
    app = getattr(module, attr)
    if not isinstance(app, TaskRunner):
        raise ConfigurationError(f"--app {reference}: {attr!r} is a {type(app).__name__}, not a TaskRunner")
    return app


def _import(module_name: str, reference: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise ConfigurationError(
                f"--app {reference}: no module named {module_name!r} (searched the current directory and sys.path)"
            ) from exc
        raise ConfigurationError(f"--app {reference}: importing {module_name!r} failed: {exc}") from exc
    except ImportError as exc:
        raise ConfigurationError(f"--app {reference}: importing {module_name!r} failed: {exc}") from exc


def _hint(module: ModuleType) -> str:
    """The module's TaskRunner objects, the likely intended ones."""
    names = sorted(name for name, value in vars(module).items() if isinstance(value, TaskRunner))
    return f" (its TaskRunner objects: {', '.join(names)})" if names else " (it defines no TaskRunner)"
