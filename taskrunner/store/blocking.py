"""PyMongo's synchronous client behind the async API ``MongoStore`` is written against.

``SyncTaskRunner`` publishes in the application's own ``pymongo.MongoClient`` sessions
(``session=``): a session belongs to the client that started it, and an async client cannot
use a sync one's. ``MongoStore``'s logic is written once, against PyMongo's async API; these
wrappers run each call on the sync client instead, blocking, so a ``MongoStore`` over them is
the same store, run in the caller's thread (``SyncTaskRunner`` drives it on a loop of that
thread's own). Nothing here awaits anything real: each coroutine finishes in one step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from pymongo import MongoClient
from pymongo.synchronous.collection import Collection
from pymongo.synchronous.database import Database


class BlockingCursor:
    """A sync cursor as an async one: ``sort``/``limit`` chain, ``to_list`` and ``async for``."""

    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    def sort(self, *args: Any, **kwargs: Any) -> BlockingCursor:
        return BlockingCursor(self._cursor.sort(*args, **kwargs))

    def limit(self, limit: int) -> BlockingCursor:
        return BlockingCursor(self._cursor.limit(limit))

    async def to_list(self, length: int | None = None) -> list[Any]:
        return list(self._cursor.to_list(length))

    def __aiter__(self) -> AsyncIterator[Any]:
        return _iterate(iter(self._cursor))


async def _iterate(items: Iterator[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


class BlockingCollection:
    """A sync ``Collection`` with ``AsyncCollection``'s call shapes."""

    def __init__(self, collection: Collection[Any]) -> None:
        self._collection = collection
        self.name = collection.name

    @property
    def database(self) -> BlockingDatabase:
        return BlockingDatabase(self._collection.database)

    def find(self, *args: Any, **kwargs: Any) -> BlockingCursor:
        return BlockingCursor(self._collection.find(*args, **kwargs))

    async def aggregate(self, *args: Any, **kwargs: Any) -> BlockingCursor:
        return BlockingCursor(self._collection.aggregate(*args, **kwargs))

    async def watch(self, *args: Any, **kwargs: Any) -> Blocking:
        return Blocking(self._collection.watch(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(Blocking(self._collection), name)


class Blocking:
    """Any sync object with its methods as coroutines (a change stream, a collection's
    writes); other attributes read through."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value

        async def call(*args: Any, **kwargs: Any) -> Any:
            return value(*args, **kwargs)

        return call


class BlockingDatabase:
    """A sync ``Database`` with ``AsyncDatabase``'s call shapes."""

    def __init__(self, database: Database[Any]) -> None:
        self._database = database
        self.name = database.name

    def __getitem__(self, name: str) -> BlockingCollection:
        return BlockingCollection(self._database[name])

    def get_collection(self, name: str, **kwargs: Any) -> BlockingCollection:
        return BlockingCollection(self._database.get_collection(name, **kwargs))

    async def command(self, *args: Any, **kwargs: Any) -> Any:
        return self._database.command(*args, **kwargs)

    async def create_collection(self, *args: Any, **kwargs: Any) -> BlockingCollection:
        return BlockingCollection(self._database.create_collection(*args, **kwargs))

    async def list_collections(self, *args: Any, **kwargs: Any) -> BlockingCursor:
        return BlockingCursor(self._database.list_collections(*args, **kwargs))


class BlockingClient:
    """The application's ``MongoClient`` with ``AsyncMongoClient``'s call shapes; ``close``
    leaves it open (the application owns it)."""

    def __init__(self, client: MongoClient[Any]) -> None:
        self._client = client

    def get_database(self, name: str, **kwargs: Any) -> BlockingDatabase:
        return BlockingDatabase(self._client.get_database(name, **kwargs))

    @property
    def admin(self) -> BlockingDatabase:
        return BlockingDatabase(self._client.admin)

    async def close(self) -> None:
        return None
