"""The API reference (docs/api.md and docs/reference/, built by mkdocs in .ci/run) documents every exported name."""

from __future__ import annotations

import inspect
from pathlib import Path

import taskrunner

ROOT = Path(__file__).resolve().parents[2]


def own_docstring(obj: object) -> str | None:
    """The docstring written on the object itself, not one inherited or generated for it."""
    if isinstance(obj, type):
        doc = obj.__dict__.get("__doc__")
        return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def test_every_exported_name_has_a_docstring() -> None:
    """Each name in taskrunner.__all__ exists and carries its own docstring (mkdocstrings hides the rest)."""
    missing = [name for name in taskrunner.__all__ if own_docstring(getattr(taskrunner, name)) is None]
    assert missing == []


def test_own_docstring_ignores_inherited_ones() -> None:
    """A subclass without a docstring of its own counts as undocumented."""

    class Documented(Exception):
        """Says what it is."""

    class Bare(Documented):
        pass

    assert own_docstring(Documented) == "Says what it is."
    assert own_docstring(Bare) is None


def test_the_index_links_every_reference_page() -> None:
    """docs/api.md is the reference's index: it links each page of docs/reference/, which render
    the names through mkdocstrings (tests/unit/test_reference.py checks that every name is there)."""
    text = (ROOT / "docs" / "api.md").read_text()
    pages = sorted((ROOT / "docs" / "reference").glob("*.md"))
    assert len(pages) >= 9
    assert [page.name for page in pages if f"(reference/{page.name})" not in text] == []
