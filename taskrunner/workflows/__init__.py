"""Workflows: tasks that run after other tasks, flows of them, and compensation (sagas).

There is no coordinator. A task published with ``after`` is stored WAITING; each task
others wait on is marked ``dependents``, and whenever it ends (or is retried) the write that
ends it also counts a ``notify`` on it. Whoever sees that counter (the worker that wrote the
outcome, at once; any worker's sweep, within a sweep interval) settles the dependents from
the upstream states it read, in one command however many there are, then removes the
counter if it still holds what was read. A publish links new dependents the same way
(``link``). Every step is idempotent, so racing workers and a worker killed in between lose
nothing and release nothing twice (docs/workflows.md).

Public: ``Flow`` and ``Step`` (``runner.flow(id)``), ``FlowView`` and ``FlowState``
(``runner.get_flow(id)``).
"""

from taskrunner.workflows.builder import Flow, Step
from taskrunner.workflows.model import FlowState, FlowView

__all__ = ["Flow", "FlowState", "FlowView", "Step"]
