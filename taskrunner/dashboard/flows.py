"""Workflows on the dashboard: a task page's links (what it runs after, what runs after it,
its flow), and the flow page's data: the flow read through ``runner.get_flow`` and its graph
laid out for SVG.

The graph is drawn by level (``taskrunner.workflows.levels``): one column per level, left to
right, each step a box coloured by its state and linked to its task page, an arrow from each
step to each step of the flow that runs after it. What is drawn is capped, so a flow of
10,000 steps renders as fast as one of 100 and the browser lays out a few hundred shapes:
at most ``PER_LEVEL`` boxes per level (the rest of the level is one box counting them by
state, and the arrows to and from them meet there) and ``MAX_LEVELS`` levels; the table
lists the first ``MAX_ROWS`` steps. The page says what it left out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from taskrunner.errors import FlowNotFound
from taskrunner.models import StoredTask, Task, TaskState
from taskrunner.runner import TaskRunner
from taskrunner.workflows.levels import levels

PER_LEVEL = 12
"""Steps drawn one by one per level; the rest of a level is drawn as one box."""
MAX_LEVELS = 30
"""Levels drawn; deeper ones are left out (and the page says how many)."""
MAX_ROWS = 300
"""Steps (and compensations) listed in the page's tables."""
LINKED = 20
"""Upstream and dependent tasks a task page links, the first of each."""
DEPENDENTS_COUNTED = 1000
"""Dependents a task page reads to say how many there are (it links the first ``LINKED``)."""
UPSTREAM_READ = 1000
"""A task page reads the tasks a task runs after whole (``runner.upstream``) up to this many;
a wider fan-in reads the states of all and the first ``LINKED`` whole, since its page is read
again each time one of them ends."""
LABEL_CHARS = 22
"""A box shows the end of its step's key, at most this many characters (the tooltip has it all)."""
COLUMN, ROW = 200.0, 46.0
BOX_WIDTH, BOX_HEIGHT = 168.0, 36.0
MARGIN = 10.0
BEND = 16.0  # how far an arrow runs straight out of its box before it curves
LANE = ROW / 2  # room above the boxes for the arrows that pass a level


@dataclass(frozen=True)
class Box:
    """One box of the graph: a step, or the rest of a level (``key`` None, ``count`` steps)."""

    x: float
    y: float
    label: str
    detail: str
    """The box's second line: the step's state, or the rest's counts by state."""
    title: str
    state: str
    """The step's state; ``MIXED`` for the rest of a level."""
    key: str | None = None
    count: int = 1


@dataclass(frozen=True)
class Arrow:
    """A curve from the right edge of one box to the left edge of a box of a later level."""

    path: str


@dataclass
class Drawing:
    """The graph laid out: boxes, arrows, the canvas's size and what was left out."""

    boxes: list[Box] = field(default_factory=list)
    arrows: list[Arrow] = field(default_factory=list)
    width: float = 0.0
    height: float = 0.0
    levels: int = 0
    levels_drawn: int = 0
    steps: int = 0
    steps_drawn: int = 0
    """Steps drawn as a box of their own."""
    box_width: float = BOX_WIDTH
    box_height: float = BOX_HEIGHT

    @property
    def capped(self) -> bool:
        """Some step has no box of its own (a level's rest, or a level not drawn)."""
        return self.steps_drawn < self.steps


@dataclass(frozen=True)
class Links:
    """A task's place in a workflow, as its page links it."""

    upstream: list[tuple[str, Task | None]]
    """The first ``LINKED`` keys of ``after``, each with its task (None: not stored any more)."""
    upstream_counts: dict[str, int]
    """How many of all its upstreams (those still stored) are in each state."""
    dependents: list[Task]
    """The first ``LINKED`` tasks that run after it, oldest first."""
    dependents_total: int
    """How many tasks run after it, counted up to ``DEPENDENTS_COUNTED``."""

    @property
    def keys(self) -> list[str]:
        """The tasks the page shows the state of: a change to one refreshes it."""
        return [key for key, _ in self.upstream] + [task.key for task in self.dependents]

    @property
    def dependents_counted(self) -> bool:
        """The count of dependents is exact (below ``DEPENDENTS_COUNTED``)."""
        return self.dependents_total < DEPENDENTS_COUNTED


async def task_links(runner: TaskRunner, task: Task) -> Links:
    """What ``task`` runs after (``runner.upstream``) and what runs after it (``runner.dependents``)."""
    listed = task.after[:LINKED]
    if len(task.after) <= UPSTREAM_READ:
        upstream = await runner.upstream(task.key) if task.after else {}
        counts = _by_state(upstream.values())
    else:
        upstream = {found.key: found for found in await runner.store.get_many(listed)}
        states = Counter((await runner.store.states(task.after)).values())
        counts = {state.value: states[state.value] for state in TaskState if states[state.value]}
    dependents = await runner.dependents(task.key, limit=DEPENDENTS_COUNTED) if task.dependents else []
    return Links(
        upstream=[(key, upstream.get(key)) for key in listed],
        upstream_counts=counts,
        dependents=dependents[:LINKED],
        dependents_total=len(dependents),
    )


def _by_state(tasks: Iterable[StoredTask]) -> dict[str, int]:
    """How many of ``tasks`` are in each state, in ``TaskState``'s order (states with none left out)."""
    counts = Counter(task.state for task in tasks)
    return {state.value: counts[state] for state in TaskState if counts[state]}


