"""Computed fields whose value is missing are not set, as MongoDB's.

On MongoDB, ``{$set: {a: <expression>}}`` (an update pipeline, ``$addFields``) sets
nothing when the expression's value is missing, and a ``$cond`` or ``$switch`` is worth
the branch it takes: ``{$set: {a: {$cond: [<false>, 1, "$absent"]}}}`` leaves ``a``
absent, as does an ``$ifNull`` whose replacement is missing. mongoeco keeps a bare
``"$absent"`` missing but turns a branch's missing value into null, so
``taskrunner.dev.patches`` routes the field's top-level ``$cond``/``$switch``/``$ifNull``
through :func:`keeping_missing`, which evaluates the branch taken as a field of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from taskrunner.dev.wire import MONGOECO_AVAILABLE

if MONGOECO_AVAILABLE:
    from mongoeco.compat import MONGODB_DIALECT_70
    from mongoeco.core.aggregation.runtime import _MISSING

FieldEvaluator = Callable[..., Any]
_NO_BRANCH = object()


def keeping_missing(evaluate: FieldEvaluator) -> FieldEvaluator:
    """``evaluate`` (a field's value, or mongoeco's missing marker) for a ``$cond``,
    ``$switch`` or ``$ifNull``: the value of the branch taken, evaluated the same way, so it
    may be missing."""

    def field_value(document: Any, expression: object, variables: Any = None, *, dialect: Any = None) -> Any:
        dialect = dialect or MONGODB_DIALECT_70

        def value_of(operand: object) -> Any:
            return evaluate(document, operand, variables, dialect=dialect)

        def truthy(condition: object) -> bool:
            value = value_of(condition)
            return bool(dialect.expression_truthy(None if value is _MISSING else value))

        branch = _branch(expression, truthy, value_of)
        if branch is _NO_BRANCH:
            return evaluate(document, expression, variables, dialect=dialect)
        return field_value(document, branch, variables, dialect=dialect)

    return field_value


def _branch(
    expression: object, truthy: Callable[[object], bool], value_of: Callable[[object], Any]
) -> object:
    """The branch a well-formed ``$cond``, ``$switch`` or ``$ifNull`` takes (an ``$ifNull``
    input that has a value, as a literal); ``_NO_BRANCH`` for anything else (including a
    malformed one, which mongoeco then rejects with its own error)."""
    if not isinstance(expression, dict) or len(expression) != 1:
        return _NO_BRANCH
    [(operator, spec)] = expression.items()
    if operator == "$ifNull" and isinstance(spec, list) and len(spec) >= 2:
        for operand in spec[:-1]:
            value = value_of(operand)
            if value is not None and value is not _MISSING:
                return {"$literal": value}
        return spec[-1]
    if operator == "$cond":
        if isinstance(spec, list) and len(spec) == 3:
            return spec[1] if truthy(spec[0]) else spec[2]
        if isinstance(spec, dict) and set(spec) == {"if", "then", "else"}:
            return spec["then"] if truthy(spec["if"]) else spec["else"]
    if operator == "$switch" and isinstance(spec, dict) and isinstance(spec.get("branches"), list):
        branches = spec["branches"]
        if branches and all(isinstance(b, dict) and {"case", "then"} <= set(b) for b in branches):
            for case in branches:
                if truthy(case["case"]):
                    return case["then"]
            if "default" in spec:
                return spec["default"]
    return _NO_BRANCH
