"""Every change the embedded server makes to mongoeco's own objects, in one place.

The bridge was written for one mongoeco release, ``MONGOECO_VERSION``, pinned in
pyproject.toml: it replaces or wraps the private attributes listed below, which another
release may move or change silently. The server refuses to start on another release, naming
the one found and the one to install, and ``tests/contract/test_embedded.py`` checks that each
attribute still exists with the arguments used here.

What is patched (the behaviour is written in the module named):

* ``QueryEngine._comparison_matches_candidate``, ``._match_top_level_comparison`` and
  ``._evaluate_comparison``, ``CompiledQuery._comparison_code``: query-language range
  comparisons bracket BSON types, as MongoDB's (``taskrunner.dev.bracketing``).
  Process-wide, once.
* ``transform_stages._evaluate_expression_with_missing`` and
  ``runtime_state._evaluate_expression_with_missing`` (how ``$set``/``$addFields`` compute a
  field): a ``$cond`` or ``$switch`` whose branch is missing sets nothing, as MongoDB's
  (``taskrunner.dev.computed``). Process-wide, once.
* ``array_string_expressions._append_unique_values`` (how set expressions drop repeated
  values) and ``CompiledQuery._node_to_code`` for ``$in`` (how a filter's list of values is
  matched): strings are hashed, in linear time, as MongoDB's (``taskrunner.dev.sets``).
  Process-wide, once.
* ``stages._apply_union_with`` (``$unionWith``): the union's collection is narrowed by
  its sub-pipeline's leading ``$match`` before mongoeco copies it (``taskrunner.dev.unions``).
  Process-wide, once.
* The server's change hub, ``_append_committed_event_locked``: every event mongoeco
  publishes goes through the bridge's oplog first (``taskrunner.dev.oplog``).
* The server's engine, ``_ensure_unique_indexes``: MongoDB's 16 MiB document limit, and
  inserts that do not scan the collection (``taskrunner.dev.engine``).
* The server's proxy, ``_executor``: the bridge (``taskrunner.dev.server``), answering what
  mongoeco lacks; ``_handle_connection`` and ``_dispatch_wire_request``: each connection's
  address and message size, and dropped connections as a test fault (``taskrunner.dev.faults``).
* Transactions (``taskrunner.dev.transactions``): the wire session store's sessions
  (``_session_store._sessions``) are committed and aborted through mongoeco's session API;
  the engine's transaction states (``_mvcc_states``: ``pending_changes``, ``has_writes``,
  ``snapshot_version`` against ``_mvcc_version``, ``touched_namespaces`` and ``indexes``
  against ``_indexes``) are read to find the documents a statement wrote and whether a
  commit can install the snapshot as it is; a commit applied
  to newer data gets the transaction's own ``pending_changes`` (its events); and committed
  changes are dispatched to the client's hub (``_validated_engine_spi``, ``_change_hub``)
  at commit, where mongoeco waits for the next write outside a transaction.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

from taskrunner.dev import bracketing, computed, sets, unions
from taskrunner.dev.engine import checked_store
from taskrunner.dev.faults import connection_hooks
from taskrunner.dev.wire import MONGOECO_AVAILABLE

if MONGOECO_AVAILABLE:
    from mongoeco.core.aggregation import array_string_expressions, runtime_state, stages, transform_stages
    from mongoeco.core.compiled_query import CompiledQuery
    from mongoeco.core.filtering import QueryEngine
    from mongoeco.wire._session_identity import wire_session_key as _wire_session_key

MONGOECO_VERSION = "4.11.0"
"""The mongoeco release the bridge was written for."""

_query_language_patched = False


def mongoeco_mismatch(installed: str | None = None) -> str | None:
    """Why the installed mongoeco cannot serve (another release than ``MONGOECO_VERSION``),
    or None when it is the one."""
    found = installed if installed is not None else importlib.metadata.version("mongoeco")
    if found == MONGOECO_VERSION:
        return None
    return (
        f"the embedded server's bridge was written for mongoeco {MONGOECO_VERSION} and reaches into "
        f"its internals; mongoeco {found} is installed: pip install 'mongoeco=={MONGOECO_VERSION}'"
    )


def patch_query_language() -> None:
    """Range comparisons bracket types, and computed fields may be missing (process-wide;
    idempotent)."""
    global _query_language_patched
    if _query_language_patched:
        return
    _query_language_patched = True
    _wrap_classmethod("_comparison_matches_candidate", bracketing.bracketed)
    _wrap_classmethod("_match_top_level_comparison", bracketing.top_level_missing)
    _wrap_classmethod("_evaluate_comparison", bracketing.path_missing)
    comparison_code = bracketing.through_the_plan(CompiledQuery._comparison_code)
    setattr(CompiledQuery, "_comparison_code", comparison_code)  # noqa: B010 - mypy forbids assigning a method
    setattr(CompiledQuery, "_node_to_code", sets.hashed_in(CompiledQuery._node_to_code))  # noqa: B010
    CompiledQuery._compile_expression.cache_clear()  # matchers compiled before bound the old functions
    name = "_evaluate_expression_with_missing"
    for module in (transform_stages, runtime_state):
        setattr(module, name, computed.keeping_missing(getattr(module, name)))
    union = unions.matched_first(getattr(stages, "_apply_union_with"), transform_stages._apply_match)  # noqa: B009
    setattr(stages, "_apply_union_with", union)  # noqa: B010
    unique = "_append_unique_values"
    setattr(array_string_expressions, unique, sets.linear(getattr(array_string_expressions, unique)))


def patch_engine(engine: Any) -> None:
    """The size limit and the insert fast path on the server's own engine."""
    engine._ensure_unique_indexes = checked_store(engine._ensure_unique_indexes)


