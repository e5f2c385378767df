"""MkDocs hook: the repository's README.md is the site's home page.

README.md lives at the repository root (GitHub shows it there) and links to ``docs/X.md``;
on the site it becomes ``index.md`` and those links point at the sibling pages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS_LINK = re.compile(r"\]\(docs/")


def on_files(files: Files, config: Any) -> Files:
    """Add README.md, its ``docs/`` links made relative, as the generated page index.md."""
    content = DOCS_LINK.sub("](", README.read_text())
    files.append(File.generated(config, "index.md", content=content))
    return files
