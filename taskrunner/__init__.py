"""taskrunner: background tasks as readable MongoDB documents."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from taskrunner._version import __version__ as __version__

if TYPE_CHECKING:  # the names as mypy and the API reference see them
    from taskrunner.client import TaskClient
    from taskrunner.context import TaskContext
    from taskrunner.engine.worker import Worker
    from taskrunner.errors import (
        ConfigurationError,
        DocumentTooLarge,
        Fail,
        FlowNotFound,
        InvalidParams,
        InvalidSchedule,
        InvalidState,
        InvalidTask,
        MalformedTask,
        NoLiveWorkerWarning,
        RateLimited,
        Retry,
        RunnerClosed,
        ScheduleNotFound,
        ServerTooOld,
        StoreError,
        StoreUnavailable,
        TaskNotFound,
        TaskRunnerError,
        UnknownTaskName,
        UnknownUpstream,
        WaitTimeout,
        WriteRejected,
    )
    from taskrunner.limits.gates import Limit
    from taskrunner.limits.state import LimitState, LimitView
    from taskrunner.models import (
        Compensation,
        EntryState,
        NewTask,
        PinnedAway,
        StoredTask,
        SyncTask,
        Task,
        TaskError,
        TaskOptions,
        TaskPage,
        TaskState,
        TaskStats,
        Unreadable,
        WorkerEntry,
        WorkerInfo,
    )
    from taskrunner.observability.logs import configure_logging
    from taskrunner.options import PublishOptions, TaskOptionsDict, TaskSpec
    from taskrunner.runner import TaskRunner
    from taskrunner.schedules.model import Schedule, ScheduleState, ScheduleView
    from taskrunner.store.memory import MemoryStore
    from taskrunner.store.preflight import ServerCheck, ServerInfo
    from taskrunner.sync import SyncTaskRunner
    from taskrunner.worker_options import WorkerOptions
    from taskrunner.workflows.builder import Flow, Step, StepDict
    from taskrunner.workflows.model import FlowState, FlowView

# Each public name is imported on first use (PEP 562), not with the package: the
# `taskrunner` command imports this package for every command, and most commands need
# a small part of it (`taskrunner --help` none).
_EXPORTS = {
    "ConfigurationError": "taskrunner.errors",
    "DocumentTooLarge": "taskrunner.errors",
    "EntryState": "taskrunner.models",
    "Compensation": "taskrunner.models",
    "Fail": "taskrunner.errors",
    "Flow": "taskrunner.workflows.builder",
    "FlowNotFound": "taskrunner.errors",
    "FlowState": "taskrunner.workflows.model",
    "FlowView": "taskrunner.workflows.model",
    "InvalidParams": "taskrunner.errors",
    "InvalidSchedule": "taskrunner.errors",
    "InvalidState": "taskrunner.errors",
    "InvalidTask": "taskrunner.errors",
    "Limit": "taskrunner.limits.gates",
    "LimitState": "taskrunner.limits.state",
    "LimitView": "taskrunner.limits.state",
    "MalformedTask": "taskrunner.errors",
    "MemoryStore": "taskrunner.store.memory",
    "NewTask": "taskrunner.models",
    "NoLiveWorkerWarning": "taskrunner.errors",
    "PinnedAway": "taskrunner.models",
    "RateLimited": "taskrunner.errors",
    "Retry": "taskrunner.errors",
    "RunnerClosed": "taskrunner.errors",
    "Schedule": "taskrunner.schedules.model",
    "ScheduleNotFound": "taskrunner.errors",
    "ScheduleState": "taskrunner.schedules.model",
    "ScheduleView": "taskrunner.schedules.model",
    "ServerCheck": "taskrunner.store.preflight",
    "ServerInfo": "taskrunner.store.preflight",
    "ServerTooOld": "taskrunner.errors",
    "StoreError": "taskrunner.errors",
    "StoreUnavailable": "taskrunner.errors",
    "Step": "taskrunner.workflows.builder",
    "StepDict": "taskrunner.workflows.builder",
    "StoredTask": "taskrunner.models",
    "SyncTask": "taskrunner.models",
    "SyncTaskRunner": "taskrunner.sync",
    "Task": "taskrunner.models",
    "TaskClient": "taskrunner.client",
    "TaskContext": "taskrunner.context",
    "TaskError": "taskrunner.models",
    "TaskNotFound": "taskrunner.errors",
    "TaskOptions": "taskrunner.models",
    "TaskOptionsDict": "taskrunner.options",
    "TaskSpec": "taskrunner.options",
    "PublishOptions": "taskrunner.options",
    "TaskPage": "taskrunner.models",
    "TaskRunner": "taskrunner.runner",
    "TaskRunnerError": "taskrunner.errors",
    "TaskState": "taskrunner.models",
    "TaskStats": "taskrunner.models",
    "UnknownTaskName": "taskrunner.errors",
    "UnknownUpstream": "taskrunner.errors",
    "Unreadable": "taskrunner.models",
    "WaitTimeout": "taskrunner.errors",
    "Worker": "taskrunner.engine.worker",
    "WorkerEntry": "taskrunner.models",
    "WorkerInfo": "taskrunner.models",
    "WorkerOptions": "taskrunner.worker_options",
    "WriteRejected": "taskrunner.errors",
    "configure_logging": "taskrunner.observability.logs",
}


if not TYPE_CHECKING:  # mypy sees the imports above; a module __getattr__ would make any name pass

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'taskrunner' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


# The public API is what a user's code names: what it builds or calls (runners, the
# worker and its options, the memory store for tests), what handlers raise (Fail, Retry,
# RateLimited), what callers catch or filter (the errors and warnings public methods
# document), and the types of the values public methods return or hand to handlers, so
# code can annotate them.
# Engine internals (the store protocol and MongoStore, claims, change events, errors the
# worker handles itself) stay importable from their modules, outside this promise.
__all__ = [
    "Compensation",
    "ConfigurationError",
    "DocumentTooLarge",
    "EntryState",
    "Fail",
    "Flow",
    "FlowNotFound",
    "FlowState",
    "FlowView",
    "InvalidParams",
    "InvalidSchedule",
    "InvalidState",
    "InvalidTask",
    "Limit",
    "LimitState",
    "LimitView",
    "MalformedTask",
    "MemoryStore",
    "NewTask",
    "NoLiveWorkerWarning",
    "PinnedAway",
    "PublishOptions",
    "RateLimited",
    "Retry",
    "RunnerClosed",
    "Schedule",
    "ScheduleNotFound",
    "ScheduleState",
    "ScheduleView",
    "ServerCheck",
    "ServerInfo",
    "ServerTooOld",
    "Step",
    "StepDict",
    "StoreError",
    "StoreUnavailable",
    "StoredTask",
    "SyncTask",
    "SyncTaskRunner",
    "Task",
    "TaskClient",
    "TaskContext",
    "TaskError",
    "TaskNotFound",
    "TaskOptions",
    "TaskOptionsDict",
    "TaskPage",
    "TaskRunner",
    "TaskRunnerError",
    "TaskSpec",
    "TaskState",
    "TaskStats",
    "UnknownTaskName",
    "UnknownUpstream",
    "Unreadable",
    "WaitTimeout",
    "Worker",
    "WorkerEntry",
    "WorkerInfo",
    "WorkerOptions",
    "WriteRejected",
    "configure_logging",
]
