"""``taskrunner demo``: the whole engine on one machine in about fifteen seconds.

It starts the embedded server, three real ``taskrunner worker`` processes and a batch
of sample tasks, SIGKILLs the worker running ``slow-2`` mid-run, and shows live how
another worker takes the task over once the dead worker's lease expires. The demo only
watches the documents (as any operator could); the workers do all the work.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

import taskrunner
from taskrunner.dev import demo_app
from taskrunner.dev.server import ServerThread
from taskrunner.errors import TaskRunnerError
from taskrunner.models import EntryState, Task, TaskState, WorkerEntry
from taskrunner.runner import TaskRunner

APP_REF = "taskrunner.dev.demo_app:runner"
VICTIM_KEY = "slow-2"
KILL_AFTER = 1.0  # seconds into the victim's run: long enough that it has pinged at least once
WORKER_SLOTS = 2  # per worker; small, so the batch spreads over every worker
POLL_SECONDS = 0.2
DEADLINE_SECONDS = 60.0  # a healthy run takes ~10 s; past this something is wrong
STOP_GRACE_SECONDS = 5.0
# Short heartbeats so the takeover happens within seconds instead of the default 30.
TIMINGS = {"ping_interval": 0.5, "ping_timeout": 2.0, "retry_backoff": 1.0, "max_failures": 3}
STATE_STYLES = {"PENDING": "dim", "RUNNING": "yellow", "SUCCESS": "green", "FAIL": "red", "CANCELED": "red"}


class DemoError(TaskRunnerError):
    """The demo could not run (no embedded server, a worker died on its own, ...)."""


@dataclass(frozen=True)
class Sample:
    key: str
    name: str
    seconds: float
    priority: int = 0
    concurrency: int = 1

    def spec(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "params": {"seconds": self.seconds},
                "priority": self.priority, "concurrency": self.concurrency, **TIMINGS}  # fmt: skip


# Priorities interleave slow and other tasks, so the first worker up does not grab two
# slow ones; slow-2's worker usually claims ``pair`` next, so the kill costs one slow
# run and often one slot of the concurrency-2 task (the summary reports each takeover).
SAMPLES = (
    Sample("slow-1", "sleep", 4.0, priority=9),
    Sample("flaky", "flaky", 0.5, priority=8),
    Sample("slow-2", "sleep", 4.0, priority=7),
    Sample("pair", "sleep", 1.5, priority=6, concurrency=2),
    Sample("slow-3", "sleep", 4.0, priority=5),
    *(Sample(f"quick-{i}", "sleep", 0.3) for i in range(1, 5)),
)


# -- what the demo observed ---------------------------------------------------------------------
@dataclass(frozen=True)
class Kill:
    worker_id: str
    pid: int
    at: datetime  # server clock, comparable with the entries' claimed_at
    runs: dict[str, WorkerEntry]  # key -> the killed worker's RUNNING entry, now lost


@dataclass(frozen=True)
class Takeover:
    key: str
    lost: WorkerEntry
    owner: str
    after: float  # seconds from the kill to the new owner's claim

    def describe(self) -> str:
        return (f"takeover: {self.key} was running on {self.lost.worker_id} (killed), "
                f"taken over by {self.owner} after {self.after:.1f} s")  # fmt: skip


@dataclass
class Observed:
    started: float = field(default_factory=time.monotonic)
    tasks: dict[str, Task] = field(default_factory=dict)
    victim_seen: float | None = None
    kill: Kill | None = None
    takeovers: dict[str, Takeover] = field(default_factory=dict)
    timed_out: bool = False

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def finished(self) -> bool:
        return len(self.tasks) == len(SAMPLES) and all(t.state.finished for t in self.tasks.values())

    def new_takeovers(self) -> list[Takeover]:
        if self.kill is None:
            return []
        found = [_takeover(self.tasks[key], lost, self.kill.at) for key, lost in self.kill.runs.items()
                 if key not in self.takeovers and key in self.tasks]  # fmt: skip
        new = [t for t in found if t is not None]
        self.takeovers.update((t.key, t) for t in new)
        return new

    def problems(self) -> list[str]:
        wrong = [f"{s.key} is {self.tasks[s.key].state if s.key in self.tasks else 'missing'}"
                 for s in SAMPLES if s.key not in self.tasks or self.tasks[s.key].state is not TaskState.SUCCESS]  # fmt: skip
        if self.kill is None:
            wrong.append(f"no worker was killed ({VICTIM_KEY} never ran long enough)")
        else:
            wrong += [f"{key} was never taken over" for key in self.kill.runs if key not in self.takeovers]
        return wrong + (["timed out"] if self.timed_out else [])


def _takeover(task: Task, lost: WorkerEntry, killed_at: datetime) -> Takeover | None:
    """The first claim by another worker after the kill, once the lost run is gone."""
    if task.entry(lost.run_id) is not None:
        return None  # the dead worker's lease has not expired, or nobody claimed yet
    later = [e for e in task.workers if e.worker_id != lost.worker_id and e.claimed_at > killed_at]
    if not later:
        return None
    owner = min(later, key=lambda e: e.claimed_at)
    return Takeover(task.key, lost, owner.worker_id, (owner.claimed_at - killed_at).total_seconds())


def _running_entry(task: Task | None) -> WorkerEntry | None:
    entries = task.workers if task else []
    return next((e for e in entries if e.state is EntryState.RUNNING), None)


# -- worker processes -----------------------------------------------------------------------------
class WorkerPool:
    """The demo's worker processes; all of them are gone once ``stop`` returns."""

    def __init__(self, runner: TaskRunner) -> None:
        self.runner = runner
        fd, self.log_path = tempfile.mkstemp(prefix="taskrunner-demo-", suffix=".jsonl")
        os.close(fd)
        # JSON logs go to a file, not the terminal; append mode because the workers share it.
        self.log: IO[bytes] = open(self.log_path, "ab")  # noqa: SIM115  (closed by stop)
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.killed: set[str] = set()

    def env(self) -> dict[str, str]:
        # The workers must use the demo's server and collection whatever the caller's
        # environment says, and import this very taskrunner (from any cwd).
        package_root = str(Path(taskrunner.__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": path, "TASKRUNNER_MONGO_URI": self.runner.mongo_uri,
                "TASKRUNNER_DATABASE": self.runner.database, "TASKRUNNER_COLLECTION": self.runner.collection}  # fmt: skip

    async def start(self, count: int) -> None:
        env = self.env()
        for i in range(1, count + 1):
            worker_id = f"demo-w{i}"
            self.procs[worker_id] = await asyncio.create_subprocess_exec(
                *_worker_command(worker_id), env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=self.log, stderr=self.log,
            )  # fmt: skip

    async def kill(self, worker_id: str) -> int:
        """SIGKILL: no graceful release, so only lease expiry can free its tasks."""
        proc = self.procs[worker_id]
        self.killed.add(worker_id)
        proc.kill()
        await proc.wait()
        return proc.pid

    def check(self) -> None:
        for worker_id, proc in self.procs.items():
            if proc.returncode is not None and worker_id not in self.killed:
                raise DemoError(f"worker {worker_id} exited with code {proc.returncode}; see {self.log_path}")

    async def stop(self) -> None:
        alive = [p for p in self.procs.values() if p.returncode is None]
        for proc in alive:
            with suppress(ProcessLookupError):
                proc.terminate()  # graceful: a worker releases its claims
        with suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in alive)), STOP_GRACE_SECONDS)
        for proc in alive:
            if proc.returncode is None:
                with suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self.log.close()


