"""The docs site draws its ```mermaid blocks as diagrams.

The site is built as CI builds it (``mkdocs build --strict``, the ``docs`` dependency group).
pymdownx.superfences writes each ```mermaid block as ``<div class="mermaid">`` and
docs/js/mermaid.mjs has mermaid replace it with an SVG. That script loads mermaid from a CDN
at one pinned release; here nothing leaves the machine: the page's requests for that release
are answered from the same release's npm package (``npm pack``, cached in
``.cache/mermaid``), and every other request off the local site is refused.
"""

from __future__ import annotations

import fcntl
import functools
import mimetypes
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from playwright.async_api import Route

    from .conftest import Watched

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LOADER = DOCS / "js" / "mermaid.mjs"
CDN_IMPORT = re.compile(
    r'from "(?P<base>https://cdn\.jsdelivr\.net/npm/mermaid@(?P<version>\d+\.\d+\.\d+)/dist/)'
    r'(?P<entry>mermaid\.esm\.min\.mjs)"'
)
MERMAID_FENCE = re.compile(r"^```mermaid[ \t]*$", re.M)
BUILD_TIMEOUT_S = 300
NPM_TIMEOUT_S = 480


def mermaid_blocks() -> dict[str, int]:
    """Pages of docs/ with ```mermaid blocks, and how many each has."""
    counts = {page.stem: len(MERMAID_FENCE.findall(page.read_text())) for page in DOCS.glob("*.md")}
    return {page: count for page, count in counts.items() if count}


def page_path(site: Path, page: str) -> Path:
    """The built HTML of a docs page (``use_directory_urls``: ``name/index.html``)."""
    return site / "index.html" if page == "index" else site / page / "index.html"


def cdn_import() -> re.Match[str]:
    found = CDN_IMPORT.search(LOADER.read_text())
    assert found is not None, f"{LOADER} imports no pinned mermaid release from the CDN"
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs site, built with --strict into a temporary directory."""
    pytest.importorskip("mkdocs", reason="the docs dependency group: uv sync --group docs")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def site_url(site: Path) -> Iterator[str]:
    """The built site served over HTTP on 127.0.0.1 (module scripts do not load from file://)."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def mermaid_dist() -> Path:
    """The ``dist/`` of the mermaid release the loader pins, from its npm package (the ESM
    entry and its chunks), fetched once per machine."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm not found: cannot fetch the mermaid package the docs site loads")
    version = cdn_import()["version"]
    prefix = ROOT / ".cache" / "mermaid" / version
    dist = prefix / "package" / "dist"
    prefix.mkdir(parents=True, exist_ok=True)
    with (prefix / ".install.lock").open("w") as lock:  # parallel test processes: one fetch
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dist / "mermaid.esm.min.mjs").exists():
            _fetch(npm, version, prefix)
    return dist


def _fetch(npm: str, version: str, prefix: Path) -> None:
    packed = subprocess.run(
        [npm, "pack", f"mermaid@{version}", "--pack-destination", str(prefix), "--silent"],
        capture_output=True,
        text=True,
        timeout=NPM_TIMEOUT_S,
        check=False,
    )
    tarball = prefix / f"mermaid-{version}.tgz"
    if packed.returncode != 0 or not tarball.exists():
        pytest.fail(f"npm pack mermaid@{version} failed:\n{packed.stderr[-3000:]}")
    with tarfile.open(tarball) as archive:
        wanted = [
            member
            for member in archive.getmembers()
            if member.name == "package/dist/mermaid.esm.min.mjs"
            or member.name.startswith("package/dist/chunks/mermaid.esm.min/")
        ]
        archive.extractall(prefix, members=wanted, filter="data")
    tarball.unlink()


def test_a_page_with_mermaid_blocks_has_their_containers_and_loads_the_script(site: Path) -> None:
    """Each ```mermaid block of a page is one <div class="mermaid"> in its built HTML (not a code
    block), and the page loads docs/js/mermaid.mjs as a module."""
    pages = mermaid_blocks()
    assert pages, "no ```mermaid block in docs/: this test checks nothing"
    for page, count in pages.items():
        html = page_path(site, page).read_text()
        assert html.count('<div class="mermaid">') == count, page
        assert "language-mermaid" not in html, page
        assert re.search(r'<script src="(\.\./)*js/mermaid\.mjs" type="module">', html), page


@pytest.mark.timeout(NPM_TIMEOUT_S + 120)  # the first run fetches mermaid with npm
async def test_mermaid_blocks_are_drawn_as_svg_in_a_browser(
    site_url: str, mermaid_dist: Path, watched: Watched
) -> None:
    """In headless chromium every ```mermaid block of every page becomes an SVG holding the
    diagram's labels, with mermaid from the pinned CDN release and no page error."""
    from playwright.async_api import expect

    base = cdn_import()["base"]
    served: list[str] = []
    refused: list[str] = []

    async def route(request_route: Route) -> None:
        url = request_route.request.url
        if url.startswith(site_url):
            await request_route.continue_()
        elif url.startswith(base) and (dist_file := mermaid_dist / url.removeprefix(base)).is_file():
            served.append(url)
            kind = mimetypes.guess_type(dist_file.name)[0] or "text/javascript"
            await request_route.fulfill(
                body=dist_file.read_bytes(),
                content_type="text/javascript" if dist_file.suffix == ".mjs" else kind,
                headers={"Access-Control-Allow-Origin": "*"},
            )
        else:
            refused.append(url)
            await request_route.abort()

    page = watched.page
    await page.route("**/*", route)
    for name, count in mermaid_blocks().items():
        await page.goto(f"{site_url}/{'' if name == 'index' else name + '/'}")
        diagrams = page.locator("div.mermaid > svg")
        await expect(diagrams).to_have_count(count)
        labels = await diagrams.first.text_content() or ""
        assert len(labels.strip()) > 10, f"{name}: an SVG without the diagram's labels: {labels!r}"
    assert watched.errors == []
    assert f"{base}mermaid.esm.min.mjs" in served
    assert refused == []
