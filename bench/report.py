"""Render the benchmark results as docs/benchmarks.md with PNG plots in docs/benchmarks/.

Reads the JSON lines of bench/results.jsonl (format in bench/common.py), drops
smoke runs and lines without a ``config`` (older formats), groups the rest by
(bench, config) and reports, per group, the **median of the latest 3 runs** of
each figure (``n=2`` etc. when fewer); list figures (latencies, samples) are
pooled over those runs. Benches without results render as "not run yet". ``--include-smoke`` keeps smoke
lines (only for checking the rendering: bench/suite.py --smoke).

    uv run python bench/report.py [--results bench/results.jsonl] [--out docs/benchmarks.md]

Plots go next to the markdown, into ``<out dir>/benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on CI or servers
import matplotlib.pyplot as plt  # after choosing the backend

HERE = Path(__file__).resolve().parent
LATEST = 3
NONE = "-"  # a figure no run reported
META = {"bench", "config", "smoke", "machine", "when"}


# -- loading and grouping ------------------------------------------------------------------
@dataclass
class Group:
    """The latest runs of one bench with one config."""

    bench: str
    config: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.runs)

    def median(self, figure: str) -> float | None:
        values = [r[figure] for r in self.runs if isinstance(r.get(figure), int | float)]
        return statistics.median(values) if values else None

    def median_dict(self, figure: str) -> dict[str, float]:
        """Per-key medians of a dict figure (e.g. per_task_by_job)."""
        keys = sorted({k for r in self.runs if isinstance(r.get(figure), dict) for k in r[figure]})
        out = {}
        for key in keys:
            values = [
                r[figure][key]
                for r in self.runs
                if isinstance(r.get(figure), dict) and isinstance(r[figure].get(key), int | float)
            ]
            if values:
                out[key] = statistics.median(values)
        return out

    def pooled(self, figure: str) -> list[float]:
        return [float(v) for r in self.runs if isinstance(r.get(figure), list) for v in r[figure]]

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)


def load(path: Path, *, smoke: bool = False) -> list[dict[str, Any]]:
    """Usable lines: parsed, with a dict ``config``, not smoke unless asked; in file order."""
    lines = []
    if not path.exists():
        return lines
    for raw in path.read_text().splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if (
            isinstance(line, dict)
            and isinstance(line.get("config"), dict)
            and (smoke or not line.get("smoke"))
        ):
            lines.append(line)
    return lines


def group(lines: Iterable[dict[str, Any]]) -> dict[str, list[Group]]:
    """bench -> its groups, each holding its latest ``LATEST`` runs (by ``when``, then file order)."""
    by_key: dict[tuple[str, str], Group] = {}
    ordered = sorted(enumerate(lines), key=lambda il: (str(il[1].get("when", "")), il[0]))
    for _, line in ordered:
        key = (str(line.get("bench")), json.dumps(line["config"], sort_keys=True))
        by_key.setdefault(key, Group(key[0], line["config"])).runs.append(line)
    benches: dict[str, list[Group]] = {}
    for g in by_key.values():
        g.runs = g.runs[-LATEST:]
        benches.setdefault(g.bench, []).append(g)
    return benches


# -- formatting ---------------------------------------------------------------------------
def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return NONE
    return f"{value:.{digits}f}".rstrip("0").rstrip(".") if digits else f"{value:.0f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def numeric(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else float("inf")


class Report:
    """Accumulates markdown lines and writes plots next to it."""

    def __init__(self, out: Path, benches: dict[str, list[Group]]) -> None:
        self.out, self.benches = out, benches
        self.plots = out.parent / "benchmarks"
        self.lines: list[str] = []

    def groups(self, bench: str, key: Callable[[Group], Any] | None = None) -> list[Group]:
        found = self.benches.get(bench, [])
        return sorted(found, key=key) if key else found

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def plot(self, name: str, title: str, draw: Callable[[Any], None]) -> None:
        """Draw one figure into ``benchmarks/<name>.png`` and link it."""
        self.plots.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        try:
            draw(ax)
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
            fig.tight_layout()
            fig.savefig(self.plots / f"{name}.png", dpi=100)
        finally:
            plt.close(fig)
        self.add("", f"![{title}](benchmarks/{name}.png)")

    def command(self, *commands: str) -> None:
        self.add("", "Reproduce:", "", "```sh", *commands, "```")

    def not_run(self, bench: str) -> bool:
        if self.groups(bench):
            return False
        self.add("", f"Not run yet (no `{bench}` results).")
        return True


# -- targets ------------------------------------------------------------------------------
def worst(groups: list[Group], figure: str) -> float | None:
    values = [v for g in groups if (v := g.median(figure)) is not None]
    return max(values) if values else None


def target_rows(r: Report) -> list[list[str]]:
    rows = []

    def row(target: str, measured: float | None, limit: float, note: str, digits: int = 2) -> None:
        met = "not run yet" if measured is None else ("yes" if measured <= limit else "**no**")
        rows.append([target, NONE if measured is None else f"{fmt(measured, digits)} {note}".strip(), met])

    default = [g for g in r.groups("roundtrips") if g.get("batching")]
    total = worst(default, "roundtrips_per_task")
    note = f"(worst over workers; all commands: {fmt(total)})" if total is not None else ""
    for target, limit in (("by default", 2.0), ("under load with batching", 1.2)):
        row(
            f"worker round trips per task ≤ {limit} {target}",
            worst(default, "worker_writes_per_task"),
            limit,
            note,
        )
    unbatched = [g for g in r.groups("roundtrips") if not g.get("batching")]
    if unbatched:
        measured = worst(unbatched, "worker_writes_per_task")
        rows.append(
            [
                "(for comparison, no target) claim batching off, `--batch 1`",
                f"{fmt(measured)} (all commands: {fmt(worst(unbatched, 'roundtrips_per_task'))})",
                "-",
            ]
        )
    storm = [g for g in r.groups("claim_storm") if g.get("workers") == 16]
    row("claim attempts per claim ≤ 1.3 with 16 workers", worst(storm, "attempts_per_claim"), 1.3, "")
    stream = [g for g in r.groups("pickup") if g.get("mode") == "stream"]
    row("pickup p50 ≤ 15 ms (streams)", worst(stream, "p50_ms"), 15, "ms")
    row("pickup p99 ≤ 100 ms (streams)", worst(stream, "p99_ms"), 100, "ms")
    cpu = r.groups("cpu")
    engine = worst(cpu, "engine_ms_per_task")
    note = f"ms (worst over concurrency; engine alone: {fmt(engine, 3)})" if engine is not None else "ms"
    row("worker CPU ≤ 0.3 ms per no-op task", worst(cpu, "cpu_ms_per_task"), 0.3, note, digits=3)
    beat = [g for g in r.groups("heartbeat") if g.get("in_flight") == 50]
    row(
        "heartbeat ≈ 1 write per interval at 50 in flight (≤ 1.5)",
        worst(beat, "writes_per_interval"),
        1.5,
        "",
    )
    return rows


def targets(r: Report) -> None:
    r.add(
        "## Targets",
        "",
        "Round trips per task count the **worker side: claim + heartbeats + finish** "
        "(`worker_writes_per_task`), the target's measure; all worker commands (discovery, "
        "registry, clock too: `roundtrips_per_task`) are shown next to it. "
        "Each measured value is the worst configuration's median. Claim batching is on by "
        "default (`taskrunner worker --batch 32`), so both round-trip targets are judged on the "
        "default settings, with 300 tasks published at once (the load); with `--batch 1` every "
        "claim takes one task, while outcomes and lease renewals are still group-committed.",
        "",
    )
    r.add(*table(["target", "measured (median)", "met?"], target_rows(r)))


# -- sections -----------------------------------------------------------------------------
def roundtrips(r: Report) -> None:
    r.add(
        "",
        "## Round trips per task",
        "",
        "In-process workers on the embedded server, 300 no-op tasks published in one write; "
        "commands counted by a PyMongo listener on each worker's client.",
    )
    gs = r.groups("roundtrips", key=lambda g: (bool(g.get("batching")), numeric(g.get("workers"))))
    baseline = r.groups("throughput", key=lambda g: numeric(g.get("workers")))
    baseline = [g for g in baseline if g.get("system") == "baseline"]
    if not gs and not baseline:
        r.not_run("roundtrips")
        return
    rows = [
        [
            fmt(g.get("workers"), 0),
            fmt(g.get("concurrency"), 0),
            "on" if g.get("batching") else "off",
            fmt(g.median("worker_writes_per_task"), 3),
            fmt(g.median("roundtrips_per_task"), 3),
            ", ".join(f"{k} {fmt(v, 3)}" for k, v in g.median_dict("per_task_by_job").items()),
            str(g.n),
        ]
        for g in gs
    ]
    r.add(
        "",
        *table(
            [
                "workers",
                "concurrency",
                "batching",
                "worker writes/task (claim+ping+finish)",
                "all commands/task",
                "by job",
                "n",
            ],
            rows,
        ),
    )

    def draw(ax: Any) -> None:
        for (batching, conc), lines in split(gs, lambda g: (bool(g.get("batching")), g.get("concurrency"))):
            label = f"batching {'on' if batching else 'off'}, c={conc}"
            line(ax, lines, "workers", "worker_writes_per_task", f"{label}: claim+ping+finish", "-o")
            line(ax, lines, "workers", "roundtrips_per_task", f"{label}: all commands", "--o")
        for (conc,), lines in split(baseline, lambda g: (g.get("concurrency"),)):
            line(ax, lines, "workers", "roundtrips_per_task", f"baseline c={conc}: all commands", ":s")
        ax.set(xlabel="workers", ylabel="round trips per task", ylim=(0, None))

    r.plot("roundtrips", "Round trips per task vs workers", draw)
    r.command(
        "uv run python bench/roundtrips.py --workers 1,2,4,8",
        "uv run python bench/roundtrips.py --workers 1,2,4,8 --no-batching",
    )


Lines = list[tuple[tuple[Any, ...], list[Group]]]


def split(groups: list[Group], key: Callable[[Group], tuple[Any, ...]]) -> Lines:
    """Groups split into plot lines, in a stable order."""
    lines: dict[tuple[Any, ...], list[Group]] = {}
    for g in groups:
        lines.setdefault(key(g), []).append(g)
    return sorted(lines.items(), key=lambda kv: [str(k) for k in kv[0]])


def line(ax: Any, groups: list[Group], x: str, y: str, label: str, style: str) -> None:
    points = sorted((numeric(g.get(x)), v) for g in groups if (v := g.median(y)) is not None)
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)


def claim_storm(r: Report) -> None:
    r.add(
        "",
        "## Claim attempts per claim",
        "",
        "N idle in-process workers on the embedded server; tasks published one at a time, "
        "so every worker sees each insert event while idle (the stampede case).",
    )
    if r.not_run("claim_storm"):
        return
    gs = r.groups("claim_storm", key=lambda g: numeric(g.get("workers")))
    rows = [
        [
            fmt(g.get("workers"), 0),
            fmt(g.median("attempts_per_claim"), 3),
            fmt(g.median("claims"), 0),
            fmt(g.median("pickup_p50_ms"), 1),
            fmt(g.median("pickup_max_ms"), 1),
            str(g.n),
        ]
        for g in gs
    ]
    header = ["workers", "attempts per claim", "claims", "pickup p50 ms", "pickup max ms", "n"]
    r.add("", *table(header, rows))

    def draw(ax: Any) -> None:
        line(ax, gs, "workers", "attempts_per_claim", "attempts per claim", "-o")
        ax.axhline(1.3, color="grey", linestyle=":", label="target 1.3 (16 workers)")
        ax.set(xlabel="workers", ylabel="claim attempts per claim", ylim=(0, None))

    r.plot("claim_storm", "Claim attempts per claim vs workers", draw)
    r.command("uv run python bench/claim_storm.py --workers 2,4,8,16")


def label(config: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(config.items()))


def pickup(r: Report) -> None:
    r.add(
        "",
        "## Pickup latency",
        "",
        "Publish to handler start with one idle `taskrunner worker` process; the CDF pools the "
        "latest runs' latencies, the table shows medians of their percentiles.",
    )
    if r.not_run("pickup"):
        return
    gs = r.groups("pickup", key=lambda g: label(g.config))
    rows = [
        [
            label(g.config),
            fmt(g.median("p50_ms"), 1),
            fmt(g.median("p90_ms"), 1),
            fmt(g.median("p99_ms"), 1),
            fmt(g.median("max_ms"), 1),
            fmt(g.median("to_claim_p50_ms"), 1),
            str(len(g.pooled("latencies_ms"))),
            str(g.n),
        ]
        for g in gs
    ]
    r.add(
        "",
        *table(
            ["config", "p50 ms", "p90 ms", "p99 ms", "max ms", "created→claimed p50 ms", "tasks", "n"], rows
        ),
    )

    def draw(ax: Any) -> None:
        for g in gs:
            values = sorted(g.pooled("latencies_ms"))
            if values:
                ax.step(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    where="post",
                    label=label(g.config),
                )
        ax.set(xscale="log", xlabel="pickup latency (ms, log scale)", ylabel="fraction of tasks")

    r.plot("pickup", "Pickup latency CDF", draw)
    r.command(
        "uv run python bench/pickup.py --mode stream",
        "uv run python bench/pickup.py --mode polling",
        "uv run python bench/baseline.py",
    )


def throughput(r: Report) -> None:
    r.add(
        "",
        "## Throughput",
        "",
        "No-op tasks per second through N `taskrunner worker` processes with C slots each "
        "(and the naive baseline worker), embedded server.",
    )
    if r.not_run("throughput"):
        return
    gs = r.groups(
        "throughput",
        key=lambda g: (str(g.get("system")), numeric(g.get("concurrency")), numeric(g.get("workers"))),
    )
    rows = [
        [
            str(g.get("system")),
            fmt(g.get("workers"), 0),
            fmt(g.get("concurrency"), 0),
            fmt(g.median("tasks_per_s"), 1),
            fmt(g.median("roundtrips_per_task"), 3),
            str(g.n),
        ]
        for g in gs
    ]
    r.add("", *table(["system", "workers", "concurrency", "tasks/s", "round trips/task", "n"], rows))

    def draw(ax: Any) -> None:
        for (system, conc), lines in split(gs, lambda g: (g.get("system"), g.get("concurrency"))):
            style = "-o" if system == "taskrunner" else "--s"
            line(ax, lines, "workers", "tasks_per_s", f"{system} c={conc}", style)
        ax.set(xlabel="workers", ylabel="tasks per second", ylim=(0, None))

    r.plot("throughput", "Throughput vs workers and concurrency", draw)
    r.command(
        "uv run python bench/throughput.py --workers 1,2,4 --concurrency 1,4,16",
        "uv run python bench/baseline.py",
    )


def round_ratio(mine: Group, other: Group, figure: str) -> float | None:
    """Median of mine/other over runs taken side by side (the i-th latest run of each: a
    round of bench/versus.py runs both systems one after the other)."""
    ratios = [
        a[figure] / b[figure]
        for a, b in zip(mine.runs, other.runs, strict=False)
        if isinstance(a.get(figure), int | float) and isinstance(b.get(figure), int | float) and b[figure]
    ]
    return statistics.median(ratios) if ratios else None


def versus_rows(gs: list[Group]) -> list[list[str]]:
    by = {(g.get("system"), g.get("workers"), g.get("publish"), bool(g.get("hog"))): g for g in gs}
    rows = []
    for (system, workers, publish, hog), g in sorted(
        by.items(), key=lambda kv: (str(kv[0][2]), kv[0][3], numeric(kv[0][1]))
    ):
        loop = by.get(("loop", workers, publish, hog))
        if system != "taskrunner" or loop is None:
            continue
        rows.append(
            [
                str(publish),
                "yes" if hog else "no",
                fmt(workers, 0),
                fmt(g.median("tasks_per_s"), 1),
                fmt(loop.median("tasks_per_s"), 1),
                fmt(round_ratio(g, loop, "tasks_per_s")),
                f"{fmt(g.median('pickup_p50_ms'), 0)} / {fmt(g.median('pickup_p95_ms'), 0)}",
                f"{fmt(loop.median('pickup_p50_ms'), 0)} / {fmt(loop.median('pickup_p95_ms'), 0)}",
                fmt(g.median("commands_per_task")),
                fmt(loop.median("commands_per_task")),
                fmt(g.median("claim_attempts_per_claim")),
                fmt(g.median("events_per_task_per_worker")),
                fmt(g.median("getmores_per_task_per_worker")),
                str(min(g.n, loop.n)),
            ]
        )
    return rows


def versus(r: Report) -> None:
    r.add(
        "",
        "## Side by side: taskrunner and the hand-rolled loop",
        "",
        "One embedded server; for each worker count, W `taskrunner worker --concurrency 1` processes "
        "and W processes of the hand-rolled `find_one_and_update` loop (bench/baseline_worker.py, "
        "100 ms idle sleep) take turns on fresh collections; 300 no-op tasks published one at a time "
        "(`one`) or in one call (`many`); `hog`: two spinning processes keep both cores busy. "
        "Ratio: the median over rounds of taskrunner/loop within the same round. Commands per task "
        "count everything the worker processes sent (getMores, registry, sweeps, idle polling).",
    )
    if r.not_run("versus"):
        return
    gs = r.groups("versus")
    r.add(
        "",
        *table(
            [
                "publish",
                "hog",
                "workers",
                "taskrunner tasks/s",
                "loop tasks/s",
                "ratio",
                "taskrunner pickup p50/p95 ms",
                "loop pickup p50/p95 ms",
                "taskrunner cmds/task",
                "loop cmds/task",
                "claims/task",
                "events/task/worker",
                "getMores/task/worker",
                "n",
            ],
            versus_rows(gs),
        ),
    )

    def draw(ax: Any) -> None:
        for (system, publish, hog), lines in split(
            gs, lambda g: (g.get("system"), g.get("publish"), bool(g.get("hog")))
        ):
            style = ("-" if system == "taskrunner" else "--") + ("s" if hog else "o")
            line(ax, lines, "workers", "tasks_per_s", f"{system}, {publish}{', hog' if hog else ''}", style)
        ax.set(xlabel="worker processes", ylabel="tasks per second", ylim=(0, None))

    r.plot("versus", "taskrunner and the hand-rolled loop vs worker processes", draw)
    r.command(
        "uv run python bench/versus.py --workers 4,8,16 --publish one",
        "uv run python bench/versus.py --workers 4,8,16 --publish many",
        "uv run python bench/versus.py --workers 4,8,16 --publish one --hog",
    )


def idle(r: Report) -> None:
    r.add(
        "",
        "## Idle cost",
        "",
        "W idle `taskrunner worker` processes after a few tasks: server commands per second per "
        "worker (the difference between a short and a long idle run, so start-up cancels out), by "
        "job; claims attempted while idle (from the workers' debug logs).",
    )
    if r.not_run("idle"):
        return
    gs = r.groups("idle", key=lambda g: (str(g.get("mode")), numeric(g.get("workers"))))
    rows = [
        [
            str(g.get("mode")),
            fmt(g.get("workers"), 0),
            fmt(g.median("commands_per_s_per_worker")),
            ", ".join(f"{k} {fmt(v)}" for k, v in g.median_dict("by_job").items()),
            fmt(g.median("idle_claims"), 0),
            str(g.n),
        ]
        for g in gs
    ]
    r.add(
        "",
        *table(["discovery", "workers", "commands/s per worker", "by job", "claims while idle", "n"], rows),
    )
    r.command("uv run python bench/idle.py --workers 4 --modes stream,poll")


def takeover(r: Report) -> None:
    r.add(
        "",
        "## Takeover time",
        "",
        "Seconds from signalling the worker that runs a task until another worker has claimed it.",
    )
    if r.not_run("takeover"):
        return
    gs = r.groups("takeover", key=lambda g: label(g.config))
    rows = [
        [
            label(g.config),
            fmt(g.median("median_s")),
            fmt(g.median("max_s")),
            str(len(g.pooled("samples"))),
            str(g.n),
        ]
        for g in gs
    ]
    r.add("", *table(["config", "median s", "max s", "samples", "n"], rows))

    def draw(ax: Any) -> None:
        data = [(label(g.config), g.pooled("samples")) for g in gs]
        data = [d for d in data if d[1]]
        if data:
            ax.boxplot([d[1] for d in data], tick_labels=[d[0] for d in data])
        ax.set(ylabel="seconds until taken over", ylim=(0, None))

    r.plot("takeover", "Takeover time after SIGKILL and SIGTERM", draw)
    r.command("uv run python bench/takeover.py")


def cpu(r: Report) -> None:
    r.add(
        "",
        "## Worker CPU per task",
        "",
        "One in-process worker and the in-memory store, N no-op tasks published before the "
        "timer starts; process CPU time per task. The store share stands in for the server "
        "(the in-memory store copies every document it hands out).",
    )
    if r.not_run("cpu"):
        return
    gs = r.groups("cpu", key=lambda g: numeric(g.get("concurrency")))
    rows = [
        [
            fmt(g.get("concurrency"), 0),
            fmt(g.median("tasks"), 0),
            fmt(g.median("cpu_ms_per_task"), 3),
            fmt(g.median("engine_ms_per_task"), 3),
            fmt(g.median("store_ms_per_task"), 3),
            fmt(g.median("tasks_per_s"), 0),
            str(g.n),
        ]
        for g in gs
    ]
    r.add(
        "",
        *table(
            ["concurrency", "tasks", "CPU ms/task", "engine ms/task", "store ms/task", "tasks/s", "n"], rows
        ),
    )
    r.command("uv run python bench/cpu.py --concurrency 10,50 --tasks 3000")


def heartbeat(r: Report) -> None:
    r.add(
        "",
        "## Heartbeat writes",
        "",
        "One in-process worker with K long tasks running (ping interval 0.5 s); writes on the "
        "tasks collection (`update` + `findAndModify`) counted over 4 s, per ping interval.",
    )
    if r.not_run("heartbeat"):
        return
    gs = r.groups("heartbeat", key=lambda g: numeric(g.get("in_flight")))
    rows = [
        [
            fmt(g.get("in_flight"), 0),
            fmt(g.median("writes_per_interval")),
            fmt(g.median("statements_per_interval")),
            str(g.n),
        ]
        for g in gs
    ]
    r.add("", *table(["in flight", "writes per interval", "documents per interval", "n"], rows))

    def draw(ax: Any) -> None:
        line(ax, gs, "in_flight", "writes_per_interval", "write commands", "-o")
        line(ax, gs, "in_flight", "statements_per_interval", "documents addressed", "--o")
        ax.set(xlabel="runs in flight", ylabel="per ping interval", ylim=(0, None))

    r.plot("heartbeat", "Heartbeat writes per interval vs runs in flight", draw)
    r.command("uv run python bench/heartbeat.py --in-flight 1,10,50")


DASHBOARD_PAGES = (
    "overview",
    "overview_fragment",
    "tasks",
    "tasks_filtered",
    "tasks_by_updated",
    "tasks_page2",
    "task",
    "workers",
    "schedules",
)


def dashboard(r: Report) -> None:
    r.add(
        "",
        "## Dashboard render time",
        "",
        "`taskrunner dashboard` over the embedded server holding N tasks: each page's whole HTTP "
        "response, first (a page or filter nobody opened yet is read before it renders) and over "
        "the repeats after it (pages render the latest read and re-read in the background; a page "
        "whose first read takes over 200 ms answers with a placeholder, counted); then "
        "renders and server commands per second while chromium tabs watch tasks being published.",
    )
    if r.not_run("dashboard"):
        return
    for g in r.groups("dashboard", key=lambda g: (numeric(g.get("tasks")), bool(g.get("hog")))):
        rows = [
            [
                page,
                *(fmt(g.median(f"{page}_{kind}_ms"), 0) for kind in ("first", "p50", "p95")),
                fmt(g.median(f"{page}_pending"), 0),
            ]
            for page in DASHBOARD_PAGES
            if g.median(f"{page}_p50_ms") is not None
        ]
        hog = ", both cores kept busy by a CPU hog" if g.get("hog") else ""
        r.add("", f"{fmt(g.get('tasks'), 0)} tasks{hog}, n = {g.n}:", "")
        r.add(*table(["page", "first ms", "p50 ms", "p95 ms", "placeholders"], rows))
        live = [
            ("renders while publishing, p50 / p95 ms", "live_render_p50_ms", "live_render_p95_ms"),
            ("dashboard commands per second with tabs open", "live_commands_per_s", None),
            ("change streams opened", "change_streams_opened", None),
        ]
        r.add("")
        for text, first, second in live:
            value = fmt(g.median(first), 1) + (f" / {fmt(g.median(second), 1)}" if second else "")
            r.add(f"- {text}: {value}")
    r.command("uv run python bench/dashboard.py --tasks 10000")


def machines(r: Report) -> None:
    runs = [run for gs in r.benches.values() for g in gs for run in g.runs]
    r.add("", "## Machine and dates", "")
    if not runs:
        r.add("No results yet.")
        return
    whens = sorted(str(run.get("when")) for run in runs)
    r.add(f"Runs from {whens[0]} to {whens[-1]} (local time of the machine).", "")
    seen = sorted({json.dumps(run.get("machine"), sort_keys=True) for run in runs})
    for raw in seen:
        m = json.loads(raw)
        if isinstance(m, dict):
            r.add(
                f"- {m.get('cpu')}, {m.get('cores')} cores, {m.get('memory_gib')} GiB, {m.get('os')}; "
                f"Python {m.get('python')}, pymongo {m.get('pymongo')}, mongoeco {m.get('mongoeco')}, "
                f"taskrunner {m.get('taskrunner')}"
            )
        else:
            r.add(f"- {m}")


def render(results: Path, out: Path, *, smoke: bool = False) -> Report:
    r = Report(out, group(load(results, smoke=smoke)))
    r.add(
        "# Benchmarks",
        "",
        f"Generated by `uv run python bench/report.py` from `{results.name}`: per benchmark and "
        f"configuration, the median of the latest {LATEST} runs (n = runs used). Run every benchmark "
        "with `uv run python bench/suite.py` (3 runs each, then this report). The result lines "
        "used are kept in [benchmarks/results.jsonl](benchmarks/results.jsonl).",
        "",
    )
    targets(r)
    notes = HERE / "notes.md"  # hand-written reading of the numbers, kept next to the scripts
    if notes.exists():
        r.add("", notes.read_text().strip())
    for section in (
        versus,
        idle,
        roundtrips,
        claim_storm,
        pickup,
        throughput,
        takeover,
        cpu,
        heartbeat,
        dashboard,
        machines,
    ):
        section(r)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(r.lines) + "\n")
    r.plots.mkdir(parents=True, exist_ok=True)
    used = [run for gs in r.benches.values() for g in gs for run in g.runs]
    (r.plots / "results.jsonl").write_text("".join(json.dumps(run) + "\n" for run in used))
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results.jsonl")
    parser.add_argument("--out", type=Path, default=HERE.parent / "docs" / "benchmarks.md")
    parser.add_argument(
        "--include-smoke",
        action="store_true",
        help="use smoke lines too (bench/suite.py --smoke checks the rendering with them)",
    )
    args = parser.parse_args()
    render(args.results, args.out, smoke=args.include_smoke)
    print(f"wrote {args.out} and its plots in {args.out.parent / 'benchmarks'}", file=sys.stderr)


if __name__ == "__main__":
    main()
