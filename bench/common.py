"""What every benchmark script shares: the results file, machine info, percentiles, output.

Each script prints exactly one JSON line per result (the last line of stdout) and
appends it to the results file (default ``bench/results.jsonl``). Every line has:

    bench    the script's name, e.g. "pickup"
    config   the knobs that make runs comparable, e.g. {"mode": "stream", "workers": 1}
    ...      the script's figures (flat keys, numbers in ms/s/per-task as named)
    smoke    true for the tiny CI runs (bench/report.py ignores them)
    machine  machine_info(): cpu, cores, memory, os, python, pymongo, mongoeco
    when     local ISO time of the run

``bench/report.py`` groups lines by (bench, config) and reports the median of the
latest three runs of each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("results.jsonl")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """The machine and software a figure was measured on."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "pymongo": _version("pymongo"),
        "mongoeco": _version("mongoeco"),
        "taskrunner": _version("taskrunner"),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; values need not be sorted."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    cut = statistics.quantiles(ordered, n=1000, method="inclusive")
    index = round(q * 10) - 1
    return ordered[0] if index < 0 else ordered[-1] if index >= len(cut) else cut[index]


def int_list(text: str) -> list[int]:
    """An argparse type: ``"2,4,8"`` -> ``[2, 4, 8]`` (positive numbers, one result each)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive numbers, got {text!r}")
    return values


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--results PATH`` and ``--smoke`` (tiny run for CI) on every script."""
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON lines file to append to")
    parser.add_argument("--smoke", action="store_true", help="tiny run that only checks the script works")


def emit(bench: str, config: dict[str, Any], figures: dict[str, Any], *, results: Path, smoke: bool) -> None:
    """Print the result as one JSON line and append it to ``results``."""
    record = {"bench": bench, "config": config, **figures, "smoke": smoke}
    line = json.dumps(record | {"machine": machine_info(), "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
    print(line, flush=True)
    with results.open("a") as out:
        out.write(line + "\n")
