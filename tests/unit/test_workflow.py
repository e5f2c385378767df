"""The real-server check paths, read as data: the GitHub workflow and docker-compose.yml's ``check``.

Neither can run here (no GitHub runner, no Docker engine); .ci/run validates both files against
their JSON schemas, and these tests pin what the schemas cannot: the matrices, that the test steps
run the README's test command, and that the URIs name the replica set the server is started with.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from taskrunner.worker_options import WorkerOptions

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
COMPOSE = ROOT / "docker-compose.yml"
PYTHONS = ["3.11", "3.12", "3.13", "3.14"]
MONGOS = ["6.0", "7.0", "8.0"]


def readme_test_command() -> str:
    """The command of README.md's "Run the tests" block."""
    section = (ROOT / "README.md").read_text().split("## Run the tests", 1)[1]
    found = re.search(r"```sh\n(.*?)\n```", section, re.DOTALL)
    assert found is not None, "README.md's 'Run the tests' has no ```sh block"
    return found[1].strip()


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def jobs() -> dict[str, Any]:
    jobs: dict[str, Any] = load(WORKFLOW)["jobs"]
    return jobs


def runs(job: dict[str, Any]) -> list[str]:
    return [str(step["run"]).strip() for step in job["steps"] if "run" in step]


def step_running(job: dict[str, Any], text: str) -> dict[str, Any]:
    return next(step for step in job["steps"] if text in str(step.get("run", "")))


def test_readme_command_runs_on_every_supported_python(jobs: dict[str, Any]) -> None:
    """The tests job runs the README's test command on Python 3.11 to 3.14, the lowest being requires-python's."""
    job = jobs["tests"]
    assert job["strategy"]["matrix"]["python"] == PYTHONS
    assert readme_test_command() in runs(job)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={PYTHONS[0]}"


def test_whole_suite_runs_on_each_mongodb_replica_set(jobs: dict[str, Any]) -> None:
    """real-mongo starts MongoDB 6.0, 7.0 and 8.0 with --replSet, initiates it, and runs the README's command with the URI."""
    job = jobs["real-mongo"]
    assert job["strategy"]["matrix"]["mongo"] == MONGOS
    service = job["services"]["mongo"]
    assert service["image"] == "mongo:${{ matrix.mongo }}"
    started = re.fullmatch(r"--replSet (\w+) --bind_ip_all --port (\d+)", service["command"])
    assert started is not None
    replica_set, port = started[1], started[2]
    assert service["ports"] == [f"{port}:{port}"]
    assert port != "27017", "the README's dev-server block takes 27017 on the runner"
    assert job["env"]["TASKRUNNER_TEST_MONGO_URI"] == f"mongodb://localhost:{port}/?replicaSet={replica_set}"
    initiate = step_running(job, "rs.initiate")["run"]
    assert f'_id: "{replica_set}", members: [{{_id: 0, host: "localhost:{port}"}}]' in initiate
    assert f"--port {port}" in initiate and f"--port {port}" in service["options"]
    order = runs(job)
    assert order.index(readme_test_command()) > order.index(step_running(job, "rs.initiate")["run"].strip())


def test_explain_report_runs_on_8_0_and_is_uploaded(jobs: dict[str, Any]) -> None:
    """bench/explain.py runs on MongoDB 8.0 only, failing on a plan without an index, and its report is the artifact."""
    job = jobs["real-mongo"]
    explain = step_running(job, "bench/explain.py")
    assert "matrix.mongo == '8.0'" in explain["if"]
    assert explain["env"]["TASKRUNNER_BENCH_MONGO_URI"] == job["env"]["TASKRUNNER_TEST_MONGO_URI"]
    assert "--require-ixscan" in explain["run"]
    report = re.search(r"--results (\S+)", explain["run"])
    assert report is not None
    upload = next(
        step for step in job["steps"] if str(step.get("uses", "")).startswith("actions/upload-artifact")
    )
    assert upload["with"]["path"] == report[1]
    assert upload["if"] == explain["if"]