def _worker_command(worker_id: str) -> list[str]:
    return [sys.executable, "-m", "taskrunner", "worker", "--app", APP_REF, "--worker-id", worker_id,
            "--concurrency", str(WORKER_SLOTS), "--log-format", "json", "--log-level", "warning"]  # fmt: skip


# -- rendering ------------------------------------------------------------------------------------
def _state_text(state: str) -> Text:
    return Text(state, style=STATE_STYLES.get(state, ""))


def _entry_text(entry: WorkerEntry, *, lost: bool = False) -> Text:
    if lost:
        return Text(f"{entry.worker_id} ✗ killed #{entry.attempt}", style="bold red")
    if entry.state is EntryState.SUCCESS:
        return Text(f"{entry.worker_id} ✓ #{entry.attempt}", style="green")
    if entry.state is EntryState.FAIL:
        error = entry.error.type if entry.error else "failed"
        return Text(f"{entry.worker_id} ✗ {error} #{entry.attempt}", style="red")
    return Text(f"{entry.worker_id} ▶ running #{entry.attempt}", style="yellow")


def _workers_cell(task: Task, observed: Observed, *, note_takeover: bool = True) -> Text:
    # The killed run stays listed after a claim drops it from the document; claim order.
    lost = observed.kill.runs.get(task.key) if observed.kill else None
    entries = [e for e in task.workers if lost is None or e.run_id != lost.run_id] + ([lost] if lost else [])
    entries.sort(key=lambda e: e.attempt)
    cell = Text(" → ").join(_entry_text(e, lost=e is lost) for e in entries)
    if note_takeover and task.key in observed.takeovers:
        cell.append(f"  (takeover after {observed.takeovers[task.key].after:.1f} s)", style="bold")
    return cell


