"""Every Python and shell block in README.md and docs/*.md runs, as written, against a fresh server.

The convention (docs/design.md, "Documentation that runs"). Each page's blocks run in order, from the
repository's root, with ``TASKRUNNER_MONGO_URI`` set to a fresh embedded server of their own
(``TaskRunner()`` with no URI reads it), in the terminal of a newcomer in a clone: the
project's virtualenv is *not* on ``PATH`` (``uv run taskrunner`` works, a bare ``taskrunner``
does not, and the convention refuses a block that calls it bare):

- each ```python block is a complete program, run alone as the pages say:
  ``uv run python FILE`` (no top-level ``await``, no names from an earlier block);
- ```sh blocks (``bash`` and ``shell`` too) run in ``bash -euo pipefail``, each in a fresh
  shell that has the page's earlier exports and directory; ```console blocks run their
  ``$ `` lines the same way (the rest is sample output, not compared);
- an HTML comment on the line before a fence changes that:
  ``<!-- run: background -->`` starts a block that runs until stopped (a dev server, a
  worker) and stops it with SIGTERM after the page's last block, and
  ``<!-- run: background until=TEXT -->`` also waits for TEXT in its output first;
  ``<!-- run: skip: REASON -->`` does not run it, and must say why (Docker, a real MongoDB,
  minutes of benchmark);
- ```text, ```json, ```jsonc, ```mermaid and ```promql blocks are samples, never run;
  ```js blocks are mongo-shell queries, run by tests/docs/test_docs_queries.py; ```toml, ```yaml
  and ```ini blocks show configuration files. Any other fence (a bare one included) must
  carry a skip directive, so no block is unrun by accident. docs/testing.md's python blocks
  are test modules, run by tests/docs/test_testing_docs.py instead.

``npx`` in a block runs the pinned mongosh of tests/mongosh.py (as npm's registry may be
slow or away), and like the real one it refuses to install without ``--yes`` when nobody
can answer its prompt. A block that fails fails the test with its page, line and output.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mongosh import mongosh_path
from workers import dev_server

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The guides and, under docs/reference/, the API reference pages (named "reference/x.md").
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^\s*```(?P<lang>[\w-]*)")
DIRECTIVE = re.compile(r"<!--\s*run:\s*(?P<mode>[\w-]+)(?P<rest>.*?)\s*-->")
SHELLS = {"sh", "bash", "shell"}
SAMPLES = {"text", "json", "jsonc", "toml", "yaml", "ini", "mermaid", "promql", "js"}
# Pages whose ```python blocks another test runs its own way (as a user's test modules).
PYTHON_RUN_ELSEWHERE = {"testing.md": "tests/docs/test_testing_docs.py"}
MODES = {"background", "skip"}
# A command line that runs the CLI bare (a newcomer in a clone has no `taskrunner` on PATH).
BARE_CLI = re.compile(r"^\s*(\$\s+)?taskrunner\b", re.M)
# Installing into whatever pip, npm or apt the PATH holds would change the tester's machine.
INSTALLS = re.compile(r"\b(pip3?|npm|apt(-get)?|brew)\s+(install|i)\b")
BLOCK_TIMEOUT_S = 180
READY_TIMEOUT_S = 60
STOP_GRACE_S = 15


@dataclass(frozen=True)
class Block:
    """One fenced block of a page, with the run directive written above it (if any)."""

    page: str
    line: int
    lang: str
    code: str
    mode: str | None = None
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        if self.mode == "skip" or (self.lang == "python" and self.page in PYTHON_RUN_ELSEWHERE):
            return False
        return self.lang == "python" or self.lang in SHELLS or self.lang == "console"


def page_name(path: Path) -> str:
    """A docs page by its path under docs/ (``reference/testing.md`` is not ``testing.md``);
    any other file by its name."""
    return str(path.relative_to(DOCS)) if path.is_relative_to(DOCS) else path.name


def parse_page(path: Path) -> tuple[list[Block], list[str]]:
    """A page's fenced blocks and every breach of the convention."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if FENCE.match(lines[i])), len(lines))
        before = lines[index - 1].strip() if index else ""
        block, problem = _block(
            page_name(path), index + 1, opening["lang"], "\n".join(lines[index + 1 : end]), before
        )
        blocks.append(block)
        if problem:
            problems.append(f"{block.where}: {problem}")
        index = end + 1
    return blocks, problems


