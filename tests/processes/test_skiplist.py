"""The end-of-run list of skipped tests (tests/skiplist.py), under pytest-xdist as the suite runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]

SAMPLE = """
import pytest

@pytest.fixture(params=["here", "elsewhere"])
def server(request):
    if request.param == "elsewhere":
        pytest.skip("needs a server elsewhere")
    return request.param

def test_uses_server(server):
    assert server == "here"

def test_reads_server(server):
    assert server

@pytest.mark.skip(reason="not today")
def test_marked():
    pass
"""


def run_sample(tmp_path: Path, *args: str) -> str:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "skiplist", "-p", "no:cacheprovider", *args, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def summary(output: str) -> list[str]:
    """The lines of the skip list, from its header to the final count."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "skipped, by reason" in line)
    return lines[start + 1 : start + 6]


def test_each_skipped_test_is_named_under_its_reason_with_xdist(tmp_path: Path) -> None:
    """With -n 2, the controller lists every skipped node id under its reason, most frequent reason first."""
    output = run_sample(tmp_path, "-n", "2", "-c", os.devnull, "--rootdir", str(tmp_path))
    assert "3 skipped, by reason" in output
    assert summary(output) == [
        "needs a server elsewhere (2):",
        "  test_sample.py::test_reads_server[elsewhere]",
        "  test_sample.py::test_uses_server[elsewhere]",
        "not today (1):",
        "  test_sample.py::test_marked",
    ]


def test_no_list_when_nothing_skipped(tmp_path: Path) -> None:
    """A run without skips prints no skip section."""
    output = run_sample(
        tmp_path, "-n0", "-c", os.devnull, "--rootdir", str(tmp_path), "-k", "not elsewhere and not marked"
    )
    assert "by reason" not in output