def _rows(observed: Observed) -> Iterable[tuple[Sample, Task | None]]:
    return ((sample, observed.tasks.get(sample.key)) for sample in SAMPLES)


def progress_table(observed: Observed) -> Table:
    table = Table(title=f"taskrunner demo  {observed.elapsed():5.1f} s", title_justify="left")
    for column in ("key", "name", "state", "failures", "workers (entries)"):
        table.add_column(column, no_wrap=column != "workers (entries)")
    for sample, task in _rows(observed):
        if task is None:
            table.add_row(sample.key, sample.name, "-", "-", "")
            continue
        table.add_row(task.key, task.name, _state_text(task.state.value), str(task.failures),
                      _workers_cell(task, observed))  # fmt: skip
    return table


def summary_table(observed: Observed) -> Table:
    table = Table(title="Final summary", title_justify="left")
    for column in ("key", "state", "failures", "ran on (in claim order)"):
        table.add_column(column, no_wrap=column == "key")
    for sample, task in _rows(observed):
        if task is None:
            table.add_row(sample.key, _state_text("missing"), "-", "")
            continue
        state = _state_text(task.state.value)
        if task.state is not TaskState.SUCCESS:
            state.append(" (expected SUCCESS)")
        table.add_row(task.key, state, str(task.failures), _workers_cell(task, observed, note_takeover=False))
    return table


def say(console: Console, message: str, style: str | None = None) -> None:
    """One unwrapped, literal line: readable when piped too, and safe for paths with brackets."""
    console.print(message, style=style, soft_wrap=True, markup=False, highlight=False)


def print_summary(console: Console, observed: Observed, log_path: str) -> None:
    console.print()
    console.print(summary_table(observed))
    for takeover in observed.takeovers.values():
        say(console, takeover.describe(), "bold")
    problems = observed.problems()
    if problems:
        say(console, f"result: FAILED: {'; '.join(problems)}", "bold red")
    else:
        say(console, f"result: all {len(SAMPLES)} tasks SUCCESS as expected in {observed.elapsed():.1f} s",
            "bold green")  # fmt: skip
    say(console, f"worker logs (JSON lines): {log_path}", "dim")


