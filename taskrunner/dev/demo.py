"""``taskrunner demo``: the whole engine on one machine in about fifteen seconds.

It starts the embedded server, three real ``taskrunner worker`` processes and a batch
of sample tasks, SIGKILLs the worker running ``slow-2`` mid-run, and shows live how
another worker takes the task over once the dead worker's lease expires. The demo only
watches the documents (as any operator could); the workers do all the work. Each run is
drawn on the demo's timeline, so the concurrency-2 task's two runs show side by side.
Worker logs go to a temporary directory, removed at the end unless the demo failed.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from taskrunner.dev import demo_app
from taskrunner.dev.processes import ProcessGroup, worker_env
from taskrunner.dev.server import ServerThread
from taskrunner.errors import TaskRunnerError
from taskrunner.models import EntryState, Task, TaskState, WorkerEntry
from taskrunner.options import TaskSpec
from taskrunner.runner import TaskRunner

APP_REF = "taskrunner.dev.demo_app:runner"
VICTIM_KEY = "slow-2"
KILL_AFTER = 1.0  # seconds into the victim's run: long enough that it has pinged at least once
WORKER_SLOTS = 2  # per worker; small, so the batch spreads over every worker
POLL_SECONDS = 0.2
DEADLINE_SECONDS = 60.0  # a healthy run takes ~10 s; past this something is wrong
STOP_GRACE_SECONDS = 5.0
TIMELINE_WIDTH = 24  # characters for the whole run so far
RUNS_COLUMN = "runs (timeline: overlapping bars ran at the same time)"
# Short heartbeats so the takeover happens within seconds instead of the default 30.
PING_TIMEOUT = 2.0
"""Short leases and retries, so a killed worker's task moves on within seconds."""
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

    def spec(self) -> TaskSpec:
        return {
            "key": self.key,
            "name": self.name,
            "params": {"seconds": self.seconds},
            "priority": self.priority,
            "concurrency": self.concurrency,
            "ping_interval": 0.5,
            "ping_timeout": PING_TIMEOUT,
            "retry_backoff": 1.0,
            "max_failures": 3,
        }


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
        return (
            f"takeover: {self.key} was running on {self.lost.worker_id} (killed), "
            f"taken over by {self.owner} after {self.after:.1f} s"
        )


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

    def timeline_span(self) -> tuple[datetime, float]:
        """The timeline's origin (the first claim) and its length in seconds (to the last finish, or now)."""
        entries = [e for task in self.tasks.values() for e in task.workers]
        now = datetime.now(UTC)  # the embedded server runs on this machine: its clock is ours
        origin = min((e.claimed_at for e in entries), default=now)
        end = max((e.finished_at or now for e in entries), default=now)
        return origin, max((end - origin).total_seconds(), 0.1)

    def finished(self) -> bool:
        return len(self.tasks) == len(SAMPLES) and all(t.state.finished for t in self.tasks.values())

    def new_takeovers(self) -> list[Takeover]:
        if self.kill is None:
            return []
        pending = [(key, lost) for key, lost in self.kill.runs.items() if key not in self.takeovers]
        found = [_takeover(self.tasks[key], lost, self.kill.at) for key, lost in pending if key in self.tasks]
        new = [t for t in found if t is not None]
        self.takeovers.update((t.key, t) for t in new)
        return new

    def problems(self) -> list[str]:
        wrong = [
            f"{s.key} is {_state_of(self.tasks.get(s.key))}"
            for s in SAMPLES
            if s.key not in self.tasks or self.tasks[s.key].state is not TaskState.SUCCESS
        ]
        if self.kill is None:
            wrong.append(f"no worker was killed ({VICTIM_KEY} never ran long enough)")
        else:
            wrong += [f"{key} was never taken over" for key in self.kill.runs if key not in self.takeovers]
        return wrong + (["timed out"] if self.timed_out else [])


def _state_of(task: Task | None) -> str:
    return "missing" if task is None else task.state.value


