"""Every MongoDB field, state and index name taskrunner uses, in one place.

A task document (collection ``taskrunner.tasks`` by default)::

    {
      _id, key, name, params, priority,
      created_at, updated_at, run_at,          # BSON dates, server time
      options: {concurrency, max_failures, local_retries, retry_backoff, backoff,
                backoff_factor, backoff_cap, ping_interval, ping_timeout, worker_ids, timeout},
      workers: [{worker_id, run_id, state, claimed_at, ping_at, expires_at,
                 attempt, progress, result, error: {type, message, traceback},
                 finished_at, took_over}],
      state,           # summary: WAITING | PENDING | RUNNING | SUCCESS | FAIL | CANCELED
      failures,        # task-wide failure count (the max_failures budget)
      fatal,           # true after a failure that is not retried (Fail, invalid params): FAIL at once
      snoozes,         # runs that ended by Retry / ctx.snooze / RateLimited (no failure counted)
      attempts,        # claims made so far
      claimable_at,    # earliest time a new worker may claim; absent when finished
      finished_at,     # when the task reached SUCCESS, FAIL or CANCELED (TTL retention)
      publish_id,      # id of the publish call that wrote this version
      bucket,          # 0..BUCKETS-1, a hash of the key: whose stream hears the insert
      trace,           # {traceparent, tracestate}: the publishing span (tracing on only)
      # only on tasks of workflows (docs/workflows.md):
      after, waiting_on, on_upstream_failure, canceled_by,   # a dependent's upstreams
      dependents, notify, link,                             # follow-ups owed (see below)
      flow, compensate: {name, params}, compensates,        # a flow's steps
    }

Durations inside ``options`` are seconds (numbers); see docs/schema.md.
"""

from __future__ import annotations

from typing import Any, Final

DEFAULT_URI: Final = "mongodb://localhost:27017"
DEFAULT_DATABASE: Final = "taskrunner"
DEFAULT_COLLECTION: Final = "tasks"

# -- task document -----------------------------------------------------------
ID: Final = "_id"
KEY: Final = "key"
NAME: Final = "name"
PARAMS: Final = "params"
PRIORITY: Final = "priority"
CREATED_AT: Final = "created_at"
UPDATED_AT: Final = "updated_at"
RUN_AT: Final = "run_at"
OPTIONS: Final = "options"
WORKERS: Final = "workers"
STATE: Final = "state"
FAILURES: Final = "failures"
ATTEMPTS: Final = "attempts"
CLAIMABLE_AT: Final = "claimable_at"
PUBLISH_ID: Final = "publish_id"
FATAL: Final = "fatal"
SNOOZES: Final = "snoozes"
BUCKET: Final = "bucket"
TRACE: Final = "trace"
"""The W3C trace context of the span that published the task (or retried it), as the
OpenTelemetry propagator writes it: ``{traceparent, tracestate}``; only with tracing on
(docs/observability.md). Each run's span is its child. One that does not read is ignored."""
UNDECODABLE: Final = "\0undecodable"
"""Never stored: the store sets it on a document read back that did not decode as BSON,
with the reason, so that the document reads as a malformed task."""
BUCKETS: Final = 1024
"""Tasks spread over this many buckets; each worker's change stream hears the inserts of
the buckets it owns (rendezvous hashing over the live workers), so an insert reaches one
worker, not all. A missing or out-of-range ``bucket`` is heard by every worker."""