async def flow_page(runner: TaskRunner, flow_id: str) -> dict[str, Any]:
    """The flow page's snapshot: the flow and its graph, or ``view`` None when no task has that flow id."""
    try:
        view = await runner.get_flow(flow_id)
    except FlowNotFound:
        return {"flow_id": flow_id, "view": None}
    by_level = levels(view.steps)
    level_of = {step.key: n for n, level in enumerate(by_level, 1) for step in level}
    return {
        "flow_id": flow_id,
        "view": view,
        "drawing": draw(by_level, flow_id),
        "level_of": level_of,
        "counts": _by_state(view.steps),
        "rows": view.steps[:MAX_ROWS],
        "compensations": view.compensations[:MAX_ROWS],
        "max_rows": MAX_ROWS,
        "per_level": PER_LEVEL,
    }


def draw(by_level: Sequence[Sequence[StoredTask]], flow_id: str) -> Drawing:
    """Boxes and arrows for the first ``MAX_LEVELS`` levels, ``PER_LEVEL`` boxes each at most."""
    drawn = by_level[:MAX_LEVELS]
    rows = max((min(len(level), PER_LEVEL + 1) for level in drawn), default=0)
    cells: list[tuple[int, float, Sequence[StoredTask]]] = []  # column, row, the steps of one box
    box_of: dict[str, int] = {}  # step key -> index of the box it is drawn in
    for column, level in enumerate(drawn):
        shown = level if len(level) <= PER_LEVEL + 1 else level[:PER_LEVEL]
        groups = [[step] for step in shown] + ([level[len(shown) :]] if len(shown) < len(level) else [])
        top = (rows - len(groups)) / 2  # centred in its column
        for row, group in enumerate(groups):
            for step in group:
                box_of[step.key] = len(cells)
            cells.append((column, top + row, group))
    pairs = _pairs(box_of, drawn)
    skips = {(source, target) for source, target in pairs if cells[target][0] - cells[source][0] > 1}
    lane = LANE if skips else 0.0  # arrows past a level run above every box
    boxes = [
        _box(group, MARGIN + column * COLUMN, MARGIN + lane + row * ROW, flow_id)
        for column, row, group in cells
    ]
    return Drawing(
        boxes=boxes,
        arrows=[_arrow(boxes[s], boxes[t], MARGIN + lane / 2 if (s, t) in skips else None) for s, t in pairs],
        width=2 * MARGIN + max(len(drawn) - 1, 0) * COLUMN + BOX_WIDTH,
        height=2 * MARGIN + lane + max(rows - 1, 0) * ROW + BOX_HEIGHT,
        levels=len(by_level),
        levels_drawn=len(drawn),
        steps=sum(map(len, by_level)),
        steps_drawn=sum(1 for box in boxes if box.key is not None),
    )


def _box(steps: Sequence[StoredTask], x: float, y: float, flow_id: str) -> Box:
    """One step's box, or the box of the rest of a level, counting its steps by state."""
    if len(steps) == 1:  # the rest of a level is two steps or more (else that step is drawn)
        step = steps[0]
        short = step.key.removeprefix(f"{flow_id}/") or step.key
        title = f"{step.key} ({step.name}): {step.state.value}"
        return Box(x, y, _cut(short), step.state.value, title, step.state.value, key=step.key)
    by_state = ", ".join(f"{n} {state}" for state, n in _by_state(steps).items())
    title = f"{len(steps)} more steps of this level: {by_state}"
    return Box(x, y, f"+{len(steps)} more", _cut(by_state, end=False), title, "MIXED", count=len(steps))


def _cut(text: str, *, end: bool = True) -> str:
    """``text`` in ``LABEL_CHARS`` characters at most: its end (a key's end tells steps apart) or its start."""
    if len(text) <= LABEL_CHARS:
        return text
    return "…" + text[-(LABEL_CHARS - 1) :] if end else text[: LABEL_CHARS - 1] + "…"


def _pairs(box_of: dict[str, int], drawn: Sequence[Sequence[StoredTask]]) -> list[tuple[int, int]]:
    """Each pair of boxes (once) such that some step of the second runs after some step of the first."""
    pairs: dict[tuple[int, int], None] = {}
    for level in drawn:
        for step in level:
            target = box_of[step.key]
            for key in step.after:
                source = box_of.get(key)
                if source is not None and source != target:
                    pairs[source, target] = None
    return list(pairs)


def _arrow(source: Box, target: Box, lane: float | None) -> Arrow:
    """A curve from ``source``'s right edge to ``target``'s left edge; one that passes a level
    climbs into the ``lane`` above the boxes in the gap after its source, and comes down in the
    gap before its target."""
    x1, y1 = source.x + BOX_WIDTH, source.y + BOX_HEIGHT / 2
    x2, y2 = target.x, target.y + BOX_HEIGHT / 2
    if lane is not None:
        gap = (COLUMN - BOX_WIDTH) / 2
        return Arrow(
            f"M{x1:g},{y1:g} C{x1 + gap:g},{y1:g} {x1 + gap:g},{lane:g} {x1 + 2 * gap:g},{lane:g} "
            f"L{x2 - 2 * gap:g},{lane:g} C{x2 - gap:g},{lane:g} {x2 - gap:g},{y2:g} {x2:g},{y2:g}"
        )
    middle = (x1 + x2) / 2
    return Arrow(
        f"M{x1:g},{y1:g} C{max(middle, x1 + BEND):g},{y1:g} {min(middle, x2 - BEND):g},{y2:g} {x2:g},{y2:g}"
    )
