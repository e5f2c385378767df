"""The docs cite tests by ``path::name``; every cited test must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_cited_test_exists() -> None:
    """docs/*.md cite only test files and test functions that exist."""
    cited = [
        (doc.name, m.group(1), m.group(2))
        for doc in (ROOT / "docs").glob("*.md")
        for m in CITATION.finditer(doc.read_text())
    ]
    assert cited, "docs/guarantees.md should cite its tests as path::name"
    missing = [c for c in cited if not (ROOT / c[1]).exists() or c[2] not in defined_tests(ROOT / c[1])]
    assert missing == []