def _takeover(task: Task, lost: WorkerEntry, killed_at: datetime) -> Takeover | None:
    """The first claim by another worker after the kill, once the lost run is gone."""
    if task.entry(lost.run_id) is not None:
        return None  # the dead worker's lease has not expired, or nobody claimed yet
    later = [e for e in task.workers if e.worker_id != lost.worker_id and e.claimed_at > killed_at]
    if not later:
        return None
    owner = min(later, key=lambda e: e.claimed_at)
    return Takeover(task.key, lost, owner.worker_id, (owner.claimed_at - killed_at).total_seconds())


def _running_on(task: Task, worker_id: str) -> list[WorkerEntry]:
    return [e for e in task.workers if e.worker_id == worker_id and e.state is EntryState.RUNNING]


def _running_entry(task: Task | None) -> WorkerEntry | None:
    entries = task.workers if task else []
    return next((e for e in entries if e.state is EntryState.RUNNING), None)


# -- worker processes -----------------------------------------------------------------------------
class WorkerPool:
    """The demo's worker processes, logging to a temporary directory; all gone once ``stop`` returns."""

    def __init__(self, runner: TaskRunner) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix="taskrunner-demo-"))
        env = worker_env(runner.mongo_uri, database=runner.database, collection=runner.collection)
        self.group = ProcessGroup(self.log_dir, env)
        self.killed: set[str] = set()

    @property
    def names(self) -> list[str]:
        return list(self.group.processes)

    def start(self, count: int) -> None:
        for i in range(1, count + 1):
            args = ("--concurrency", str(WORKER_SLOTS), "--log-level", "warning")
            self.group.worker(f"demo-w{i}", APP_REF, *args)

    async def kill(self, worker_id: str) -> int:
        """SIGKILL: no graceful release, so only lease expiry can free its tasks."""
        process = self.group[worker_id]
        self.killed.add(worker_id)
        process.kill()
        await process.exited(STOP_GRACE_SECONDS)
        return process.pid

    def check(self) -> None:
        for name, process in self.group.processes.items():
            if process.returncode is not None and name not in self.killed:
                raise DemoError(
                    f"worker {name} exited with code {process.returncode}; logs kept in {self.log_dir}"
                )

    async def stop(self) -> None:
        """SIGTERM (workers release their claims), then SIGKILL whatever outlives the grace."""
        await self.group.terminate_all(STOP_GRACE_SECONDS)

    def remove_logs(self) -> None:
        shutil.rmtree(self.log_dir, ignore_errors=True)


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


def timeline(start: float, end: float, span: float, width: int = TIMELINE_WIDTH) -> str:
    """A bar over ``width`` characters covering seconds ``start`` to ``end`` of ``span``."""
    scale = width / max(span, 1e-9)
    first = min(max(int(start * scale), 0), width - 1)
    last = min(max(round(end * scale), first + 1), width)
    return " " * first + "━" * (last - first) + " " * (width - last)


def _ran(entry: WorkerEntry, observed: Observed, origin: datetime, *, lost: bool) -> tuple[float, float]:
    """Seconds since ``origin`` when the run started and ended (now, while it runs)."""
    end = observed.kill.at if lost and observed.kill else entry.finished_at or datetime.now(UTC)
    return (entry.claimed_at - origin).total_seconds(), (end - origin).total_seconds()


def _workers_cell(task: Task, observed: Observed, *, note_takeover: bool = True) -> Text:
    """One line per run, drawn on the demo's timeline: overlapping bars ran at the same time."""
    # The killed run stays listed after a claim drops it from the document.
    lost = observed.kill.runs.get(task.key) if observed.kill else None
    entries = [e for e in task.workers if lost is None or e.run_id != lost.run_id] + ([lost] if lost else [])
    entries.sort(key=lambda e: e.claimed_at)
    origin, span = observed.timeline_span()
    lines = []
    for entry in entries:
        start, end = _ran(entry, observed, origin, lost=entry is lost)
        line = Text(timeline(start, end, span), style="cyan")
        lines.append(line.append(" ").append_text(_entry_text(entry, lost=entry is lost)))
    cell = Text("\n").join(lines)
    if note_takeover and task.key in observed.takeovers:
        cell.append(f"  (takeover after {observed.takeovers[task.key].after:.1f} s)", style="bold")
    return cell


