"""Set expressions in linear time, as MongoDB's (``$setDifference``, ``$setUnion``, ...).

mongoeco finds repeated values by comparing each with every value kept so far, so a set
expression over n values costs n² comparisons: settling a dependent that waits on 10,000
upstreams took minutes. MongoDB hashes. Strings without a collation are equal exactly when
their values are, so a Python set finds their repeats; anything else (numbers of mixed
types, documents, a collation) takes mongoeco's own comparison.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

AppendUnique = Callable[..., None]


def linear(original: AppendUnique) -> AppendUnique:
    """``original`` (mongoeco's ``_append_unique_values``) with a hashed path for strings."""

    @functools.wraps(original)
    def append_unique_values(target: list[Any], values: list[Any], **options: Any) -> None:
        plain = options.get("collation") is None
        if plain and all(type(v) is str for v in target) and all(type(v) is str for v in values):
            seen = set(target)
            for value in values:
                if value not in seen:
                    seen.add(value)
                    target.append(value)
            return
        original(target, values, **options)

    return append_unique_values


def hashed_in(original: Callable[..., str]) -> Callable[..., str]:
    """``CompiledQuery._node_to_code`` (how a filter becomes Python) with ``$in`` over
    strings as a set lookup: mongoeco compares each value with every listed one, so a claim
    among keys, or a follow-up naming 10,000 upstreams, cost a comparison per pair. A
    string listed in ``$in`` matches exactly the equal strings (no collation here), never
    another type, null included."""
    from mongoeco.core.query_plan import InCondition

    @functools.wraps(original)
    def node_to_code(self: Any, node: Any, depth: int) -> str:
        values: Any = getattr(node, "values", None) or ()
        if (
            isinstance(node, InCondition)
            and self.collation is None
            and values
            and all(type(v) is str for v in values)
        ):
            field_key = self._field(node.field)
            values_key = self._store("values", frozenset(values))
            return (
                f"any(type(candidate) is str and candidate in {values_key}"
                f" for candidate in (_extract(doc, {field_key}) or [None]))"
            )
        return original(self, node, depth)

    return node_to_code
