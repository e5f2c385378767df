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