def route_hub_events(hub: Any, receive: Callable[[Any], None]) -> Callable[[Any], None]:
    """``receive`` in place of the hub's append funnel; returns the funnel, to forward to."""
    forward: Callable[[Any], None] = hub._append_committed_event_locked
    hub._append_committed_event_locked = receive
    return forward


def patch_proxy(proxy: Any, bridge: Callable[[Any], Any]) -> None:
    """The bridge in place of the proxy's executor (``bridge`` gets the original), and the
    connection hooks around its connection handler and dispatch."""
    proxy._executor = bridge(proxy._executor)
    proxy._handle_connection, proxy._dispatch_wire_request = connection_hooks(
        proxy._handle_connection, proxy._dispatch_wire_request
    )


def _wrap_classmethod(name: str, wrap: Callable[[Callable[..., bool]], Callable[..., bool]]) -> None:
    """Replace ``QueryEngine.<name>`` (a classmethod) by ``wrap`` of its function."""
    original: Callable[..., bool] = inspect.getattr_static(QueryEngine, name).__func__
    setattr(QueryEngine, name, classmethod(wrap(original)))


# Transactions (taskrunner.dev.transactions).


def wire_session_key(lsid: Any) -> str:
    """mongoeco's key for a wire session id."""
    key: str = _wire_session_key(lsid)
    return key


def session_store(proxy_executor: Any) -> Any:
    """The wire session store of the proxy's command executor."""
    return proxy_executor._session_store


def wire_session(sessions: Any, key: str) -> Any | None:
    """The mongoeco session behind wire session ``key``, if it is active."""
    context = sessions._sessions.get(key)
    return context.session if context is not None and context.session.active else None


def _transaction_state(engine: Any, sessions: Any, key: str) -> Any | None:
    session = wire_session(sessions, key)
    return None if session is None else engine._mvcc_states.get(session.session_id)


def pending_changes(engine: Any, sessions: Any, key: str) -> list[Any]:
    """The change payloads of the session's open transaction, in order (dicts, or None)."""
    state = _transaction_state(engine, sessions, key)
    return [] if state is None else list(state.pending_changes)


def can_install(engine: Any, sessions: Any, key: str) -> bool:
    """Whether mongoeco can commit the session's transaction as it is: nothing was written
    since its snapshot (mongoeco installs whole collections), or it wrote nothing."""
    state = _transaction_state(engine, sessions, key)
    return state is None or not state.has_writes or state.snapshot_version == engine._mvcc_version


def creates_indexes(engine: Any, sessions: Any, key: str) -> bool:
    """Whether the session's transaction has indexes the live data lacks (created inside it)."""
    state = _transaction_state(engine, sessions, key)
    if state is None:
        return False
    for db, coll in state.touched_namespaces:
        mine = {index.name for index in state.indexes.get(db, {}).get(coll, [])}
        live = {index.name for index in engine._indexes.get(db, {}).get(coll, [])}
        if mine - live:
            return True
    return False


def commit_wire_transaction(sessions: Any, key: str) -> None:
    session = wire_session(sessions, key)
    if session is not None and session.transaction_active:
        session.commit_transaction()


def abort_wire_transaction(sessions: Any, key: str) -> None:
    session = wire_session(sessions, key)
    if session is not None and session.transaction_active:
        session.abort_transaction()


def replace_pending_changes(engine: Any, session: Any, changes: list[Any]) -> None:
    """The events ``session``'s transaction publishes at commit: ``changes``."""
    engine._mvcc_states[session.session_id].pending_changes = list(changes)


def dispatch_changes(client: Any) -> None:
    """Deliver committed changes to the client's hub now (and so to the oplog)."""
    client._validated_engine_spi.dispatch_committed_changes(client._change_hub)
