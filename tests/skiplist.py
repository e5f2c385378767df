"""A pytest plugin: every run ends with each skipped test's node id, grouped under its reason.

A skip count alone hides which tests did not run (say, the ones that need a real MongoDB);
pytest's ``-rs`` folds the tests one skip location skipped into a count. This lists them, one
line each. Under pytest-xdist it runs in the controller, which receives every worker's skip reports.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _pytest.terminal import TerminalReporter


def skip_reason(report: pytest.TestReport) -> str:
    """Why a skipped test was skipped (pytest keeps it as ``(path, line, "Skipped: why")``)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def skipped_by_reason(reports: list[pytest.TestReport]) -> dict[str, list[str]]:
    """Each reason with the sorted node ids of the tests it skipped, most skipped first."""
    grouped: defaultdict[str, list[str]] = defaultdict(list)
    for report in reports:
        grouped[skip_reason(report)].append(report.nodeid)
    ordered = sorted(grouped.items(), key=lambda item: (-len(item[1]), item[0]))
    return {reason: sorted(nodeids) for reason, nodeids in ordered}


def pytest_terminal_summary(terminalreporter: TerminalReporter) -> None:
    """List the skipped tests by reason at the end of the run (nothing when none skipped)."""
    reports = [r for r in terminalreporter.stats.get("skipped", []) if isinstance(r, pytest.TestReport)]
    if not reports:
        return
    terminalreporter.section(f"{len(reports)} skipped, by reason", sep="=")
    for reason, nodeids in skipped_by_reason(reports).items():
        terminalreporter.write_line(f"{reason} ({len(nodeids)}):")
        for nodeid in nodeids:
            terminalreporter.write_line(f"  {nodeid}")
