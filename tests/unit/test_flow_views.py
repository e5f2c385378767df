"""How flows are drawn: their steps by level, and the text graph ``taskrunner flow`` prints."""

from __future__ import annotations

from rich.console import Console
from support import stored_task

from taskrunner.cli import render
from taskrunner.models import Task, TaskState
from taskrunner.workflows.levels import levels
from taskrunner.workflows.model import FlowView


def step(key: str, *after: str, state: TaskState = TaskState.WAITING, name: str = "step") -> Task:
    """A stored step of flow ``f`` running after ``after`` (as ``get_flow`` reads it)."""
    waiting = list(after) if state is TaskState.WAITING else []
    return stored_task(key, state.value, name=name, after=list(after), waiting_on=waiting, flow="f")


def fan(width: int) -> list[Task]:
    """``f/a`` -> ``f/b1`` ... ``f/b<width>`` -> ``f/c``."""
    middle = [step(f"f/b{i}", "f/a", name="transform") for i in range(1, width + 1)]
    return [
        step("f/a", state=TaskState.PENDING, name="extract"),
        *middle,
        step("f/c", *(t.key for t in middle)),
    ]


def keys(found: list[list[Task]]) -> list[list[str]]:
    return [[t.key for t in level] for level in found]


def test_a_fan_out_and_in_is_three_levels() -> None:
    """1 -> 10 -> 1 is three levels of 1, 10 and 1 steps, each level in publish order."""
    found = levels(fan(10))
    assert [len(level) for level in found] == [1, 10, 1]
    assert keys(found)[1] == [f"f/b{i}" for i in range(1, 11)]


def test_a_step_comes_one_level_after_its_deepest_upstream() -> None:
    """A step after both a root and that root's dependent sits below the dependent (the longest
    path); an upstream outside the flow places nothing."""
    steps = [
        step("f/a"),
        step("f/b", "f/a"),
        step("f/c", "f/a", "f/b", "elsewhere"),
        step("f/d", "elsewhere"),
    ]
    assert keys(levels(steps)) == [["f/a", "f/d"], ["f/b"], ["f/c"]]


def test_steps_on_a_cycle_are_kept_in_a_last_level() -> None:
    """Documents written by hand into a cycle lose no step: its steps come last, after the rest."""
    steps = [step("f/a"), step("f/x", "f/y"), step("f/y", "f/x"), step("f/b", "f/a")]
    assert keys(levels(steps)) == [["f/a"], ["f/b"], ["f/x", "f/y"]]


def test_the_text_graph_reads_1_10_1_down_the_left() -> None:
    """``taskrunner flow`` draws a 1 -> 10 -> 1 flow as three level lines joined by arrows: the
    small levels by key and state, the wide one counted by name and state."""
    lines = render.graph_lines(levels(fan(10)))
    assert lines == [
        "1 step    f/a PENDING",
        "  ↓",
        "10 steps  transform (10): 10 WAITING",
        "  ↓",
        "1 step    f/c WAITING",
    ]


def test_the_text_graph_of_a_long_chain_stops_and_says_how_much_is_left() -> None:
    """A chain deeper than ``GRAPH_LEVELS`` prints that many levels, then one line counting the rest."""
    chain = [step("f/0", state=TaskState.PENDING)] + [step(f"f/{i}", f"f/{i - 1}") for i in range(1, 120)]
    lines = render.graph_lines(levels(chain))
    assert lines.count("  ↓") == render.GRAPH_LEVELS
    assert (
        lines[-1]
        == f"... {120 - render.GRAPH_LEVELS} more levels of {120 - render.GRAPH_LEVELS} steps (--json has every step)"
    )


def test_flow_output_lists_steps_with_levels_and_what_they_wait_on() -> None:
    """The flow's state and counts head the output; each step's row has its level, what it runs
    after (three keys, then how many more) and what it waits on; ``limit`` cuts the rows and says so."""
    view = FlowView.of("f", fan(10))
    console = Console(width=render.PIPED_WIDTH, color_system=None)
    with console.capture() as captured:
        render.print_flow(console, view, limit=5)
    shown = captured.get()
    assert "flow f: RUNNING" in shown
    assert "12 steps in 3 levels (11 WAITING, 1 PENDING); 0 compensations" in shown
    assert "12 steps, the first 5 (--limit 0: all)" in shown
    row = next(line for line in shown.splitlines() if "f/b1 " in line)
    assert "│ 2 " in row and "waits on f/a" in row
    with console.capture() as captured:
        render.print_flow(console, view, limit=0)
    last = next(line for line in captured.get().splitlines() if "│ f/c " in line)
    assert "f/b1, f/b2, f/b3 and 7 more" in last and "│ 3 " in last
