"""The ``taskrunner`` command. Each command calls the public coroutine a user would.

One module per command group (``tasks``, ``workflows``, ``admin``, ``flow``, ``schedules``,
``worker``, ``dev``), ``render`` for output, ``options`` for the connection options and the error
path, ``signals`` for SIGINT/SIGTERM. The reference is docs/cli.md.
"""

from __future__ import annotations

import sys

from taskrunner.cli import admin, dashboard, dev, flow, schedules, tasks, worker, workflows
from taskrunner.cli.app import app

__all__ = ["app", "main"]
_COMMAND_GROUPS = (
    tasks,
    workflows,
    admin,
    flow,
    schedules,
    worker,
    dev,
    dashboard,
)  # imported for the commands they register


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
