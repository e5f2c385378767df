"""Flow control by task name, stored in ``<collection>.limits`` (docs/limits.md).

One document per task name (``_id`` is the name; ``"*"`` stands for every name)::

    {_id: "send_email", paused: true, paused_at: ISODate(...), updated_at: ISODate(...)}

Operators write them (``taskrunner pause NAME``, ``runner.pause(...)``, or the mongo
shell); every worker reads its names' documents again whenever the collection's change
stream says something changed (``LimitWatch``), so a change applies fleet-wide within a
second, without a leader. A paused name is not
claimed (its queued tasks are dropped, sweeps and claims leave it out); running
tasks finish and publishing goes on. Resuming sweeps at once for the backlog.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from taskrunner.errors import InvalidTask
from taskrunner.limits.gates import Limit, check_max_running, parse_rate
from taskrunner.models import Unreadable, UtcDatetime, first_error
from taskrunner.observability.logs import get_logger

log = get_logger("taskrunner.limits")
ALL = "*"
"""The ``_id`` whose document pauses every task name (``taskrunner pause --all``)."""


class GateThrottle(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    gate: str
    until: UtcDatetime


class LimitState(BaseModel):
    """One stored document of ``<collection>.limits``."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)

    name: str = Field(alias="_id")
    paused: bool = False
    paused_at: UtcDatetime | None = None
    resumed_at: UtcDatetime | None = None
    updated_at: UtcDatetime | None = None
    throttled_until: UtcDatetime | None = None
    """Set when a handler raised ``RateLimited``: no task of the name starts before it."""
    throttled_gates: list[GateThrottle] = Field(default_factory=list)
    """``RateLimited`` of a name with ``limit_by``: that value's gate only."""
    rate_limit: str | None = None
    """An operator's rate (``taskrunner limit NAME --rate 10/s``); wins over the code's.
    Present but null: no rate, whatever the code says."""
    max_running: int | None = None
    """An operator's ``max_running``, as ``rate_limit``."""
    declared: dict[str, Any] = Field(default_factory=dict)
    """The limits the app's code declares, as its workers last wrote them (for operators)."""

    @field_validator("rate_limit")
    @classmethod
    def _rate(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_rate(value)
            except InvalidTask as exc:
                raise ValueError(exc.message) from None
        return value

    @field_validator("max_running")
    @classmethod
    def _max_running(cls, value: int | None) -> int | None:
        try:
            return check_max_running(value) if value is not None else None
        except InvalidTask as exc:
            raise ValueError(exc.message) from None

    def limit(self, code: Limit) -> Limit:
        """The limits in force: an operator's where set (null lifts one), else the code's."""
        chosen = self.model_fields_set
        rate = code.rate
        if "rate_limit" in chosen:
            rate = parse_rate(self.rate_limit) if self.rate_limit is not None else None
        running = self.max_running if "max_running" in chosen else code.max_running
        return Limit(rate, running, code.limit_by)

    @classmethod
    def read(cls, doc: dict[str, Any]) -> LimitState | Unreadable:
        """The document as a model, or what is wrong with it (a hand edit)."""
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            return Unreadable.of(doc, first_error(exc))


@dataclass(frozen=True, slots=True)
class LimitView:
    """A task name's limits as operators see them (``runner.limits(name)``, ``taskrunner
    limit NAME``)."""

    name: str
    in_force: Limit
    """What a worker of this app applies: operators' limits over the code's."""
    stored: LimitState | None
    """The stored limits document (pause, operators' limits, throttles); None when there is none."""


def readable_limit(doc: dict[str, Any]) -> LimitState:
    """A document just written, as a model; a hand-broken field makes it an ``InvalidTask``."""
    state = LimitState.read(doc)
    if isinstance(state, Unreadable):
        raise InvalidTask(f"limits.{doc.get('_id')}", f"the stored document is unreadable: {state}")
    return state


def paused_names(
    states: Mapping[str, LimitState | Unreadable], names: Sequence[str], now: datetime
) -> frozenset[str]:
    """Which of ``names`` are not claimed now: paused, by their own document or by ``"*"``,
    or throttled until after ``now`` (server time). An unreadable document pauses nothing:
    a hand edit gone wrong must not stop the fleet."""
    every = states.get(ALL)
    if isinstance(every, LimitState) and every.paused:
        return frozenset(names)

    def held(state: LimitState | Unreadable | None) -> bool:
        if not isinstance(state, LimitState):
            return False
        return state.paused or (state.throttled_until is not None and state.throttled_until > now)

    return frozenset(n for n in names if held(states.get(n)))


def limits_in_force(
    states: Mapping[str, LimitState | Unreadable], names: Sequence[str], declared: Mapping[str, Limit]
) -> dict[str, Limit]:
    """Each limited name's limits: operators' over the code's (an unreadable document
    changes nothing)."""
    limits = {}
    for name in names:
        code, state = declared.get(name, Limit()), states.get(name)
        limit = state.limit(code) if isinstance(state, LimitState) else code
        if limit:
            limits[name] = limit
    return limits
