"""docs/testing.md's examples run as a user's project would run them.

Each ```python block whose first line names a file (``# conftest.py``, ``# test_x.py``) is
written to a fresh directory with the pytest settings the page shows, and pytest runs them in
a subprocess: the ``taskrunner.testing`` plugin, its fixtures and helpers as users get them.
The subprocess inherits ``TASKRUNNER_TEST_MONGO_URI``, so the examples' ``mongo_uri`` is the
real MongoDB when it is set, as it would be in the user's project.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from taskrunner import TaskRunner

PAGE = Path(__file__).resolve().parents[2] / "docs" / "testing.md"
BLOCK = re.compile(r"^```python\n# (\w+\.py)\n(.*?)^```", re.S | re.M)
INI = "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"


def examples() -> dict[str, str]:
    """File name -> code of every named python block on the page."""
    return {name: code for name, code in BLOCK.findall(PAGE.read_text())}


def runnable(files: dict[str, str]) -> dict[str, str]:
    # Drain mode arrives with the worker options; until then its examples cannot run here.
    drains = "drain" in inspect.signature(TaskRunner.run_worker).parameters
    return {name: code for name, code in files.items() if drains or "drain=True" not in code}


def test_the_page_names_a_conftest_and_its_test_modules() -> None:
    """Every python block on the page is a file of the example project, conftest included."""
    files = examples()
    blocks = re.findall(r"^```python\n", PAGE.read_text(), re.M)
    assert len(files) == len(blocks) and "conftest.py" in files
    assert all(name == "conftest.py" or name.startswith("test_") for name in files)


@pytest.mark.embedded  # the examples also use embedded_uri, and must pass without skipping
def test_every_example_on_the_testing_page_passes(tmp_path: Path) -> None:
    """pytest runs the page's test modules with the plugin enabled, and every test passes."""
    files = runnable(examples())
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    (tmp_path / "pytest.ini").write_text(INI)
    expected = sum(len(re.findall(r"^(?:async )?def test_", code, re.M)) for code in files.values())
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(tmp_path / "pytest.ini"),
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(rf"\b{expected} passed\b", result.stdout) and "skipped" not in result.stdout, (
        result.stdout
    )
