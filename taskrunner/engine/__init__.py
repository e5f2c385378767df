"""The worker engine (internal): what a ``taskrunner worker`` process does.

Discovery (change stream and sweeps) feeds the claim queue; the worker claims, runs each
claim as an execution under its heartbeat, writes outcomes in batches and keeps its side
tasks (registry, clock, limits, schedules) alive through outages. Nothing here is public
API: use ``TaskRunner.run_worker``, ``Worker`` and ``WorkerOptions`` from ``taskrunner``.
"""