def test_compose_check_runs_the_same_suite_on_the_healthy_replica_set() -> None:
    """`docker compose run --rm check` waits for a healthy mongo and runs the README's command and the explain report on it."""
    services = load(COMPOSE)["services"]
    check, mongo = services["check"], services["mongo"]
    assert check["depends_on"] == {"mongo": {"condition": "service_healthy"}}
    script = check["command"][-1].splitlines()
    assert readme_test_command() in script
    assert "uv run python bench/explain.py --require-ixscan" in script
    replica_set = mongo["command"][mongo["command"].index("--replSet") + 1]
    assert f"rs.initiate({{_id: '{replica_set}'" in mongo["healthcheck"]["test"]
    expected = f"mongodb://mongo:27017/?replicaSet={replica_set}"
    assert check["environment"]["TASKRUNNER_TEST_MONGO_URI"] == expected
    assert check["environment"]["TASKRUNNER_BENCH_MONGO_URI"] == expected


def test_compose_up_still_starts_only_mongo_and_the_worker() -> None:
    """The check service sits in a profile, so plain `docker compose up` starts only mongo,
    the one-shot `init` and the worker, never the test suite."""
    services = load(COMPOSE)["services"]
    assert [name for name, service in services.items() if "profiles" not in service] == [
        "mongo",
        "init",
        "worker",
    ]
    assert services["check"]["profiles"] == ["check"]


SHELLS = {"sh", "bash", "dash", "/bin/sh", "/bin/bash"}
DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
GIVE_BACK = 5.0
"""Seconds a stopping worker is given, past its shutdown timeout, to release its claims,
give back gate lanes and unregister: a few round trips."""


def compose_seconds(duration: str) -> float:
    """A compose duration (``1m30s``, ``10s``, ``500ms``) in seconds."""
    parts = DURATION.findall(duration)
    assert "".join(value + unit for value, unit in parts) == duration, duration
    return sum(float(value) * UNITS[unit] for value, unit in parts)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (keyword, arguments), comments left out."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if line and line[0] != "#"]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_compose_worker_gets_sigterm_and_installs_once() -> None:
    """`docker compose stop` reaches the worker itself: its command is exec form (no shell
    that would sit as PID 1 ignoring SIGTERM), nothing installs at start (the image did),
    `init` runs apart before it, and the grace period before SIGKILL covers the worker's
    shutdown timeout plus the time to give its claims back."""
    services = load(COMPOSE)["services"]
    init, worker = services["init"], services["worker"]
    for service in (init, worker):
        assert service["build"] == "." and "entrypoint" not in service, service
        assert isinstance(service["command"], list) and service["command"][0] not in SHELLS, service
        assert not {"pip", "uv", "install", "&&"} & set(service["command"]), service
    assert init["command"] == ["taskrunner", "init"]
    assert init["depends_on"] == {"mongo": {"condition": "service_healthy"}}
    assert worker["command"][:2] == ["taskrunner", "worker"]
    assert worker["depends_on"] == {"init": {"condition": "service_completed_successfully"}}
    assert worker["init"] is True  # Docker's init forwards the signal and reaps handlers' children
    default = WorkerOptions().shutdown_timeout
    shutdown = float(worker["environment"].get("TASKRUNNER_SHUTDOWN_TIMEOUT", default))
    assert compose_seconds(worker.get("stop_grace_period", "10s")) >= shutdown + GIVE_BACK


def test_the_image_installs_the_locked_project_once_and_runs_the_worker_without_a_shell() -> None:
    """The Dockerfile installs uv.lock's versions at build time and its CMD is exec form."""
    steps = dockerfile_instructions()
    runs = [args for keyword, args in steps if keyword == "RUN"]
    assert any(args.startswith("uv sync --locked --no-dev") for args in runs), runs
    copied = " ".join(args for keyword, args in steps if keyword == "COPY")
    assert all(needed in copied for needed in ("pyproject.toml", "uv.lock", "taskrunner", "examples"))
    [command] = [args for keyword, args in steps if keyword == "CMD"]
    assert json.loads(command)[:2] == ["taskrunner", "worker"]
    assert "ENTRYPOINT" not in {keyword for keyword, _ in steps}
