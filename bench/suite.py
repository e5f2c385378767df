"""Run every benchmark script, then bench/report.py: the whole suite in one command.

Each script runs as a subprocess, one after another (they share two cores badly):
roundtrips (workers 1,2,4,8, with and without batching), claim_storm (workers
2,4,8,16), pickup (stream, polling), baseline, throughput, takeover, cpu and
heartbeat, versus (taskrunner and the hand-rolled loop side by side), idle and dashboard,
``--runs`` times each (default 3: the report takes the median of the
latest 3), appending to ``--results``; then the report renders docs/benchmarks.md.
A script that is missing or fails is reported and the rest still run; the exit
status is 1 if any failed.

``--smoke`` runs each script once with ``--smoke`` into a temporary results file
and renders the report from those smoke lines into that temporary directory, so it
never touches bench/results.jsonl or docs/. In smoke mode roundtrips gets no list flags (its
``--smoke`` fixes the shape).

    uv run python bench/suite.py [--runs 3] [--only cpu,heartbeat] [--smoke] [--results PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, add_common_args

HERE = Path(__file__).resolve().parent

# name -> (script, argument lists of its full runs); each list is one invocation.
BENCHES: dict[str, tuple[str, list[list[str]]]] = {
    "roundtrips": ("roundtrips.py", [["--workers", "1,2,4,8"], ["--workers", "1,2,4,8", "--no-batching"]]),
    "claim_storm": ("claim_storm.py", [["--workers", "2,4,8,16"]]),
    "pickup": ("pickup.py", [["--mode", "stream"], ["--mode", "polling"]]),
    "baseline": ("baseline.py", [[]]),
    "throughput": ("throughput.py", [[]]),
    "takeover": ("takeover.py", [[]]),
    "cpu": ("cpu.py", [["--concurrency", "10,50"]]),
    "heartbeat": ("heartbeat.py", [["--in-flight", "1,10,50"]]),
    "versus": (
        "versus.py",
        [
            ["--workers", "4,8,16", "--rounds", "1", "--publish", "one"],
            ["--workers", "4,8,16", "--rounds", "1", "--publish", "many"],
            ["--workers", "4,8,16", "--rounds", "1", "--publish", "one", "--hog"],
        ],
    ),
    "idle": ("idle.py", [["--workers", "4"]]),
    "dashboard": ("dashboard.py", [["--tasks", "10000"], ["--tasks", "10000", "--hog"]]),
}
SMOKE_ARGS = {"pickup": [["--mode", "stream"]]}  # one smoke invocation is enough elsewhere


def invocations(name: str, smoke: bool) -> list[list[str]]:
    if not smoke:
        return BENCHES[name][1]
    return [[*args, "--smoke"] for args in SMOKE_ARGS.get(name, [[]])]


def run(script: Path, args: list[str], results: Path) -> bool:
    command = [sys.executable, str(script), *args, "--results", str(results)]
    print(f"[suite] {script.name} {' '.join(args)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    # The script's JSON lines go to our stderr too: stdout stays free for nothing but progress.
    done = subprocess.run(command, stdout=sys.stderr, check=False)
    took = time.monotonic() - start
    status = "ok" if done.returncode == 0 else f"FAILED (exit {done.returncode})"
    print(f"[suite] {script.name}: {status} in {took:.1f} s", file=sys.stderr, flush=True)
    return done.returncode == 0


def names(text: str) -> list[str]:
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(BENCHES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown bench {unknown}; known: {', '.join(BENCHES)}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each script (full mode)")
    parser.add_argument("--only", type=names, default=list(BENCHES), help="comma list, e.g. cpu,heartbeat")
    parser.add_argument("--out", type=Path, default=HERE.parent / "docs" / "benchmarks.md", help="report")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        tmp = Path(tempfile.mkdtemp(prefix="taskrunner-bench-"))
        args.results, args.out, args.runs = tmp / "results.jsonl", tmp / "benchmarks.md", 1
        print(f"[suite] smoke: results and report in {tmp}", file=sys.stderr)
    elif args.results == RESULTS:
        print(f"[suite] appending to {args.results}", file=sys.stderr)
    failed: list[str] = []
    for run_no in range(1, args.runs + 1):
        for name in args.only:
            script = HERE / BENCHES[name][0]
            if not script.exists():
                print(f"[suite] {script.name} missing: skipped", file=sys.stderr)
                failed.append(f"{name} (missing)")
                continue
            print(f"[suite] run {run_no}/{args.runs}: {name}", file=sys.stderr)
            for extra in invocations(name, args.smoke):
                if not run(script, extra, args.results):
                    failed.append(f"{name} {' '.join(extra)}".strip())
    report = [sys.executable, str(HERE / "report.py"), "--results", str(args.results), "--out", str(args.out)]
    if args.smoke:
        report.append("--include-smoke")  # smoke lines are all there is: render them to check the report
    if subprocess.run(report, check=False).returncode != 0:
        failed.append("report")
    if failed:
        print(f"[suite] failed: {', '.join(sorted(set(failed)))}", file=sys.stderr)
        sys.exit(1)
    print(f"[suite] done: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
