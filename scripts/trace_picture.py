"""The picture of a trace in docs/observability.md: docs/observability/trace.png.

Rerun it any time the spans change::

    uv run python scripts/trace_picture.py [--out docs/observability/trace.png]

It starts the embedded server and a ``taskrunner worker`` running this module's ``runner``
with ``OTEL_TRACES_EXPORTER=console``; a publisher (this process, with the SDK and its
console exporter too) handles a pretend web request that publishes a ``resize`` task; the
worker runs it, and its handler opens spans of its own. Both processes' spans, as the
console exporter prints them, become one timeline (matplotlib): one bar per span, nested
under its parent, coloured by service. No trace viewer is needed (none is installable here).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from taskrunner import TaskContext, TaskRunner
from taskrunner.dev.processes import ProcessGroup, dev_server, worker_env
from taskrunner.testing import wait_for

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "docs" / "observability" / "trace.png"
COLLECTION = "traced"

runner = TaskRunner()


@runner.task()
async def resize(params: dict[str, Any], ctx: TaskContext) -> dict[str, int]:
    """Pretend work with spans of its own, as a handler's instrumented calls would make."""
    from opentelemetry import trace

    tracer = trace.get_tracer("images")
    with tracer.start_as_current_span("download image"):
        await asyncio.sleep(0.03)
    with tracer.start_as_current_span("resize image"):
        await asyncio.sleep(0.05)
    with tracer.start_as_current_span("upload thumbnail"):
        await asyncio.sleep(0.02)
    return {"width": params.get("width", 320)}


def spans_in(text: str) -> list[dict[str, Any]]:
    """The console exporter's spans (indented JSON objects, from a line ``{`` to a line ``}``)."""
    spans, block = [], None
    for line in text.splitlines():
        if line == "{":
            block = [line]
        elif block is not None:
            block.append(line)
            if line == "}":
                spans.append(json.loads("\n".join(block)))
                block = None
    return spans


async def publish(uri: str) -> str:
    """The web request: a span around publishing; returns the console exporter's output."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    printed = io.StringIO()
    provider = TracerProvider(resource=Resource.create({"service.name": "web"}))
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=printed)))
    trace.set_tracer_provider(provider)
    async with TaskRunner(uri, collection=COLLECTION) as publisher:
        await publisher.workers()  # connected before the request, as a web app's client is
        with trace.get_tracer("web").start_as_current_span("POST /images/42/thumbnail"):
            await asyncio.sleep(0.01)  # the request's own work before it publishes
            task = await publisher.publish("resize", {"width": 320}, key="img-42", allow_unknown=True)
            await asyncio.sleep(0.005)
        await task.wait(timeout=60)
    provider.shutdown()
    return printed.getvalue()


async def capture() -> list[dict[str, Any]]:
    with dev_server() as (_, uri), tempfile.TemporaryDirectory() as logs:
        env = worker_env(
            uri, collection=COLLECTION, python_path=[HERE], extra={"OTEL_TRACES_EXPORTER": "console"}
        )
        with ProcessGroup(Path(logs), env) as group:
            worker = group.worker("worker-1", "trace_picture:runner")
            await wait_for(lambda: worker.find("worker started"), 60, "the worker to start")
            published = await publish(uri)
            worker.terminate()  # the worker exports its spans as it stops
            if await worker.exited(60) != 0:
                raise RuntimeError(f"the worker failed:\n{worker.tail(40)}")
            return spans_in(published) + spans_in(worker.log_path.read_text())


def render(spans: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    by_id = {s["context"]["span_id"]: s for s in spans}

    def depth(span: dict[str, Any]) -> int:
        parent = by_id.get(span.get("parent_id") or "")
        return 0 if parent is None else 1 + depth(parent)

    def ordered(parent: str | None) -> list[dict[str, Any]]:
        children = sorted((s for s in spans if s.get("parent_id") == parent), key=lambda s: s["start_time"])
        return [x for child in children for x in [child, *ordered(child["context"]["span_id"])]]

    rows = ordered(None)
    t0 = min(_ns(s["start_time"]) for s in rows)
    colours = {"web": "#4C72B0", "taskrunner-worker": "#DD8452"}
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.2))
    for i, span in enumerate(rows):
        start, end = (_ns(span["start_time"]) - t0) / 1e6, (_ns(span["end_time"]) - t0) / 1e6
        service = span["resource"]["attributes"]["service.name"]
        ax.barh(i, max(end - start, 0.3), left=start, color=colours.get(service, "#55A868"), height=0.6)
        kind = span["kind"].removeprefix("SpanKind.")
        label = "  " * depth(span) + span["name"] + ("" if kind == "INTERNAL" else f"  ({kind})")
        ax.text(-1, i, label, ha="right", va="center", fontsize=9, family="monospace")
        ax.text(end + 1, i, f"{end - start:.1f} ms", va="center", fontsize=8, color="#555555")
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms since the request started  (trace {rows[0]['context']['trace_id'][2:]})")
    ax.spines[["left", "right", "top"]].set_visible(False)
    handles = [Patch(color=c, label=name) for name, c in colours.items()]
    ax.legend(handles=handles, loc="upper right", fontsize=8, title="service.name", title_fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def _ns(stamp: str) -> int:
    """A console exporter time (ISO 8601, microseconds) as ns since the epoch."""
    from datetime import datetime

    return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with redirect_stdout(sys.stderr):  # the dev server and processes print nothing we need
        spans = asyncio.run(capture())
    traces = {s["context"]["trace_id"] for s in spans}
    if len(traces) != 1:
        raise SystemExit(f"expected one trace, got {len(traces)}: {[s['name'] for s in spans]}")
    render(spans, args.out)
    print(f"{len(spans)} spans of one trace -> {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