# -- the run --------------------------------------------------------------------------------------
def _start_server() -> ServerThread:
    """A server on its own thread and loop, so it keeps serving while this loop renders."""
    try:
        server = ServerThread()
    except RuntimeError as exc:
        raise DemoError(f"the demo runs an embedded MongoDB-compatible server: {exc}") from None
    server.start()
    return server


async def _maybe_kill(observed: Observed, runner: TaskRunner, pool: WorkerPool, live: Live) -> None:
    victim = _running_entry(observed.tasks.get(VICTIM_KEY))
    if victim is None:
        return
    if observed.victim_seen is None:
        observed.victim_seen = time.monotonic()
    if time.monotonic() - observed.victim_seen < KILL_AFTER:
        return
    pid = await pool.kill(victim.worker_id)
    at = await runner.store.server_time()
    # Read again after the process is dead: nothing it claimed can change any more.
    tasks = await runner.store.find()
    runs = {t.key: e for t in tasks for e in t.workers
            if e.worker_id == victim.worker_id and e.state is EntryState.RUNNING}  # fmt: skip
    observed.kill = Kill(victim.worker_id, pid, at, runs)
    say(live.console, f"[{observed.elapsed():4.1f} s] SIGKILL {victim.worker_id} (pid {pid}) while it ran "
                      f"{', '.join(runs)}; its lease expires within {TIMINGS['ping_timeout']:g} s")  # fmt: skip


async def _watch(observed: Observed, runner: TaskRunner, pool: WorkerPool, live: Live) -> None:
    while not observed.finished():
        if observed.elapsed() > DEADLINE_SECONDS:
            observed.timed_out = True
            return
        pool.check()
        observed.tasks = {t.key: t for t in await runner.store.find()}
        if observed.kill is None:
            await _maybe_kill(observed, runner, pool, live)
        for takeover in observed.new_takeovers():
            say(live.console, f"[{observed.elapsed():4.1f} s] {takeover.describe()}")
        live.update(progress_table(observed))
        await asyncio.sleep(POLL_SECONDS)


async def _run(runner: TaskRunner, console: Console, workers: int) -> bool:
    await runner.init()
    observed, pool = Observed(), WorkerPool(runner)
    try:
        await pool.start(workers)
        say(console, f"started {workers} workers ({', '.join(pool.procs)}); publishing {len(SAMPLES)} tasks")
        await runner.publish_many(s.spec() for s in SAMPLES)
        # Transient: the final summary replaces the live table.
        with Live(progress_table(observed), console=console, refresh_per_second=8, transient=True) as live:
            await _watch(observed, runner, pool, live)
    finally:
        await pool.stop()
    print_summary(console, observed, pool.log_path)
    return not observed.problems()


@contextmanager
def _cancelled_by_sigterm() -> Iterator[list[bool]]:
    """SIGTERM cancels the demo like Ctrl-C does, so the cleanup still runs."""
    loop, task, received = asyncio.get_running_loop(), asyncio.current_task(), [False]

    def on_sigterm() -> None:
        received[0] = True
        if task is not None:
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        yield received
        return
    try:
        yield received
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def run_demo(*, console: Console | None = None, workers: int = 3) -> bool:
    """Run the demo; True when every task ended SUCCESS and the takeover happened."""
    if workers < 2:
        raise DemoError("the demo needs at least 2 workers: one is killed, another takes over")
    console = console or Console(highlight=False)
    with _cancelled_by_sigterm() as terminated:
        try:
            return await _serve_and_run(console, workers)
        except asyncio.CancelledError:
            if terminated[0]:
                raise DemoError("terminated by SIGTERM; workers and server stopped") from None
            raise


async def _serve_and_run(console: Console, workers: int) -> bool:
    server = _start_server()
    try:
        say(console, f"embedded server at {server.uri}")
        runner = demo_app.runner.copy(mongo_uri=server.uri)
        try:
            return await _run(runner, console, workers)
        finally:
            await runner.close()
    finally:
        server.stop()