def _block(page: str, line: int, lang: str, code: str, before: str) -> tuple[Block, str | None]:
    found = DIRECTIVE.fullmatch(before)
    if found is None:
        block = Block(page, line, lang, code)
    else:
        rest = found["rest"].strip()
        block = Block(page, line, lang, code, found["mode"], rest.removeprefix(":").strip())
    return block, _breach(block)


def _breach(block: Block) -> str | None:
    """What is wrong with a block under the convention, if anything."""
    if block.mode is not None and block.mode not in MODES:
        return f"unknown directive 'run: {block.mode}' (one of {sorted(MODES)})"
    if (block.lang in SHELLS or block.lang == "console") and BARE_CLI.search(block.code):
        return "runs `taskrunner` bare, which a clone does not have on PATH: write `uv run taskrunner`"
    if block.mode == "skip":
        return None if block.argument else "'run: skip' must give its reason: <!-- run: skip: REASON -->"
    if block.lang in SAMPLES:
        return None if block.mode is None else f"a run directive on a ```{block.lang} block, which never runs"
    if block.lang == "python" and block.page in PYTHON_RUN_ELSEWHERE:
        return None
    if not block.runs:
        name = f"```{block.lang}" if block.lang else "a bare ```"
        return (
            f"{name} block never runs: use ```python or ```sh, a sample fence, or <!-- run: skip: REASON -->"
        )
    if block.lang == "python" and (problem := _not_a_program(block.code)):
        return problem
    if INSTALLS.search(block.code):
        return "installs software on the machine running the test: <!-- run: skip: REASON --> it"
    if block.lang == "console" and not _console_commands(block.code):
        return "```console block without '$ ' commands: use ```text for output alone"
    if block.mode == "background" and block.argument and not block.argument.startswith("until="):
        return f"'run: background' takes only until=TEXT, not {block.argument!r}"
    return None


def _not_a_program(code: str) -> str | None:
    """Why a python block cannot run alone as ``python FILE``, judged by the compiler."""
    try:
        compile(code, "<block>", "exec")
    except SyntaxError as exc:
        if "await" in str(exc) or "async" in str(exc):
            return (
                "a ```python block is a complete program, run as `uv run python FILE`: "
                f"no top-level await ({exc.msg}); use asyncio.run(main())"
            )
        return f"not valid Python: {exc.msg} (line {exc.lineno})"
    return None


def _console_commands(code: str) -> str:
    return "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))


# -- running a page ---------------------------------------------------------------------------

NPX = r"""#!/usr/bin/env bash
# The docs test's npx: runs the pinned mongosh; like npx, refuses to install without --yes.
if [ "${1:-}" != "--yes" ] && [ ! -t 0 ]; then
  echo "npm error canceled (npx needs --yes to install a package without a prompt)" >&2
  exit 1
fi
[ "${1:-}" = "--yes" ] && shift
[ "${1:-}" = "mongosh" ] || { echo "docs test npx: only 'npx --yes mongosh' is provided" >&2; exit 1; }
shift
HOME="$NPX_MONGOSH_HOME" DO_NOT_TRACK=1 exec "$NPX_MONGOSH" "$@"
"""


def _newcomer_environment(uri: str) -> dict[str, str]:
    """This environment, as a terminal in a clone has it: without the project's virtualenv
    (which ``uv run`` of this test put first on PATH), with the page's server."""
    venv_bin = Path(sys.prefix, "bin") if sys.prefix != sys.base_prefix else None
    path = [p for p in os.environ["PATH"].split(os.pathsep) if p and Path(p) != venv_bin]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PATH": os.pathsep.join(path), "TASKRUNNER_MONGO_URI": uri, "PYTHONUNBUFFERED": "1"}