# -- workflows: dependencies between tasks, flows, compensation (docs/workflows.md) ------------
AFTER: Final = "after"
"""Keys of the tasks this one runs after (as published; never changed)."""
WAITING_ON: Final = "waiting_on"
"""Of ``after``, the keys not yet heard of as SUCCESS (with ``on_upstream_failure: "run"``:
as finished). A WAITING task whose list empties becomes PENDING."""
ON_UPSTREAM_FAILURE: Final = "on_upstream_failure"
"""``"cancel"`` (the default): an upstream ending FAIL or CANCELED cancels this task;
``"run"``: it runs once every upstream finished, whatever their states."""
CANCELED_BY: Final = "canceled_by"
"""Upstream keys whose FAIL or CANCELED canceled this task; retrying one re-arms it."""
DEPENDENTS: Final = "dependents"
"""True on a task others wait on (or whose flow has compensations): its end is announced."""
NOTIFY: Final = "notify"
"""A counter, present while this task's dependents have yet to hear of its state; whoever
settles them removes it if it still holds what they read (a later change counts again)."""
LINK: Final = "link"
"""A counter, present while this task's upstreams have yet to learn of it (a publish or a
retry in progress, or one that died); removed the same way as ``notify``."""
FLOW: Final = "flow"
"""The id of the flow this task is a step (or a compensation) of."""
COMPENSATE: Final = "compensate"
"""``{name, params}``: the task that undoes this step if its flow fails."""
COMPENSATES: Final = "compensates"
"""On a compensation task: the key of the step it undoes."""
UPSTREAM_FAILED: Final = "UpstreamFailed"
"""The ``error.type`` of a task canceled because an upstream ended FAIL or CANCELED."""
FLOW_FAILED: Final = "FlowFailed"
"""The ``error.type`` of a flow's step canceled because another step of it failed (a saga stops)."""
COMPENSATION_NAME: Final = "name"
COMPENSATION_PARAMS: Final = "params"

# -- options sub-document -----------------------------------------------------
CONCURRENCY: Final = "concurrency"
MAX_FAILURES: Final = "max_failures"
LOCAL_RETRIES: Final = "local_retries"
RETRY_BACKOFF: Final = "retry_backoff"
BACKOFF: Final = "backoff"
BACKOFF_FACTOR: Final = "backoff_factor"
BACKOFF_CAP: Final = "backoff_cap"
PING_INTERVAL: Final = "ping_interval"
PING_TIMEOUT: Final = "ping_timeout"
WORKER_IDS: Final = "worker_ids"
TIMEOUT: Final = "timeout"

# -- worker entry ---------------------------------------------------------------
WORKER_ID: Final = "worker_id"
RUN_ID: Final = "run_id"
CLAIMED_AT: Final = "claimed_at"
PING_AT: Final = "ping_at"
EXPIRES_AT: Final = "expires_at"
ATTEMPT: Final = "attempt"
PROGRESS: Final = "progress"
RESULT: Final = "result"
ERROR: Final = "error"
FINISHED_AT: Final = "finished_at"
TOOK_OVER: Final = "took_over"

# -- error record -----------------------------------------------------------------
ERROR_TYPE: Final = "type"
ERROR_MESSAGE: Final = "message"
ERROR_TRACEBACK: Final = "traceback"


# -- change events (the documents a MongoDB change stream returns) ---------------------------
OPERATION_TYPE: Final = "operationType"
FULL_DOCUMENT: Final = "fullDocument"
UPDATE_DESCRIPTION: Final = "updateDescription"
UPDATED_FIELDS: Final = "updatedFields"
DOCUMENT_KEY: Final = "documentKey"
"""The changed document's ``_id`` (in every insert, update, replace and delete event)."""
INVALIDATE: Final = "invalidate"
"""The ``operationType`` of the event that ends a stream (collection or database dropped or renamed)."""


# -- server replies the start-up check reads (hello, buildInfo, connectionStatus; preflight.py) --
SET_NAME: Final = "setName"
"""In ``hello``: the replica set's name (absent on a standalone and on mongos)."""
HELLO_MSG: Final = "msg"
"""In ``hello``: ``"isdbgrid"`` on a mongos (a sharded cluster's router)."""
IS_DBGRID: Final = "isdbgrid"
SERVER_VERSION: Final = "version"
VERSION_ARRAY: Final = "versionArray"
AUTH_INFO: Final = "authInfo"
AUTHENTICATED_USERS: Final = "authenticatedUsers"
AUTHENTICATED_PRIVILEGES: Final = "authenticatedUserPrivileges"
USER: Final = "user"
USER_DB: Final = "db"
RESOURCE: Final = "resource"
ACTIONS: Final = "actions"
RESOURCE_DB: Final = "db"
RESOURCE_COLLECTION: Final = "collection"
ANY_RESOURCE: Final = "anyResource"


