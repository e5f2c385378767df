"""Doing the follow-ups tasks owe (``notify``, ``link``), wherever they are found.

One round: mark the upstreams of the tasks owing a ``link`` (each then owes a ``notify``,
read back at once); settle the dependents of every task owing a ``notify`` from the states
just read (one command per 1,000 upstreams, however many dependents); then remove each
counter that still holds what was read. A dependent whose state changed owes a ``notify``
of its own if others wait on it: the next round takes those, so a failure cancels a whole
chain, a few commands per level. Everything is idempotent: two workers doing the same
follow-up, or one killed half way, change nothing the next one does not set right.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

from taskrunner.errors import StoreError
from taskrunner.observability.logs import get_logger
from taskrunner.store.base import FlowStore, FollowUp
from taskrunner.store.rules import FINISHED

log = get_logger("taskrunner.workflows")
SETTLE_CHUNK = 1000
"""Upstreams one settling command names at most."""
MAX_ROUNDS = 10_000
"""Rounds one call does at most (one per level of a chain being canceled or re-armed)."""

FlowCheck = Callable[[str], Awaitable[None]]
"""Called with the id of a flow one of whose steps just ended (``taskrunner.workflows.saga``)."""


async def follow_up(store: FlowStore, owed: Sequence[FollowUp], flows: FlowCheck | None = None) -> int:
    """Do the follow-ups ``owed`` and those they cause; returns how many upstreams were settled."""
    settled, pending = 0, list(owed)
    for _ in range(MAX_ROUNDS):
        if not pending:
            break
        states, pending = await _round(store, pending, flows)
        settled += len(states)
    return settled


async def _round(
    store: FlowStore, pending: list[FollowUp], flows: FlowCheck | None
) -> tuple[dict[str, str], list[FollowUp]]:
    linking = [p for p in pending if p.link is not None]
    upstreams = sorted({k for p in linking for k in p.upstreams})
    heard = {p.key: p for p in pending if p.notify is not None}
    if upstreams:
        await store.mark_upstreams(upstreams)
        heard |= {p.key: p for p in await store.follow_ups(keys=upstreams)}  # the latest read wins
    states = {key: p.state for key, p in heard.items()}
    for chunk in _chunks(states):
        await store.settle(chunk)
    failed: set[str] = set()
    if flows is not None:
        for flow in sorted({p.flow for p in heard.values() if p.flow is not None and p.state in FINISHED}):
            if not await _checked(flows, flow):
                failed.add(flow)
    # A flow whose check failed keeps its steps' notify: the next sweep checks it again.
    await store.followed_up(
        [p for p in [*linking, *heard.values()] if p.flow not in failed or p.notify is None]
    )
    return states, (await store.follow_ups(after=list(states)) if states else [])


async def _checked(flows: FlowCheck, flow: str) -> bool:
    """Run a flow's check; one that fails for another reason than the server (a bug, a
    document changed by hand) is logged and left owed, never stopping the other follow-ups."""
    try:
        await flows(flow)
    except StoreError:
        raise
    except Exception as exc:
        log.error("flow check failed; it is tried again at the next sweep", flow=flow, error=repr(exc))
        return False
    return True


def _chunks(states: Mapping[str, str]) -> Iterator[dict[str, str]]:
    items = list(states.items())
    for start in range(0, len(items), SETTLE_CHUNK):
        yield dict(items[start : start + SETTLE_CHUNK])
