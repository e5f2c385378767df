"""Load the ``TaskRunner`` an ``--app MODULE:OBJECT`` reference names.

The current directory comes first on ``sys.path``, as for ``python -m``: a user's
``sched.py`` must win over the standard library's ``sched``. Tools may have put the
directory elsewhere already (uv's editable install appends the project root), so it is
moved, not only added when missing. A module imported before the app (``queue``,
``email``, ... which the engine's libraries use) cannot be replaced; the error then says
which file was loaded and that the directory's file of that name was not.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from taskrunner.errors import ConfigurationError
from taskrunner.runner import TaskRunner


def load_app(reference: str) -> TaskRunner:
    """Import ``MODULE:OBJECT`` (the current directory first on ``sys.path``) and check its type."""
    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"--app must look like MODULE:OBJECT, got {reference!r}")
    _current_directory_first()
    module = _import(module_name, reference)
    if not hasattr(module, attr):
        raise ConfigurationError(
            f"--app {reference}: module {module_name!r} (from {_origin(module)}) has no attribute "
            f"{attr!r}{_hint(module)}{_shadowed(module_name, module)}"
        )
    app = getattr(module, attr)
    if not isinstance(app, TaskRunner):
        raise ConfigurationError(
            f"--app {reference}: {attr!r} is a {type(app).__name__}, not a TaskRunner "
            f"(module {module_name!r} from {_origin(module)}){_shadowed(module_name, module)}"
        )
    return app


def _current_directory_first() -> None:
    cwd = str(Path.cwd())
    if sys.path and sys.path[0] in ("", cwd):
        return
    sys.path[:] = [entry for entry in sys.path if entry != cwd]
    sys.path.insert(0, cwd)


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


def _origin(module: ModuleType) -> str:
    """The file a module was loaded from, or what stands for it (built-in, namespace package)."""
    spec = module.__spec__
    if spec is not None and spec.origin not in (None, "built-in", "frozen"):
        return str(spec.origin)
    locations = list(getattr(module, "__path__", []))
    if locations:
        return f"namespace package {', '.join(map(str, locations))}"
    return "built-in module" if spec is None or spec.origin is None else f"{spec.origin} module"


def _shadowed(module_name: str, module: ModuleType) -> str:
    """Why the current directory's file of that name was not loaded, if it has one."""
    top = module_name.partition(".")[0]
    cwd = Path.cwd()
    local = next((p for p in (cwd / f"{top}.py", cwd / top) if p.exists()), None)
    origin = Path(_origin(module))
    if local is None or origin.is_relative_to(cwd):
        return ""
    return (
        f"; {local} was not loaded: a module named {top!r} was imported before the app "
        "(the engine's libraries use it), so rename your file"
    )


def _hint(module: ModuleType) -> str:
    """The module's TaskRunner objects, the likely intended ones."""
    names = sorted(name for name, value in vars(module).items() if isinstance(value, TaskRunner))
    return f" (its TaskRunner objects: {', '.join(names)})" if names else " (it defines no TaskRunner)"