# -- worker registry (collection "<tasks collection>.workers") --------------------------------
REGISTRY_SUFFIX: Final = "workers"
HOST: Final = "host"
PID: Final = "pid"
STARTED_AT: Final = "started_at"
BEAT_AT: Final = "beat_at"
NAMES: Final = "names"
RUNNING: Final = "running"
VERSION: Final = "version"
STOP_REQUESTED: Final = "stop_requested"
SCHEDULE_IDS: Final = "schedules"
"""Ids of the schedules the worker's app declares (a schedule no live worker declares is orphaned)."""

# -- schedules (collection "<tasks collection>.schedules"; docs/schedules.md) -----------------
SCHEDULES_SUFFIX: Final = "schedules"
CRON: Final = "cron"
EVERY: Final = "every"
TIMEZONE: Final = "timezone"
CATCH_UP: Final = "catch_up"
MAX_CATCH_UP: Final = "max_catch_up"
JITTER: Final = "jitter"
GRACE: Final = "grace"
PAUSED: Final = "paused"
NEXT_AT: Final = "next_at"
LAST_TICK: Final = "last_tick"
LAST_KEY: Final = "last_key"
DECLARED_AT: Final = "declared_at"
PAUSED_AT: Final = "paused_at"
THROTTLED_UNTIL: Final = "throttled_until"
THROTTLED_GATES: Final = "throttled_gates"
"""In a limits document: ``[{gate, until}]``, the ``limit_by`` values a handler's
``RateLimited`` holds back (``gate`` as in ``<collection>.gates``)."""
GATE: Final = "gate"
UNTIL: Final = "until"
RESUMED_AT: Final = "resumed_at"
SCHEDULE_DEFINITION: Final = (
    NAME,
    PARAMS,
    PRIORITY,
    OPTIONS,
    CRON,
    EVERY,
    TIMEZONE,
    CATCH_UP,
    MAX_CATCH_UP,
    JITTER,
    GRACE,
)
"""Fields a worker writes from its app's code at start; the rest is the schedule's state."""


# -- flow control by task name (collection "<tasks collection>.limits"; docs/limits.md) ----------
LIMITS_SUFFIX: Final = "limits"
# A document's _id is the task name ("*": every name); it holds PAUSED, PAUSED_AT, RESUMED_AT,
# UPDATED_AT, THROTTLED_UNTIL, THROTTLED_GATES and operators' RATE_LIMIT and MAX_RUNNING. The
# registry's PAUSED lists the names a worker has paused right now.
RATE_LIMIT: Final = "rate_limit"
MAX_RUNNING: Final = "max_running"
LIMIT_BY: Final = "limit_by"
DECLARED: Final = "declared"
"""In a limits document: the limits the app's code declares, as its workers last wrote them."""

# -- fleet-wide limits' gates (collection "<tasks collection>.gates"; taskrunner/limits/gates.py) -------
GATES_SUFFIX: Final = "gates"
# A gate's VERSION (the registry's field name) counts its writes, for compare-and-set.
LANES: Final = "lanes"
RUNNING_SLOTS: Final = "running"


def opt(name: str) -> str:
    """Dotted path of an option, e.g. ``options.concurrency``."""
    return f"{OPTIONS}.{name}"


def ref(path: str) -> str:
    """Aggregation field reference, e.g. ``$options.concurrency``."""
    return f"${path}"