def _rows(observed: Observed) -> Iterable[tuple[Sample, Task | None]]:
    return ((sample, observed.tasks.get(sample.key)) for sample in SAMPLES)


def progress_table(observed: Observed) -> Table:
    table = Table(title=f"taskrunner demo  {observed.elapsed():5.1f} s", title_justify="left")
    for column in ("key", "name", "state", "failures", RUNS_COLUMN):
        table.add_column(column, no_wrap=column != RUNS_COLUMN)
    for sample, task in _rows(observed):
        if task is None:
            table.add_row(sample.key, sample.name, "-", "-", "")
            continue
        state = _state_text(task.state.value)
        table.add_row(task.key, task.name, state, str(task.failures), _workers_cell(task, observed))
    return table


def summary_table(observed: Observed) -> Table:
    table = Table(title="Final summary", title_justify="left")
    for column in ("key", "state", "failures", RUNS_COLUMN):
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


def print_summary(console: Console, observed: Observed, log_dir: Path) -> None:
    console.print()
    console.print(summary_table(observed))
    for takeover in observed.takeovers.values():
        say(console, takeover.describe(), "bold")
    problems = observed.problems()
    if problems:
        say(console, f"result: FAILED: {'; '.join(problems)}", "bold red")
        say(console, f"worker logs (JSON lines) kept in {log_dir}; remove them with: rm -r {log_dir}", "dim")
    else:
        done = f"result: all {len(SAMPLES)} tasks SUCCESS as expected in {observed.elapsed():.1f} s"
        say(console, done, "bold green")


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
    runs = {t.key: e for t in tasks for e in _running_on(t, victim.worker_id)}
    observed.kill = Kill(victim.worker_id, pid, at, runs)
    expiry = f"its lease expires within {PING_TIMEOUT:g} s"
    say(
        live.console,
        f"[{observed.elapsed():4.1f} s] SIGKILL {victim.worker_id} (pid {pid}) while it ran "
        f"{', '.join(runs)}; {expiry}",
    )


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
    pool = WorkerPool(runner)
    try:
        ok = await _observe(runner, console, pool, workers)
    except asyncio.CancelledError:
        pool.remove_logs()  # stopped by the user: nothing went wrong
        raise
    except Exception:
        say(
            console,
            f"worker logs (JSON lines) kept in {pool.log_dir}; remove them with: rm -r {pool.log_dir}",
        )
        raise
    if ok:
        pool.remove_logs()
    return ok


async def _observe(runner: TaskRunner, console: Console, pool: WorkerPool, workers: int) -> bool:
    """Start the workers, publish the samples, watch until done; print the summary."""
    observed = Observed()
    try:
        pool.start(workers)
        say(console, f"started {workers} workers ({', '.join(pool.names)}); publishing {len(SAMPLES)} tasks")
        await runner.publish_many(s.spec() for s in SAMPLES)
        # Transient: the final summary replaces the live table.
        with Live(progress_table(observed), console=console, refresh_per_second=8, transient=True) as live:
            await _watch(observed, runner, pool, live)
    finally:
        await pool.stop()
    print_summary(console, observed, pool.log_dir)
    return not observed.problems()


async def run_demo(*, console: Console | None = None, workers: int = 3) -> bool:
    """Run the demo; True when every task ended SUCCESS and the takeover happened.

    Cancelling it (``taskrunner demo`` does on SIGINT/SIGTERM) stops the workers and the server.
    """
    if workers < 2:
        raise DemoError("the demo needs at least 2 workers: one is killed, another takes over")
    console = console or Console(highlight=False)
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
