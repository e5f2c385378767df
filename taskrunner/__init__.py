"""taskrunner: background tasks as readable MongoDB documents."""

from __future__ import annotations

from taskrunner.context import TaskContext
from taskrunner.errors import (
    ChangeHistoryLost,
    ChangeStreamsUnsupported,
    ClaimLost,
    ConfigurationError,
    Fail,
    InvalidParams,
    InvalidSchedule,
    InvalidState,
    InvalidTask,
    MalformedTask,
    RateLimited,
    Retry,
    ScheduleNotFound,
    StoreError,
    StoreUnavailable,
    TaskNotFound,
    TaskRunnerError,
    UnknownHandler,
    UnknownTaskName,
    WaitTimeout,
    WriteRejected,
)
from taskrunner.limits import LimitState
from taskrunner.models import (
    EntryState,
    NewTask,
    Task,
    TaskError,
    TaskOptions,
    TaskState,
    TaskStats,
    WorkerEntry,
    WorkerInfo,
)
from taskrunner.runner import TaskRunner
from taskrunner.schedules import Schedule, ScheduleState, ScheduleView
from taskrunner.store.base import ChangeEvent, Claim, Store
from taskrunner.store.memory import MemoryStore
from taskrunner.store.mongo import MongoStore
from taskrunner.sync import SyncTaskRunner

__version__ = "0.1.0"

__all__ = [
    "ChangeEvent",
    "ChangeHistoryLost",
    "ChangeStreamsUnsupported",
    "Claim",
    "ClaimLost",
    "ConfigurationError",
    "EntryState",
    "Fail",
    "InvalidParams",
    "InvalidSchedule",
    "InvalidState",
    "InvalidTask",
    "LimitState",
    "MalformedTask",
    "MemoryStore",
    "MongoStore",
    "NewTask",
    "RateLimited",
    "Retry",
    "Schedule",
    "ScheduleNotFound",
    "ScheduleState",
    "ScheduleView",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "SyncTaskRunner",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskNotFound",
    "TaskOptions",
    "TaskRunner",
    "TaskRunnerError",
    "TaskState",
    "TaskStats",
    "UnknownHandler",
    "UnknownTaskName",
    "WaitTimeout",
    "WorkerEntry",
    "WorkerInfo",
    "WriteRejected",
]
