"""The task options as a type checker sees them: ``TaskOptionsDict`` and ``TaskSpec`` match
``TaskOptions`` and ``publish``, and mypy rejects a misspelled option or a wrong type."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path
from typing import get_type_hints

import pytest
from mypy import api as mypy_api

from taskrunner import PublishOptions, StepDict, TaskOptions, TaskOptionsDict, TaskRunner, TaskSpec
from taskrunner.sync import SyncTaskRunner

ROOT = Path(__file__).resolve().parents[2]

MISUSE = """
from datetime import timedelta
from taskrunner import TaskRunner, TaskSpec

runner = TaskRunner()

@runner.task("resize", max_failure=3)  # misspelled
async def resize(params: dict[str, int]) -> None: ...

runner.schedule("resize", every=60, concurency=2)  # misspelled

async def publish() -> None:
    await runner.publish("resize", key="a", max_failurs=5)  # misspelled
    await runner.publish("resize", key="b", timeout="30s")  # a string, not seconds
    await runner.publish("resize", key="c", on_upstream_failure="skip")  # not a policy
    await runner.publish_many([{"name": "resize", "retry_backof": 2}])  # misspelled
    await runner.publish_many([{"name": "resize", "worker_ids": "w1"}])  # a string, not a list
    await runner.publish_many([{"params": {}}])  # no name
    runner.flow("f").add("resize", ping_intervall=1)  # misspelled
    runner.sync().publish("resize", concurrency=timedelta(seconds=1))  # a duration, not a count
"""

GOOD = """
from datetime import timedelta
from taskrunner import TaskOptionsDict, TaskRunner, TaskSpec

runner = TaskRunner()
LEASE: TaskOptionsDict = {"ping_interval": 1, "ping_timeout": timedelta(seconds=30)}

@runner.task("resize", max_failures=3, backoff="fixed", retry_backoff=timedelta(seconds=5))
async def resize(params: dict[str, int]) -> None: ...

runner.schedule("resize", every=60, concurrency=2, timeout=None)

async def publish() -> None:
    await runner.publish("resize", key="a", max_failures=5, timeout=30)
    await runner.publish("resize", key="b", **(LEASE | {"max_failures": 5}))
    batch: list[TaskSpec] = [{"name": "resize", "key": f"k{i}", **LEASE} for i in range(3)]
    await runner.publish_many([*batch, {"name": "resize", "after": ["k0"], "worker_ids": ["w1"]}])
    runner.flow("f").add("resize", priority=5, delay=timedelta(minutes=1), local_retries=2)
    runner.sync().publish("resize", concurrency=2, backoff=2.5)
"""


def _mypy(source: str, tmp_path: Path) -> list[str]:
    """mypy's error lines for ``source`` (strict, with the project's configuration)."""
    module = tmp_path / "snippet.py"
    module.write_text(textwrap.dedent(source))
    out, err, _ = mypy_api.run(
        [
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / ".mypy_cache"),
            "--no-incremental",
            "--follow-imports=silent",
            "--no-error-summary",
            str(module),
        ]
    )
    assert not err, err
    return [line for line in out.splitlines() if ": error:" in line]


@pytest.mark.timeout(300)  # mypy analyses taskrunner from scratch: tens of seconds on a busy machine
def test_mypy_rejects_each_misuse_and_accepts_correct_calls(tmp_path: Path) -> None:
    """Each misspelled option, wrong type or missing name in publish, publish_many items,
    @runner.task, runner.schedule, Flow.add and the sync facade is a mypy error on its own
    line; the same calls spelled right type-check."""
    errors = _mypy(MISUSE, tmp_path)
    flagged = {int(line.split(":")[1]) for line in errors}
    misuse_lines = {
        n for n, line in enumerate(textwrap.dedent(MISUSE).splitlines(), 1) if "  # " in line and "(" in line
    }
    assert flagged == misuse_lines, "\n".join(errors)
    assert any("max_failurs" in e for e in errors) and any('"retry_backof"' in e for e in errors)
    assert _mypy(GOOD, tmp_path) == []


def test_option_keywords_match_the_options_model() -> None:
    """TaskOptionsDict has exactly TaskOptions' fields, so every option is typed and none is
    typed that the model would refuse."""
    assert set(get_type_hints(TaskOptionsDict)) == set(TaskOptions.model_fields)
    assert TaskOptionsDict.__required_keys__ == frozenset()


def test_publish_many_items_take_publish_keywords() -> None:
    """A TaskSpec names what publish takes per task (its keywords less the call-wide ones),
    only ``name`` required; Flow.add's extra options are publish's timing ones."""
    publish = inspect.signature(TaskRunner.publish).parameters
    per_task = {n for n, p in publish.items() if p.kind is not p.VAR_KEYWORD} - {
        "self",
        "update_pending",
        "republish_finished",
        "allow_unknown",
        "session",
    }
    assert set(get_type_hints(TaskSpec)) == per_task | set(TaskOptions.model_fields)
    assert TaskSpec.__required_keys__ == frozenset({"name"})
    assert set(get_type_hints(PublishOptions)) - set(TaskOptions.model_fields) == {
        "priority",
        "run_at",
        "delay",
    }
    assert {"compensate", "on_upstream_failure"} <= set(get_type_hints(StepDict))


def test_the_sync_facade_publishes_with_the_same_keywords() -> None:
    """SyncTaskRunner.publish has TaskRunner.publish's parameters, so a keyword added to one
    cannot be missing from the other."""
    sync = inspect.signature(SyncTaskRunner.publish).parameters
    async_ = inspect.signature(TaskRunner.publish).parameters
    assert list(sync) == list(async_)
    assert [p.kind for p in sync.values()] == [p.kind for p in async_.values()]