class PageRun:
    """Runs one page's blocks in order in a scratch directory; failure text names the block."""

    def __init__(self, scratch: Path, uri: str) -> None:
        self.scratch = scratch
        scratch.mkdir(parents=True, exist_ok=True)
        self.env = _newcomer_environment(uri)
        self.stack = ExitStack()
        self.count = 0

    def __enter__(self) -> PageRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def provide_npx(self) -> None:
        """Put the pinned-mongosh npx first on PATH."""
        bin_dir = self.scratch / "bin"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "npx").write_text(NPX)
        (bin_dir / "npx").chmod(0o755)
        self.env.update(NPX_MONGOSH=str(mongosh_path()), NPX_MONGOSH_HOME=str(self.scratch))
        self.env["PATH"] = f"{bin_dir}{os.pathsep}{self.env['PATH']}"

    def run(self, block: Block) -> str | None:
        """Run one block; None when it succeeded, else what to show."""
        self.count += 1
        output = self.scratch / f"block-{self.count}.log"
        if block.mode == "background":
            return self._background(block, output)
        return self._once(block, output)

    def _command(self, block: Block) -> list[str]:
        if block.lang == "python":
            script = self.scratch / f"block-{self.count}.py"
            script.write_text("\n" * block.line + block.code)  # tracebacks cite the page's line numbers
            return ["uv", "run", "python", str(script)]
        code = _console_commands(block.code) if block.lang == "console" else block.code
        if block.mode != "background":  # a page's shell blocks share one terminal's exports and cwd
            state = shlex.quote(str(self.scratch / "shell-state.sh"))
            code = (
                f"trap 'export -p > {state}; echo cd $(printf %q \"$PWD\") >> {state}' EXIT\n"
                f"if [ -e {state} ]; then . {state}; fi\n{code}"
            )
        return ["bash", "--noprofile", "--norc", "-euo", "pipefail", "-c", code]

    def _once(self, block: Block, output: Path) -> str | None:
        with output.open("w") as out:
            try:
                done = subprocess.run(
                    self._command(block),
                    cwd=ROOT,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=BLOCK_TIMEOUT_S,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                return f"still running after {BLOCK_TIMEOUT_S} s:\n{output.read_text()}"
        return None if done.returncode == 0 else f"exit status {done.returncode}:\n{output.read_text()}"

    def _background(self, block: Block, output: Path) -> str | None:
        out = self.stack.enter_context(output.open("w"))
        process = subprocess.Popen(
            self._command(block),
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # SIGTERM reaches `uv run`'s child too
        )
        self.stack.callback(_stop, process)
        ready = block.argument.removeprefix("until=")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while ready and ready not in output.read_text():
            if process.poll() is not None:
                return f"exited ({process.returncode}) before printing {ready!r}:\n{output.read_text()}"
            if time.monotonic() > deadline:
                return f"no {ready!r} within {READY_TIMEOUT_S} s:\n{output.read_text()}"
            time.sleep(0.1)
        return None


def _stop(process: subprocess.Popen[Any]) -> None:
    """SIGTERM the process (its group when it leads one), SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    _signal(process, signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal(process, signal.SIGKILL)
        process.wait()


def _signal(process: subprocess.Popen[Any], signum: int) -> None:
    if os.getpgid(process.pid) == process.pid:
        os.killpg(process.pid, signum)
    else:
        process.send_signal(signum)


def run_page(blocks: list[Block], scratch: Path, uri: str) -> str | None:
    """Run the blocks in order; the first failure as ``page:line (lang): output``, or None."""
    with PageRun(scratch, uri) as page:
        if any(b.runs and "npx" in b.code for b in blocks):
            page.provide_npx()
        for block in blocks:
            if not block.runs:
                continue
            failure = page.run(block)
            if failure is not None:
                return f"{block.where} (```{block.lang}) failed: {failure}\n--- the block:\n{block.code}"
    return None


PARSED = {page_name(page): parse_page(page) for page in PAGES}


def test_every_block_runs_or_says_why_not() -> None:
    """No block is unrun by accident: each fence is run, a sample, or skipped with a reason."""
    problems = [problem for _, page_problems in PARSED.values() for problem in page_problems]
    assert problems == []
    assert sum(b.runs for blocks, _ in PARSED.values() for b in blocks) >= 10


@pytest.mark.embedded
@pytest.mark.timeout(900)  # the first run installs mongosh with npm
@pytest.mark.parametrize(
    "page", [name for name, (blocks, _) in PARSED.items() if any(b.runs for b in blocks)]
)
def test_page_blocks_run(page: str, tmp_path: Path) -> None:
    """Every runnable block of the page exits 0, in order, against the page's own fresh server.

    Embedded only, also with TASKRUNNER_TEST_MONGO_URI: the pages start `taskrunner dev-server`
    themselves and write to the default database and collection, as a reader would, which on a
    shared real server would be neither fresh nor ours to write to.
    """
    blocks = PARSED[page][0]
    with dev_server() as (_, uri):
        failure = run_page(blocks, tmp_path, uri)
    assert failure is None, failure


# -- the convention itself ----------------------------------------------------------------------


def test_parse_page_reports_every_breach(tmp_path: Path) -> None:
    """Unrun languages, bare fences, reasonless skips, stray directives and output-only console are reported."""
    page = tmp_path / "x.md"
    page.write_text(
        "```bash\necho\n```\n"
        "```\nplain\n```\n"
        "<!-- run: skip -->\n```sh\necho\n```\n"
        "<!-- run: background -->\n```text\nout\n```\n"
        "```console\nout\n```\n"
        "<!-- run: later -->\n```sh\necho\n```\n"
        "<!-- run: skip: needs Docker -->\n```dockerfile\nFROM x\n```\n"
        "<!-- run: script -->\n```python\nprint()\n```\n"
        "```sh\npip install taskrunner\n```\n"
        "```python\nawait main()\n```\n"
        "<!-- run: skip: serves until Ctrl-C -->\n```console\n$ taskrunner dashboard\n```\n"
    )
    blocks, problems = parse_page(page)
    assert [(b.line, b.lang, b.mode, b.runs) for b in blocks][:2] == [
        (1, "bash", None, True),
        (4, "", None, False),
    ]
    assert problems == [
        "x.md:4: a bare ``` block never runs: use ```python or ```sh, a sample fence, or <!-- run: skip: REASON -->",
        "x.md:8: 'run: skip' must give its reason: <!-- run: skip: REASON -->",
        "x.md:12: a run directive on a ```text block, which never runs",
        "x.md:15: ```console block without '$ ' commands: use ```text for output alone",
        "x.md:19: unknown directive 'run: later' (one of ['background', 'skip'])",
        "x.md:27: unknown directive 'run: script' (one of ['background', 'skip'])",
        "x.md:30: installs software on the machine running the test: <!-- run: skip: REASON --> it",
        "x.md:33: a ```python block is a complete program, run as `uv run python FILE`: no top-level await "
        "('await' outside function); use asyncio.run(main())",
        "x.md:37: runs `taskrunner` bare, which a clone does not have on PATH: write `uv run taskrunner`",
    ]


def test_a_failing_block_fails_with_its_page_line_and_output(tmp_path: Path) -> None:
    """A shell block that exits non-zero stops the page, and the failure names it and shows its output."""
    page = tmp_path / "x.md"
    page.write_text(
        "```sh\necho first\n```\n\n```sh\necho visible-output\nfalse\necho never\n```\n```sh\necho 3\n```\n"
    )
    blocks, _ = parse_page(page)
    failure = run_page(blocks, tmp_path / "run", "mongodb://127.0.0.1:9")
    assert failure is not None
    assert failure.startswith("x.md:5 (```sh) failed: exit status 1:\nvisible-output\n")
    assert "never\n" not in failure.split("--- the block:")[0]


def test_python_blocks_run_alone_as_programs(tmp_path: Path) -> None:
    """Each python block runs as `uv run python FILE`: no names carry over, and a raise names the page's line."""
    page = tmp_path / "x.md"
    page.write_text(
        "```python\nimport asyncio\nticks = [1]\nasyncio.run(asyncio.sleep(0))\n```\n"
        "```python\nimport sys\nprint('prefix', sys.prefix)\nprint(ticks)\n```\n"
    )
    blocks, problems = parse_page(page)
    assert problems == []
    failure = run_page(blocks, tmp_path / "run", "mongodb://127.0.0.1:9")
    assert failure is not None
    assert failure.startswith("x.md:6 (```python) failed: exit status 1:\n"), failure
    assert f"prefix {sys.prefix}\n" in failure  # the project's environment, through uv run
    assert 'x.md:6"' not in failure and ", line 9, in <module>" in failure
    assert "NameError: name 'ticks' is not defined" in failure


def test_blocks_run_in_a_clones_terminal_without_the_virtualenv_on_path(tmp_path: Path) -> None:
    """A bare `taskrunner` is not found, as in a newcomer's terminal in a clone; `uv run taskrunner` is."""
    page = tmp_path / "x.md"
    page.write_text("```sh\nuv run taskrunner --version\n```\n```sh\nwhich taskrunner\n```\n")
    blocks, _ = parse_page(page)
    failure = run_page(blocks, tmp_path / "run", "mongodb://127.0.0.1:9")
    assert failure is not None and failure.startswith("x.md:4 (```sh) failed: exit status 1:"), failure


def test_background_blocks_wait_until_ready_and_stop_at_the_end(tmp_path: Path) -> None:
    """A background block must print its ready text; it is still running for later blocks, then stopped."""
    page = tmp_path / "x.md"
    marker = tmp_path / "stopped"
    page.write_text(
        "<!-- run: background until=ready -->\n"
        f"```sh\ntrap 'touch {shlex.quote(str(marker))}; exit 0' TERM\necho ready\n"
        "while true; do sleep 0.1; done\n```\n"
        f"```sh\ntest ! -e {shlex.quote(str(marker))}\n```\n"
    )
    blocks, problems = parse_page(page)
    assert problems == []
    assert run_page(blocks, tmp_path / "run", "mongodb://127.0.0.1:9") is None
    assert marker.exists()


def test_shell_blocks_of_a_page_share_exports_and_directory(tmp_path: Path) -> None:
    """A later shell block sees an earlier one's exports and cwd, as in one terminal."""
    page = tmp_path / "x.md"
    page.write_text(
        "```sh\nexport GREETING=hello\ncd /tmp\n```\n"
        '```console\n$ test "$GREETING" = hello\n$ test "$PWD" = /tmp\nsample output\n```\n'
    )
    blocks, problems = parse_page(page)
    assert problems == []
    assert run_page(blocks, tmp_path / "run", "mongodb://127.0.0.1:9") is None


def test_npx_runs_the_pinned_mongosh_only_with_yes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``npx --yes mongosh`` reaches the pinned binary; plain ``npx mongosh`` fails as it does without a prompt."""
    monkeypatch.setattr(sys.modules[__name__], "mongosh_path", lambda: Path("/bin/echo"))
    page = tmp_path / "x.md"
    page.write_text('```sh\ntest "$(npx --yes mongosh hi)" = hi\n```\n```sh\nnpx mongosh hi\n```\n')
    blocks, _ = parse_page(page)
    failure = run_page(blocks, tmp_path / "run", "mongodb://127.0.0.1:9")
    assert failure is not None
    assert failure.startswith("x.md:4 (```sh) failed: exit status 1:\nnpm error canceled"), failure


# -- the README's path for a newcomer -----------------------------------------------------------


def test_readme_publishes_with_the_app_so_params_are_checked() -> None:
    """The README's first `publish` runs with the example app (TASKRUNNER_APP), and the refusal it
    shows for a missing field is what the command prints, exit 1, before touching any server."""
    blocks = [b for b in PARSED["README.md"][0] if b.runs and b.lang in SHELLS]
    before = "\n".join(b.code for b in blocks).split("taskrunner publish", 1)[0]
    app = re.findall(r"^export TASKRUNNER_APP=(\S+)$", before, re.M)
    assert app == ["examples.app:runner"], "README's publish runs without the app: params go unchecked"
    sample = next(b for b in PARSED["README.md"][0] if b.lang == "text" and b.code.startswith("error:"))
    env = {**os.environ, "TASKRUNNER_APP": app[0], "TASKRUNNER_MONGO_URI": "mongodb://127.0.0.1:9"}
    refused = subprocess.run(
        [sys.executable, "-m", "taskrunner", "publish", "resize", "--params", '{"image": "a.png"}'],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 1 and refused.stderr.startswith(sample.code.strip()), refused.stderr


def test_readme_lists_the_pages_in_the_sites_order() -> None:
    """README's documentation list follows mkdocs.yml's nav (publishing first), every docs page once."""
    readme = (ROOT / "README.md").read_text().split("## Documentation", 1)[1]
    listed = re.findall(r"^- \[docs/([\w-]+\.md)\]", readme, re.M)
    nav = re.findall(r"^\s+- [^:]+: ([\w-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert listed == [page for page in nav if page != "index.md"]


def test_readme_stops_the_server_after_the_last_block_that_needs_it() -> None:
    """The README says to stop the dev server only after its last block that uses it (the Python script)."""
    text = (ROOT / "README.md").read_text()
    stop = text.index("stop the worker and the server with Ctrl+C")
    last_script = max(b.line for b in PARSED["README.md"][0] if b.runs and b.lang == "python")
    assert stop > len("\n".join(text.splitlines()[:last_script]))
