"""The API reference (docs/api.md and the pages of docs/reference/) covers everything public:
every exported name, taskrunner.testing and taskrunner.dashboard, every exception, and every
environment variable the CLI and the package read."""

from __future__ import annotations

import ast
import inspect
import re
import types
from collections import Counter
from pathlib import Path
from typing import Any

import typer

import taskrunner
import taskrunner.dashboard
import taskrunner.errors
import taskrunner.testing
from taskrunner.cli import app

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "taskrunner"
REFERENCE = ROOT / "docs" / "reference"
ERRORS_PAGE = REFERENCE / "errors.md"
ENVIRONMENT_PAGE = REFERENCE / "environment.md"
# A name rendered by mkdocstrings: `::: taskrunner.TaskRunner` on a line of its own.
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.M)
VARIABLE = re.compile(r"^TASKRUNNER_[A-Z0-9_]+$")
OTEL_VARIABLES = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_SERVICE_NAME",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_SDK_DISABLED",
)


def rendered(pages: list[Path] | None = None) -> Counter[str]:
    """How often each dotted name is rendered by a `:::` directive on the reference pages."""
    chosen = pages if pages is not None else sorted(REFERENCE.glob("*.md"))
    return Counter(name for page in chosen for name in DIRECTIVE.findall(page.read_text()))


def public_names() -> list[str]:
    """Every dotted name the reference must render."""
    modules: list[types.ModuleType] = [taskrunner, taskrunner.testing, taskrunner.dashboard]
    return [f"{module.__name__}.{name}" for module in modules for name in module.__all__]


def defined_publicly(path: Path) -> set[str]:
    """Classes and functions a module defines at its top level with a public name."""
    tree = ast.parse(path.read_text())
    kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    return {node.name for node in tree.body if isinstance(node, kinds) and not node.name.startswith("_")}


def exception_classes() -> list[type[BaseException]]:
    """Every exception and warning class taskrunner.errors defines."""
    return [
        value
        for value in vars(taskrunner.errors).values()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == taskrunner.errors.__name__
    ]


def cli_variables() -> dict[str, set[str]]:
    """Each TASKRUNNER_* variable a command's options read (their envvar=), with those commands."""
    found: dict[str, set[str]] = {}

    def walk(command: Any, name: str) -> None:
        for parameter in command.params:
            envvar = parameter.envvar
            for variable in [envvar] if isinstance(envvar, str) else envvar or []:
                found.setdefault(variable, set()).add(name)
        for sub_name, sub in getattr(command, "commands", {}).items():
            walk(sub, sub_name if not name else f"{name} {sub_name}")

    walk(typer.main.get_command(app), "")
    return found


def top_level_commands() -> set[str]:
    return set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def package_variables() -> set[str]:
    """Every TASKRUNNER_* name written as a string in the package (os.environ reads included)."""
    return {
        node.value
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.match(node.value)
    }


def table_row(text: str, variable: str) -> str | None:
    """The environment page's table row of ``variable``, if it has one."""
    return next((line for line in text.splitlines() if line.startswith(f"| `{variable}` |")), None)


def row_problems(text: str, variable: str, commands: set[str]) -> list[str]:
    """What the page's row of ``variable`` lacks: the row itself, or a command that reads it."""
    row = table_row(text, variable)
    if row is None:
        return [f"{variable}: no table row"]
    readers = row.split("|")[2]
    if "every command but" in readers:
        excluded = set(re.findall(r"`([\w -]+)`", readers.split("every command but", 1)[1].split(";")[0]))
        claimed = top_level_commands() - excluded
        return (
            []
            if commands == claimed
            else [f"{variable}: read by {sorted(commands)}, row says {sorted(claimed)}"]
        )
    return [
        f"{variable}: row does not name `{command}`"
        for command in sorted(commands)
        if f"`{command}`" not in readers
    ]


def test_every_public_name_is_rendered_once() -> None:
    """Each name of taskrunner.__all__, taskrunner.testing.__all__ and taskrunner.dashboard.__all__
    is rendered by exactly one `::: name` directive of docs/reference/ (twice would repeat its anchor)."""
    counts = rendered()
    assert [name for name in public_names() if counts[name] != 1] == []