# -- indexes: name -> (keys, options) ---------------------------------------------
# key_unique: idempotent publish and every keyed write.
# claim: the claim filter (state in PENDING/RUNNING, claimable_at <= now) and its
#   sort (priority desc, created_at asc).
# name_claim: the sweep's PENDING tasks per name (name, state, then claimable_at order),
#   so one name's backlog never hides another's; also operators' listing by name and state.
# worker: which tasks a worker runs or ran (`taskrunner list --worker`).
# created, updated: the dashboard's task list, newest first, paged by (time, key) without
#   a skip; updated costs every write one more index entry, the price of a live list.
# failed: the dead-letter view (`taskrunner failed`, the dashboard's failed list), FAIL
#   tasks newest failed first; partial, so only failed tasks are in it.
INDEXES: Final[dict[str, tuple[list[tuple[str, int]], dict[str, Any]]]] = {
    "key_unique": ([(KEY, 1)], {"unique": True}),
    "claim": ([(STATE, 1), (CLAIMABLE_AT, 1), (PRIORITY, -1), (CREATED_AT, 1)], {}),
    "name_claim": ([(NAME, 1), (STATE, 1), (CLAIMABLE_AT, 1)], {}),
    "worker": ([(f"{WORKERS}.{WORKER_ID}", 1)], {}),
    "created": ([(CREATED_AT, -1), (KEY, -1)], {}),
    "updated": ([(UPDATED_AT, -1), (KEY, -1)], {}),
    "failed": ([(FINISHED_AT, -1), (KEY, -1)], {"partialFilterExpression": {STATE: "FAIL"}}),
    # Workflows: a task's dependents (multikey; only tasks with an ``after``), a flow's steps
    # by state, and the follow-ups owed (small: present only until they are done).
    "after": ([(AFTER, 1)], {"partialFilterExpression": {AFTER: {"$exists": True}}}),
    "flow": ([(FLOW, 1), (STATE, 1)], {"partialFilterExpression": {FLOW: {"$exists": True}}}),
    "notify": ([(NOTIFY, 1)], {"partialFilterExpression": {NOTIFY: {"$exists": True}}}),
    "link": ([(LINK, 1)], {"partialFilterExpression": {LINK: {"$exists": True}}}),
    # Partial: only unfinished tasks pinned to worker ids (PENDING and RUNNING sort between
    # these bounds; a partial filter takes no $in before MongoDB 7.0), for `stats`' tasks
    # pinned to no live worker. One field: a compound key could meet parallel arrays.
    "pinned": (
        [(f"{OPTIONS}.{WORKER_IDS}", 1)],
        {
            "partialFilterExpression": {
                f"{OPTIONS}.{WORKER_IDS}": {"$type": "string"},
                STATE: {"$gte": "PENDING", "$lte": "RUNNING"},
            }
        },
    ),
}
# Retention (`taskrunner init --retain-finished 7d`): MongoDB deletes finished tasks itself.
RETENTION_INDEX: Final = "finished_ttl"
# Retention of tasks that did not succeed (`init --retain-failed 30d`): FAIL and CANCELED,
# the states that sort before PENDING (a partial filter takes no $in before MongoDB 7.0).
# With it, finished_ttl keeps to SUCCESS. Two indexes may not share a key pattern before
# MongoDB 5.0, hence finished_at descending here.
FAILED_RETENTION_INDEX: Final = "failed_ttl"
SUCCEEDED: Final[dict[str, Any]] = {STATE: "SUCCESS"}
UNSUCCESSFUL: Final[dict[str, Any]] = {STATE: {"$lt": "PENDING"}}

# The registry: live workers, expired by MongoDB's TTL monitor once they stop beating.
REGISTRY_INDEXES: Final[dict[str, tuple[list[tuple[str, int]], dict[str, Any]]]] = {
    "expires_ttl": ([(EXPIRES_AT, 1)], {"expireAfterSeconds": 0}),
}
