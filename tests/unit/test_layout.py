"""The package's layout: which module imports which, read from the source.

Every import counts: at module level, under ``TYPE_CHECKING`` and inside functions (a
deferred import still makes the importer depend on the module).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "taskrunner"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target
                break


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imports(name, path, known)) for name, path in known.items()}


def test_no_import_cycle() -> None:
    """No module reaches itself through imports. The API and the engine meet without one:
    the engine and a handler's context are typed against ``TaskClient``, and
    ``TaskRunner`` (running workers) is the only module above the engine that uses it."""
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    """The check can fail: two modules importing each other are one cycle."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]


def test_store_and_features_import_no_public_api_or_engine_above_them() -> None:
    """The store imports neither the runner nor the engine's worker; limits and schedules
    import no runner (workflows no client either); the engine imports no runner, CLI or dashboard; the client and the
    handler's context import nothing of the engine that runs handlers."""
    graph = import_graph()
    below = {
        "taskrunner.store": {"taskrunner.runner", "taskrunner.engine.worker", "taskrunner.limits.gatekeeper"},
        "taskrunner.limits": {"taskrunner.runner", "taskrunner.engine.worker"},
        "taskrunner.schedules": {"taskrunner.runner", "taskrunner.engine.worker"},
        "taskrunner.workflows": {"taskrunner.runner", "taskrunner.client", "taskrunner.engine.worker"},
        "taskrunner.engine": {
            "taskrunner.runner",
            "taskrunner.sync",
            "taskrunner.cli",
            "taskrunner.dashboard",
        },
        "taskrunner.client": {"taskrunner.runner", "taskrunner.engine.worker", "taskrunner.engine.execution"},
        "taskrunner.context": {"taskrunner.runner", "taskrunner.engine"},
    }
    wrong = [
        (name, target)
        for name, targets in graph.items()
        for prefix, banned in below.items()
        if name == prefix or name.startswith(prefix + ".")
        for target in targets
        if any(target == b or target.startswith(b + ".") for b in banned)
    ]
    assert wrong == []


TESTS = PACKAGE.parent / "tests"
TEST_DIRECTORIES = {
    "unit": "no server and no process of its own",
    "contract": "each store in the test's process, and the embedded server held to MongoDB's",
    "processes": "real worker, CLI, demo and benchmark processes",
    "faults": "faults injected into servers, networks and workers",
    "browser": "the dashboard in a real browser",
    "docs": "the documentation's blocks, queries, links and API names",
}
"""The test directories, each saying what its tests cost; shared helpers are the modules at the
top of ``tests/`` and ``tests/apps/``."""


def test_every_test_module_is_in_the_directory_of_what_it_costs() -> None:
    """Test modules live in one of the test directories, and those hold nothing but test modules,
    ``__init__.py`` and ``conftest.py``: a helper in one would be shared from the wrong place."""
    misplaced = [
        path.relative_to(TESTS).as_posix()
        for path in sorted(TESTS.rglob("*.py"))
        if (path.name.startswith("test_") or path.parent.name in TEST_DIRECTORIES)
        and not (
            len(path.relative_to(TESTS).parts) == 2
            and path.parent.name in TEST_DIRECTORIES
            and (path.name.startswith("test_") or path.name in {"__init__.py", "conftest.py"})
        )
    ]
    assert misplaced == []


def test_test_modules_do_not_import_each_other() -> None:
    """Shared test helpers live in support modules or fixtures, never in another test module
    or a test directory."""
    found = [
        (path.relative_to(TESTS).as_posix(), target)
        for path in sorted(TESTS.rglob("test_*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom | ast.Import)
        for target in (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        )
        if target.rpartition(".")[2].startswith("test_") or target.partition(".")[0] in TEST_DIRECTORIES
    ]
    assert found == []
