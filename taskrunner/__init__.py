"""taskrunner: background tasks as readable MongoDB documents."""

from __future__ import annotations

__version__ = "0.1.0"  # before the imports: the worker reads it while the package loads

from taskrunner.context import TaskContext
from taskrunner.errors import (
    ConfigurationError,
    DocumentTooLarge,
    Fail,
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
    WaitTimeout,
    WriteRejected,
)
from taskrunner.gates import Limit
from taskrunner.limits import LimitState
from taskrunner.models import (
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
    WorkerEntry,
    WorkerInfo,
)
from taskrunner.preflight import ServerCheck, ServerInfo
from taskrunner.runner import TaskRunner
from taskrunner.schedules import Schedule, ScheduleState, ScheduleView
from taskrunner.store.memory import MemoryStore
from taskrunner.sync import SyncTaskRunner
from taskrunner.worker import Worker
from taskrunner.worker_options import WorkerOptions

# The public API is what a user's code names: what it builds or calls (runners, the
# worker and its options, the memory store for tests), what handlers raise (Fail, Retry,
# RateLimited), what callers catch or filter (the errors and warnings public methods
# document), and the types of the values public methods return or hand to handlers, so
# code can annotate them.
# Engine internals (the store protocol and MongoStore, claims, change events, errors the
# worker handles itself) stay importable from their modules, outside this promise.
__all__ = [
    "ConfigurationError",
    "DocumentTooLarge",
    "EntryState",
    "Fail",
    "InvalidParams",
    "InvalidSchedule",
    "InvalidState",
    "InvalidTask",
    "Limit",
    "LimitState",
    "MalformedTask",
    "MemoryStore",
    "NewTask",
    "NoLiveWorkerWarning",
    "PinnedAway",
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
    "StoreError",
    "StoreUnavailable",
    "StoredTask",
    "SyncTask",
    "SyncTaskRunner",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskNotFound",
    "TaskOptions",
    "TaskPage",
    "TaskRunner",
    "TaskRunnerError",
    "TaskState",
    "TaskStats",
    "UnknownTaskName",
    "WaitTimeout",
    "Worker",
    "WorkerEntry",
    "WorkerInfo",
    "WorkerOptions",
    "WriteRejected",
]