def test_the_pages_render_only_public_names() -> None:
    """No page renders an internal name: what the reference shows is what is promised."""
    assert sorted(set(rendered()) - set(public_names())) == []


def test_testing_and_dashboard_export_what_they_define() -> None:
    """taskrunner.testing's __all__ lists every public class, function and fixture it defines, and
    taskrunner.dashboard's the public names it holds, so the reference test above sees them all."""
    testing = Path(inspect.getfile(taskrunner.testing))
    assert sorted(defined_publicly(testing) - set(taskrunner.testing.__all__)) == []
    held = {
        name
        for name, value in vars(taskrunner.dashboard).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"
    }
    assert sorted(held) == sorted(taskrunner.dashboard.__all__)


def test_every_exception_is_on_the_errors_page() -> None:
    """Every exception class of taskrunner.errors is on docs/reference/errors.md: the public ones
    rendered there with their docstrings, the engine's own named in its closing paragraph."""
    on_page = rendered([ERRORS_PAGE])
    text = ERRORS_PAGE.read_text()
    missing = []
    for cls in exception_classes():
        if cls.__name__ in taskrunner.__all__:
            if on_page[f"taskrunner.{cls.__name__}"] != 1:
                missing.append(cls.__name__)
        elif f"`{cls.__name__}`" not in text:
            missing.append(cls.__name__)
    assert missing == []
    assert len(exception_classes()) >= 25


def test_the_errors_page_says_what_the_helpers_raise() -> None:
    """The exceptions taskrunner.testing and the dashboard raise have a row on the errors page."""
    text = ERRORS_PAGE.read_text()
    for raiser in (
        "`taskrunner.testing.wait_for`",
        "`embedded_uri`",
        "`taskrunner.dashboard.serve_dashboard`",
    ):
        first_cells = [line.split("|")[1] for line in text.splitlines() if line.startswith("| ")]
        assert any(raiser in cell for cell in first_cells), raiser


def test_every_cli_variable_has_a_row_naming_its_commands() -> None:
    """Each TASKRUNNER_* variable of a CLI option (collected from the options' envvar=) has a row on
    docs/reference/environment.md naming the commands that read it."""
    variables = cli_variables()
    assert {"TASKRUNNER_MONGO_URI", "TASKRUNNER_APP", "TASKRUNNER_CONCURRENCY"} <= set(variables)
    text = ENVIRONMENT_PAGE.read_text()
    assert [p for v, commands in sorted(variables.items()) for p in row_problems(text, v, commands)] == []


def test_every_variable_the_package_reads_has_a_row() -> None:
    """Variables read outside the options (the dashboard's token, round-trip counting, the test
    fixtures' server) and the OpenTelemetry SDK's have a row too."""
    found = package_variables()
    assert {"TASKRUNNER_DASHBOARD_TOKEN", "TASKRUNNER_COUNT_ROUNDTRIPS", "TASKRUNNER_TEST_MONGO_URI"} <= found
    text = ENVIRONMENT_PAGE.read_text()
    assert [v for v in sorted({*found, *OTEL_VARIABLES}) if table_row(text, v) is None] == []


def test_row_problems_finds_a_missing_command_or_row() -> None:
    """The row check reports a missing row, an unnamed command, and an 'every command but' that lies."""
    everyone = top_level_commands()
    text = (
        "| `TASKRUNNER_X` | `worker` | meaning | 1 |\n"
        "| `TASKRUNNER_Y` | every command but `dev-server`; also `TaskRunner()` | meaning | 2 |\n"
    )
    assert row_problems(text, "TASKRUNNER_Z", {"worker"}) == ["TASKRUNNER_Z: no table row"]
    assert row_problems(text, "TASKRUNNER_X", {"worker", "publish"}) == [
        "TASKRUNNER_X: row does not name `publish`"
    ]
    assert row_problems(text, "TASKRUNNER_Y", everyone - {"dev-server"}) == []
    assert row_problems(text, "TASKRUNNER_Y", everyone - {"dev-server", "demo"}) != []
