"""``$unionWith`` that filters before it copies, as MongoDB's runs its sub-pipeline's
leading ``$match`` through the collection's indexes.

mongoeco deep-copies every document of the collection, then runs the sub-pipeline: a
worker's sweep (``Store.due``, one ``$unionWith`` per group of names) cost a copy of the
whole collection per branch, and 10,000 tasks waiting in a flow stalled every sweep for
minutes. Matching first and copying only what matched gives the same documents: a
``$match`` changes none, and the sub-pipeline (its ``$match`` included) still runs whole on
the copies. Only the collection the union names is narrowed; what the sub-pipeline itself
looks up is resolved as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

ApplyUnion = Callable[..., list[Any]]


def matched_first(original: ApplyUnion, apply_match: Callable[..., list[Any]]) -> ApplyUnion:
    """``original`` (mongoeco's ``_apply_union_with``) narrowing the union's collection by
    its sub-pipeline's leading ``$match`` (``apply_match``: mongoeco's ``$match``)."""

    @functools.wraps(original)
    def apply_union_with(
        documents: list[Any], spec: Any, collection_resolver: Any, variables: Any = None, **options: Any
    ) -> list[Any]:
        pipeline = spec.get("pipeline") if isinstance(spec, dict) else None
        first = pipeline[0] if isinstance(pipeline, list) and pipeline else None
        if collection_resolver is None or not (isinstance(first, dict) and list(first) == ["$match"]):
            return original(documents, spec, collection_resolver, variables, **options)
        match = functools.partial(
            apply_match,
            spec=first["$match"],
            variables=variables,
            dialect=options.get("dialect"),
            collation=options.get("collation"),
        )
        return original(documents, spec, _Narrowed(collection_resolver, match), variables, **options)

    return apply_union_with


class _Narrowed:
    """A collection resolver whose first answer (the union's own collection) is matched
    first; later answers (lookups inside the sub-pipeline) and attributes are the original's."""

    def __init__(self, resolver: Any, match: Callable[..., list[Any]]) -> None:
        self._resolver, self._match, self._first = resolver, match, True

    def __call__(self, key: Any) -> Any:
        found = self._resolver(key)
        if not self._first or found is None:
            return found
        self._first = False
        return self._match(documents=list(found))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._resolver, name)
