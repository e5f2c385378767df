"""Type bracketing for the embedded server's query language, as MongoDB's.

On MongoDB a query-language comparison (``$lt``, ``$lte``, ``$gt``, ``$gte`` in ``find``,
``$match``, update and delete filters, change-stream ``$match``) matches only values of the
bound's BSON type bracket: ``{f: {$lte: <date>}}`` matches dates, not null, numbers or
strings (numbers of every width share one bracket, null and missing another).  The
exceptions are MongoDB's: a null bound matches null and missing fields with ``$lte``/``$gte``,
a ``MaxKey`` bound matches everything with ``$lt``/``$lte`` and a ``MinKey`` bound
everything with ``$gt``/``$gte``, NaN is below nothing and above nothing.  An array field
matches when one of its elements does.  Aggregation ``$expr`` comparisons still compare
across types by the BSON order.

mongoeco compares across types by the BSON order everywhere, so ``taskrunner.dev.patches``
wraps its query matcher's comparison functions with the functions written here
(process-wide, once: only the embedded server uses mongoeco in a taskrunner process).
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Callable
from typing import Any

from taskrunner.dev.wire import MONGOECO_AVAILABLE

if MONGOECO_AVAILABLE:
    from bson.max_key import MaxKey
    from bson.min_key import MinKey
    from mongoeco._types import Decimal128, ObjectId, UndefinedType, is_object_id_like
    from mongoeco.compat import MONGODB_DIALECT_70
    from mongoeco.core.bson_scalars import unwrap_bson_numeric
    from mongoeco.core.query_plan import (
        GreaterThanCondition,
        GreaterThanOrEqualCondition,
        LessThanCondition,
        LessThanOrEqualCondition,
    )

_OPERATORS = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<=", ">": ">", ">=": ">=", "<": "<", "<=": "<="}
_INCLUSIVE = {">=", "<="}

Comparison = Callable[..., bool]


def _bracket(value: Any) -> int:
    """The BSON type bracket of ``value`` (null and undefined share one, as do all numbers)."""
    order = MONGODB_DIALECT_70.bson_type_order
    rank = order.get(type(value))
    if rank is None and is_object_id_like(value):
        rank = order[ObjectId]
    if rank is None:
        rank = order.get(type(unwrap_bson_numeric(value)))
    if rank is None:
        rank = next((kind_rank for kind, kind_rank in order.items() if isinstance(value, kind)), 100)
    return int(rank)


def _is_nan(value: Any) -> bool:
    value = unwrap_bson_numeric(value)
    if isinstance(value, Decimal128):
        value = value.to_decimal()
    if isinstance(value, float):
        return math.isnan(value)
    return isinstance(value, decimal.Decimal) and value.is_nan()


def _across_brackets(target: Any, operator: str) -> bool:
    """A comparison between different brackets: only MinKey and MaxKey bounds match."""
    if isinstance(target, MaxKey):
        return operator in ("<", "<=")
    if isinstance(target, MinKey):
        return operator in (">", ">=")
    return False


def _missing_matches(target: Any, operator: str) -> bool:
    """A missing field compares as null: equal to a null bound, below MaxKey, above MinKey."""
    op = _OPERATORS[operator]
    if target is None or isinstance(target, UndefinedType):
        return op in _INCLUSIVE
    return _across_brackets(target, op)


def bracketed(compare: Comparison) -> Comparison:
    """One candidate value against the bound: different brackets never match, bar MinKey/MaxKey."""

    def comparison(cls: Any, candidate: Any, target: Any, operator: str, /, **options: Any) -> bool:
        op = _OPERATORS[operator]
        if _bracket(candidate) != _bracket(target):
            return _across_brackets(target, op)
        if _is_nan(candidate) or _is_nan(target):
            return op in _INCLUSIVE and _is_nan(candidate) and _is_nan(target)
        return bool(compare(cls, candidate, target, operator, **options))

    return comparison


def top_level_missing(compare: Comparison) -> Comparison:
    """A top-level field: mongoeco never matches a missing one; MongoDB compares it as null."""

    def comparison(cls: Any, doc: Any, field: str, target: Any, operator: str, /, **options: Any) -> bool:
        if field not in doc:
            return _missing_matches(target, operator)
        return bool(compare(cls, doc, field, target, operator, **options))

    return comparison


def path_missing(compare: Comparison) -> Comparison:
    """A dotted path: likewise, a path that reaches no value compares as null."""

    def comparison(cls: Any, doc: Any, field: str, target: Any, operator: str, /, **options: Any) -> bool:
        if "." in field and not cls._extract_values(doc, field):
            return _missing_matches(target, operator)
        return bool(compare(cls, doc, field, target, operator, **options))

    return comparison


def through_the_plan(inline: Callable[..., str]) -> Callable[..., str]:
    """Compiled matchers compare dotted paths inline with the unbracketed BSON comparison;
    have them evaluate such a comparison as the query plan does (through the functions above)."""
    conditions = {
        ">": GreaterThanCondition,
        ">=": GreaterThanOrEqualCondition,
        "<": LessThanCondition,
        "<=": LessThanOrEqualCondition,
    }

    def comparison_code(self: Any, field: str, value: Any, operator: str) -> str:
        if "." not in field:
            return str(inline(self, field, value, operator))
        node = self._store("node", conditions[operator](field, value))
        return f"match_plan(doc, {node}, dialect=dialect, collation=collation, variables=variables)"

    return comparison_code
