"""Handlers by task name, with the params model read from each handler's annotation."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from taskrunner.errors import InvalidParams, InvalidTask, UnknownTaskName
from taskrunner.limits.gates import Limit
from taskrunner.models import NewTask, invalid_task

Handler = Callable[..., Any]


@dataclass(frozen=True)
class Registration:
    name: str
    handler: Handler
    params_model: type[BaseModel] | None
    options: dict[str, Any] = field(default_factory=dict)
    limit: Limit = field(default_factory=Limit)
    """Fleet-wide limits the code declares (``rate_limit``, ``max_running``, ``limit_by``)."""
    wants_context: bool = True
    is_async: bool = True

    def validate(self, params: Any) -> dict[str, Any]:
        """Params as a JSON-compatible dict, checked against the handler's model."""
        if self.params_model is None:
            if not isinstance(params, dict):
                raise InvalidParams("params", f"must be an object, got {type(params).__name__}")
            return params
        if isinstance(params, BaseModel) and not isinstance(params, self.params_model):
            params = params.model_dump(mode="json")
        try:
            model = (
                params if isinstance(params, self.params_model) else self.params_model.model_validate(params)
            )
        except ValidationError as exc:
            raise invalid_task(exc, "params", InvalidParams) from None
        return model.model_dump(mode="json")

    def parse(self, params: dict[str, Any]) -> Any:
        """Stored params as the handler expects them (model instance or dict)."""
        if self.params_model is None:
            return params
        try:
            return self.params_model.model_validate(params)
        except ValidationError as exc:
            raise invalid_task(exc, "params", InvalidParams) from None


def params_model_of(handler: Handler) -> type[BaseModel] | None:
    """The pydantic model annotated on the handler's first parameter, if any."""
    parameters = list(inspect.signature(handler).parameters.values())
    if not parameters:
        raise TypeError(f"handler {handler.__qualname__} must accept params (and optionally ctx)")
    hints = typing.get_type_hints(handler)
    hint = hints.get(parameters[0].name)
    return hint if isinstance(hint, type) and issubclass(hint, BaseModel) else None


class Handlers:
    """A runner's handlers by task name (``runner.handlers``)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Registration] = {}

    def add(
        self, name: str, handler: Handler, options: dict[str, Any], limit: Limit | None = None
    ) -> Registration:
        if name in self._by_name:
            raise ValueError(f"a handler is already registered for task name {name!r}")
        NewTask.build(key="-", name=name, options=options)  # fail at import time, not at publish
        arity = len(inspect.signature(handler).parameters)
        model = params_model_of(handler)
        limit = limit or Limit()
        if limit.limit_by is not None and model is not None and limit.limit_by not in model.model_fields:
            raise InvalidTask("limit_by", f"{limit.limit_by!r} is not a field of {model.__name__}")
        is_async = inspect.iscoroutinefunction(handler)
        registration = Registration(name, handler, model, options, limit, arity >= 2, is_async)
        self._by_name[name] = registration
        return registration

    def get(self, name: str) -> Registration:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownTaskName(name, self.names()) from None

    def find(self, name: str) -> Registration | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)


def plain_params(params: Any) -> dict[str, Any]:
    """Params of a name no local handler is registered for: a dict or any pydantic model."""
    if params is None:
        return {}
    if isinstance(params, BaseModel):
        return params.model_dump(mode="json")
    if not isinstance(params, dict):
        raise InvalidTask(
            "params", f"must be an object (dict or pydantic model), got {type(params).__name__}"
        )
    return params
