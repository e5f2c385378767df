"""``MongoStore``: the task store on MongoDB through PyMongo's native async API.

Claims, pings and finishes are single ``find_one_and_update`` calls whose filter
re-checks ownership on the server and whose pipeline uses ``$$NOW``. PyMongo's
exceptions are translated to ``taskrunner.errors`` here and nowhere else.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, ClassVar, cast

import bson
from bson.codec_options import CodecOptions, DatetimeConversion
from bson.raw_bson import RawBSONDocument
from pymongo import (
    AsyncMongoClient,
    MongoClient,
    ReadPreference,
    ReturnDocument,
    UpdateMany,
    UpdateOne,
    monitoring,
)
from pymongo import errors as pe
from pymongo.asynchronous.change_stream import AsyncChangeStream
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.asynchronous.collection import AsyncCollection

from taskrunner.errors import (
    ChangeHistoryLost,
    ChangeStreamEnded,
    ChangeStreamsUnsupported,
    ClaimLost,
    ClaimUnconfirmed,
    DocumentTooLarge,
    DuplicateKey,
    InvalidSchedule,
    InvalidState,
    InvalidTask,
    MalformedTask,
    PartialBulkWrite,
    ScheduleNotFound,
    ServerTooOld,
    StoreError,
    StoreUnavailable,
    TaskNotFound,
    WriteRejected,
)
from taskrunner.limits.state import LimitState, readable_limit
from taskrunner.models import (
    EntryState,
    NewTask,
    PinnedAway,
    Task,
    TaskError,
    TaskState,
    TaskStats,
    Unreadable,
    WorkerInfo,
)
from taskrunner.observability.redact import redact
from taskrunner.schedules.model import Schedule, ScheduleState
from taskrunner.store import expressions as x
from taskrunner.store import fields as f
from taskrunner.store import rules
from taskrunner.store.base import (
    ChangeEvent,
    ChangeStream,
    Claim,
    Claimed,
    EventKind,
    Failure,
    FollowUp,
    Listed,
    Listing,
    Page,
    RunResult,
    RunStatus,
    RunWrite,
    Session,
    Window,
    counters_read,
    due_page,
    follow_up_of,
    in_transaction,
    page_of,
)
from taskrunner.store.preflight import MINIMUM_TEXT, WHY_MINIMUM, ServerInfo, read_server, too_old
from taskrunner.store.validator import json_schema

Doc = dict[str, Any]
# Dates out of Python's range (before year 1 or after 9999, which other languages write)
# decode as bson.DatetimeMS instead of failing the whole reply: the document then reads
# with a problem naming the field and its key, like any malformed one. Clamping them
# instead would show a wrong date as if it were valid.
CODEC: CodecOptions[Doc] = CodecOptions(
    tz_aware=True, tzinfo=UTC, datetime_conversion=DatetimeConversion.DATETIME_AUTO
)
RAW: CodecOptions[RawBSONDocument] = CodecOptions(document_class=RawBSONDocument)
LENIENT = CODEC.with_options(unicode_decode_error_handler="replace")
CLAIM_SORT = [(f.PRIORITY, -1), (f.CREATED_AT, 1), (f.ID, 1)]
_HISTORY_LOST = {280, 286}  # ChangeStreamFatalError, ChangeStreamHistoryLost
_INVALID_RESUME_TOKEN = 260  # e.g. resuming after an invalidate: only a new stream can follow on
_DOCUMENT_INVALID = 121
# A write that would make a document larger than 16 MiB, as each server answers it
# (MongoDB's source and jstests/core/max_doc_size.js, docs/compatibility.md): through 8.0 an
# insert is BadValue (2), told apart from other BadValues by its message, an update's result
# 17419 (8375908 on another update path), an upsert's new document 17420; servers built
# after SERVER-104405 (not 8.0) answer BSONObjectTooLarge (10334) for all three, the code
# every version gives a command or an object too large to build.
_TOO_LARGE = {10334, 17419, 17420, 8375908}
_INSERT_TOO_LARGE = (2, "object to insert too large")
_DUPLICATE_KEY = 11000
_NO_CHANGE_STREAMS = 40573  # "only supported on replica sets"
_COMMAND_NOT_FOUND = 59
_AWAIT_MS = 500  # one getMore waits this long for changes
_WORK_AWAIT_MS = 5000  # ... and on a worker's (filtered) stream


_TRANSACTION_LABELS = ("TransientTransactionError", "UnknownTransactionCommitResult")


@contextmanager
def mapped_errors() -> Iterator[None]:
    """Translate PyMongo errors into taskrunner's (the store boundary). An error labelled
    for a transaction's retry passes unchanged: the caller's ``with_transaction`` (or its own
    loop) reads the label and runs the transaction again."""
    try:
        yield
    except (pe.PyMongoError, bson.errors.BSONError) as exc:
        if isinstance(exc, pe.PyMongoError) and any(map(exc.has_error_label, _TRANSACTION_LABELS)):
            raise
        _raise_mapped(exc)


def _raise_mapped(error: Exception) -> None:
    """Raise ``error`` (PyMongo's or BSON's) as taskrunner's exception."""
    try:
        raise error
    except (
        pe.ConnectionFailure,
        pe.ServerSelectionTimeoutError,
        pe.NetworkTimeout,
        pe.ExecutionTimeout,
        pe.WTimeoutError,
    ) as exc:
        # The topology description PyMongo appends is long and says nothing new.
        reason = str(exc).split(" (configured timeouts")[0].split(", Timeout:")[0]
        raise StoreUnavailable(f"MongoDB unavailable: {redact(reason)}") from exc
    except bson.errors.InvalidBSON as exc:  # task documents are decoded one by one (_decode)
        raise StoreError(
            f"a document the server returned does not decode as BSON: {redact(str(exc))}"
        ) from exc
    except pe.DocumentTooLarge as exc:  # the driver's own check, before sending
        raise DocumentTooLarge(_too_large(str(exc))) from exc
    except bson.errors.InvalidDocument as exc:
        raise InvalidTask("task", redact(str(exc))) from exc
    except pe.DuplicateKeyError as exc:
        raise DuplicateKey(redact(str(exc))) from exc
    except pe.BulkWriteError as exc:
        errors = {e["index"]: _write_error(e) for e in exc.details.get("writeErrors", [])}
        raise PartialBulkWrite(redact(str(exc)), exc.details.get("nMatched", 0), errors) from exc
    except pe.OperationFailure as exc:
        if exc.code == _NO_CHANGE_STREAMS:
            raise ChangeStreamsUnsupported(redact(str(exc))) from exc
        if exc.code in _HISTORY_LOST:
            raise ChangeHistoryLost(redact(str(exc))) from exc
        if exc.code == _INVALID_RESUME_TOKEN:
            message = "the change stream cannot resume from its token (after an invalidate, open a new one)"
            raise ChangeHistoryLost(f"{message}: {redact(str(exc))}") from exc
        if exc.code == _DOCUMENT_INVALID:
            raise WriteRejected(f"the collection's validator rejected the write: {exc}") from exc
        if _is_too_large(exc.code, str(exc)):
            raise DocumentTooLarge(_too_large(str(exc))) from exc
        raise StoreError(redact(str(exc))) from exc
    except pe.PyMongoError as exc:
        raise StoreError(redact(str(exc))) from exc


def _driver(session: Session | None) -> AsyncClientSession | None:
    """``session`` as the collection's methods are typed: a ``ClientSession`` only ever
    reaches the sync client's collections (``on_sync_client``), which take it."""
    return cast("AsyncClientSession | None", session)


def _code(exc: BaseException) -> int | None:
    """The server's error code behind a mapped error, if it gave one."""
    cause = exc.__cause__
    return cause.code if isinstance(cause, pe.OperationFailure) else None


def _decode(raw: Mapping[str, Any]) -> Doc:
    """A raw task document as a dict. One that does not decode (a string that is not UTF-8,
    as another language's driver may write) is decoded leniently, its key readable, and
    marked so that it reads as a malformed task (``fields.UNDECODABLE``)."""
    data = raw.raw if isinstance(raw, RawBSONDocument) else bson.encode(raw)
    try:
        return bson.decode(data, CODEC)
    except bson.errors.InvalidBSON as exc:
        doc: Doc = bson.decode(data, LENIENT)
        doc[f.UNDECODABLE] = f"the document does not decode as BSON ({redact(str(exc))})"
        return doc


def _decoded(raw: Mapping[str, Any] | None) -> Doc | None:
    return None if raw is None else _decode(raw)


def _is_too_large(code: object, message: str) -> bool:
    """Whether a server error says a document would exceed 16 MiB (``_TOO_LARGE``)."""
    return code in _TOO_LARGE or (code == _INSERT_TOO_LARGE[0] and _INSERT_TOO_LARGE[1] in message)


def _too_large(message: str) -> str:
    return f"the document would exceed MongoDB's 16 MiB limit: {redact(message)}"


def _write_error(error: Doc) -> StoreError:
    """One write's error in a bulk write, as taskrunner's exception."""
    message = redact(str(error.get("errmsg", error)))
    if error.get("code") == _DOCUMENT_INVALID:
        return WriteRejected(f"the collection's validator rejected the write: {message}")
    if _is_too_large(error.get("code"), message):
        return DocumentTooLarge(_too_large(message))
    if error.get("code") == _DUPLICATE_KEY:
        return DuplicateKey(message)
    return StoreError(message)


class MongoStore:
    """A ``Store`` on one MongoDB collection."""

    bound_to_loop: ClassVar[bool] = True

    def __init__(
        self, client: AsyncMongoClient[Doc], database: str, collection: str, *, owns_client: bool = False
    ) -> None:
        self.client = client
        # Every read follows this process's own writes (a claim's read-back, get after
        # publish, a gate after its update): on the primary, whatever the URI's
        # readPreference says, since a secondary may not have applied them yet.
        db = client.get_database(database, read_preference=ReadPreference.PRIMARY, codec_options=CODEC)
        self.collection: AsyncCollection[Doc] = db[collection]
        # Task documents are read raw and decoded one by one (``_decode``): one that does not
        # decode is read leniently and named, instead of failing the whole reply.
        self._raw = cast("AsyncCollection[RawBSONDocument]", db.get_collection(collection, codec_options=RAW))
        self.registry: AsyncCollection[Doc] = db[f"{collection}.{f.REGISTRY_SUFFIX}"]
        self.schedule_docs: AsyncCollection[Doc] = db[f"{collection}.{f.SCHEDULES_SUFFIX}"]
        self.limit_docs: AsyncCollection[Doc] = db[f"{collection}.{f.LIMITS_SUFFIX}"]
        self.gate_docs: AsyncCollection[Doc] = db[f"{collection}.{f.GATES_SUFFIX}"]
        self._owns_client = owns_client

    @classmethod
    def connect(
        cls,
        uri: str,
        *,
        database: str = f.DEFAULT_DATABASE,
        collection: str = f.DEFAULT_COLLECTION,
        timeout: float = 10.0,
        event_listeners: Sequence[monitoring.CommandListener] | None = None,
    ) -> MongoStore:
        """A store on its own client; ``timeout`` bounds server selection and connects.

        ``event_listeners`` (opt-in) are PyMongo monitoring listeners, e.g.
        ``taskrunner.observability.roundtrips.RoundTripCounter``.
        """
        extra: dict[str, Any] = {"event_listeners": list(event_listeners)} if event_listeners else {}
        try:
            client: AsyncMongoClient[Doc] = AsyncMongoClient(
                uri,
                tz_aware=True,
                appname="taskrunner",
                datetime_conversion=DatetimeConversion.DATETIME_AUTO,
                serverSelectionTimeoutMS=int(timeout * 1000),
                connectTimeoutMS=int(timeout * 1000),
                **extra,
            )
        except (pe.ConfigurationError, ValueError, TypeError) as exc:
            raise StoreError(f"bad MongoDB URI {redact(uri)!r}: {redact(str(exc))}") from None
        return cls(client, database, collection, owns_client=True)

    @classmethod
    def on_sync_client(cls, client: MongoClient[Any], database: str, collection: str) -> MongoStore:
        """A store on the application's sync ``MongoClient``, whose sessions it can join; its
        calls block (``taskrunner.store.blocking``) and it never closes the client."""
        from taskrunner.store.blocking import BlockingClient

        # The wrapper has the async client's call shapes: the store's code is the same.
        return cls(cast("AsyncMongoClient[Doc]", BlockingClient(client)), database, collection)

    async def init(
        self,
        *,
        validator: bool = False,
        retain_finished: float | None = None,
        retain_failed: float | None = None,
    ) -> None:
        with mapped_errors():
            db = self.collection.database
            found = [c async for c in await db.list_collections(filter={"name": self.collection.name})]
            schema = json_schema() if validator else None
            if not found:
                await self._create(schema)
            elif schema is not None and found[0].get("options", {}).get("validator") != schema:
                await db.command(
                    "collMod", self.collection.name, validator=schema, validationLevel="moderate"
                )
            for name, (keys, options) in f.INDEXES.items():
                await self.collection.create_index(keys, name=name, **options)
            for name, (keys, options) in f.REGISTRY_INDEXES.items():
                await self.registry.create_index(keys, name=name, **options)
            if retain_finished is not None or retain_failed is not None:
                await self._retention(retain_finished, retain_failed)

    async def _retention(self, finished: float | None, failed: float | None) -> None:
        """Install, change (drop and recreate) or, for 0, remove the TTL indexes; None keeps
        what is installed. With a failed retention, finished_ttl keeps to SUCCESS."""
        indexes = await self.collection.index_information()
        finished = _ttl(indexes, f.RETENTION_INDEX) if finished is None else int(finished)
        failed = _ttl(indexes, f.FAILED_RETENTION_INDEX) if failed is None else int(failed)
        wanted: dict[str, tuple[list[tuple[str, int]], Doc] | None] = {
            f.RETENTION_INDEX: _ttl_spec(1, finished, f.SUCCEEDED if failed else None),
            f.FAILED_RETENTION_INDEX: _ttl_spec(-1, failed, f.UNSUCCESSFUL),
        }
        for name, spec in wanted.items():
            have = indexes.get(name)
            if have is not None and spec is not None and _same_ttl(have, spec[1]):
                continue
            if have is not None:
                await self.collection.drop_index(name)
            if spec is not None:
                await self.collection.create_index(spec[0], name=name, **spec[1])

    async def _create(self, schema: Doc | None) -> None:
        extra: dict[str, Any] = {} if schema is None else {"validator": schema, "validationLevel": "moderate"}
        with suppress(pe.CollectionInvalid):  # created concurrently: init is idempotent
            await self.collection.database.create_collection(self.collection.name, **extra)

    async def publish(
        self,
        tasks: Sequence[NewTask],
        *,
        update_pending: bool = False,
        republish_finished: bool = False,
        session: Session | None = None,
    ) -> list[Task]:
        publish_id = uuid.uuid4().hex
        ops = [self._publish_op(t, publish_id, update_pending, republish_finished) for t in tasks]
        if len(ops) == 1:
            filter_, update = ops[0]
            doc = await self._publish_single(filter_, update, session)
            return [self._task(doc, created=doc.get(f.PUBLISH_ID) == publish_id)]
        await self._publish_bulk(ops, session)
        with mapped_errors():
            found = await self._raw.find(
                {f.KEY: {"$in": [t.key for t in tasks]}}, session=_driver(session)
            ).to_list()
        docs = {d.get(f.KEY): d for d in map(_decode, found)}
        return [self._task(docs[t.key], created=docs[t.key].get(f.PUBLISH_ID) == publish_id) for t in tasks]

    def _publish_op(
        self, task: NewTask, publish_id: str, update_pending: bool, republish_finished: bool
    ) -> tuple[Doc, list[Any]]:
        new = {f.ID: bson.ObjectId(), **rules.new_document(task, publish_id)}
        run_at = x.start_time(task.run_at, task.delay)
        changes = rules.pending_changes(task) if update_pending else None
        update = x.publish(new, run_at, update=changes, republish_finished=republish_finished)
        return {f.KEY: task.key}, update

    async def _publish_bulk(self, ops: list[tuple[Doc, list[Any]]], session: Session | None) -> None:
        if not ops:
            return
        try:
            with mapped_errors():
                await self.collection.bulk_write(
                    [UpdateOne(q, u, upsert=True) for q, u in ops], ordered=False, session=_driver(session)
                )
        except PartialBulkWrite as exc:
            # A racing publisher inserted some keys first: those tasks exist, which is the goal.
            # Not in a transaction: any error there aborted it (the caller runs it again).
            if in_transaction(session) or not all(isinstance(e, DuplicateKey) for e in exc.errors.values()):
                raise

    async def _publish_single(self, filter_: Doc, update: list[Any], session: Session | None) -> Doc:
        for _ in range(3):
            try:
                with mapped_errors():
                    doc = _decoded(
                        await self._raw.find_one_and_update(
                            filter_,
                            update,
                            upsert=True,
                            return_document=ReturnDocument.AFTER,
                            session=_driver(session),
                        )
                    )
                    assert doc is not None, "an upsert always returns a document"
                    return doc
            except DuplicateKey:
                if in_transaction(session):
                    raise  # the transaction is aborted: only running it again can publish
                continue  # two racing upserts of one key: one inserts, the other hits the unique index
        raise StoreError(f"publish of {filter_[f.KEY]!r} kept colliding with concurrent publishers")

    async def get(self, key: str, *, session: Session | None = None) -> Task:
        with mapped_errors():
            doc = _decoded(await self._raw.find_one({f.KEY: key}, session=_driver(session)))
        if doc is None:
            raise TaskNotFound(key)
        return self._task(doc)

    async def find(
        self,
        *,
        state: TaskState | None = None,
        name: str | None = None,
        worker_id: str | None = None,
        limit: int = 0,
    ) -> list[Task]:
        query = self._query(state, name)
        if worker_id is not None:
            query[f"{f.WORKERS}.{f.WORKER_ID}"] = worker_id
        with mapped_errors():
            found = await self._raw.find(query).sort([(f.CREATED_AT, 1), (f.ID, 1)]).limit(limit).to_list()
        return [self._task(_decode(doc)) for doc in found]

    async def count(self, *, state: TaskState | None = None, name: str | None = None) -> int:
        with mapped_errors():
            return await self.collection.count_documents(self._query(state, name))

    async def browse(self, listing: Listing) -> Listed:
        order = [(listing.sort, -1), (f.KEY, -1)]
        dated, undated = _listing_queries(listing)
        found: list[Doc] = []
        with mapped_errors():
            if dated is not None:
                cursor = self._raw.find(dated).sort(order).limit(listing.limit)
                found = list(map(_decode, await cursor.to_list()))
            if len(found) < listing.limit:  # the dates are done: the rest, by key
                cursor = self._raw.find(undated).sort(f.KEY, -1).limit(listing.limit - len(found))
                found += map(_decode, await cursor.to_list())
        return listed(found, listing)

    @staticmethod
    def _query(state: TaskState | None, name: str | None) -> Doc:
        query: Doc = {}
        if state is not None:
            query[f.STATE] = state.value
        if name is not None:
            query[f.NAME] = name
        return query

    async def candidates(self, *, after: str | None = None, limit: int = 500) -> Page:
        query: Doc = {f.STATE: {"$in": list(rules.ACTIVE)}}
        if after is not None:
            query[f.KEY] = {"$gt": after}
        with mapped_errors():
            docs = await self._raw.find(query).sort(f.KEY, 1).limit(limit).to_list()
        return page_of(list(map(_decode, docs)), limit)

    async def due(
        self,
        worker_id: str,
        names: Sequence[str],
        *,
        horizon: datetime,
        limit: int = 100,
        apart: Sequence[str] = (),
    ) -> Page:
        pipeline = x.due_pipeline(self.collection.name, worker_id, list(names), horizon, limit, apart)
        with mapped_errors():
            docs = await (await self._raw.aggregate(pipeline)).to_list()
        return due_page(list(map(_decode, docs)), limit, apart)

    async def claim(
        self,
        worker_id: str,
        *,
        key: str | None = None,
        names: Sequence[str] | None = None,
        fresh: bool = False,
        window: Window | None = None,
        keys: Sequence[str] | None = None,
    ) -> Claim | None:
        scope: Doc = {}
        among = [key] if key is not None else None if keys is None else list(keys)
        if key is not None:
            scope[f.KEY] = key
        elif among is not None:
            scope[f.KEY] = {"$in": among}
        if names is not None:
            scope[f.NAME] = {"$in": list(names)}
        if window is not None:
            scope["$and"] = [x.window_filter(*window)]
        run_id = uuid.uuid4().hex
        # One command either way: a fresh claim is the small update (a third of the
        # server's work on a look-alike that interprets expressions), never followed by the
        # general one when it misses: a miss means the task changed, and the caller looks again.
        query = x.fresh_claimable(worker_id) if fresh else x.claimable(worker_id)
        update = x.fresh_claim(worker_id, run_id) if fresh else x.claim(worker_id, run_id)
        try:
            with mapped_errors():
                doc = _decoded(
                    await self._raw.find_one_and_update(
                        {**query, **scope}, update, sort=CLAIM_SORT, return_document=ReturnDocument.AFTER
                    )
                )
        except StoreUnavailable as exc:  # it may have landed, even after the driver's retry
            claimed = await self._recover_now(worker_id, [run_id], among, exc)
            if claimed.rejected:
                raise claimed.rejected[0] from exc
            return claimed.claims[0] if claimed.claims else None
        if doc is None or not any(w.get(f.RUN_ID) == run_id for w in doc.get(f.WORKERS) or []):
            return None  # nothing claimable, or a task whose dead leases spent its budget was ended
        try:
            return Claim(Task.from_document(doc), run_id)
        except MalformedTask as exc:
            await self._reject(doc[f.ID], run_id, exc)
            raise

    async def claim_many(
        self,
        worker_id: str,
        keys: Sequence[str],
        *,
        names: Sequence[str] | None = None,
        fresh: bool = False,
        window: Window | None = None,
    ) -> Claimed:
        keys = list(dict.fromkeys(keys))
        run_ids = [uuid.uuid4().hex for _ in keys]
        run_id = x.run_id_by_key(keys, run_ids)
        query = {
            **(x.fresh_claimable(worker_id) if fresh else x.claimable(worker_id)),
            f.KEY: {"$in": keys},
        }
        if names is not None:
            query[f.NAME] = {"$in": list(names)}
        if window is not None:
            query["$and"] = [x.window_filter(*window)]
        update = x.fresh_claim(worker_id, run_id) if fresh else x.claim(worker_id, run_id)
        if not keys:
            return Claimed([], [])
        try:
            with mapped_errors():
                # update_many is not a retryable write: a lost reply is recovered below.
                if (await self._raw.update_many(query, update)).modified_count == 0:
                    return Claimed([], [])
        except StoreUnavailable as exc:
            return await self._recover_now(worker_id, run_ids, keys, exc)
        try:
            return await self.recover(worker_id, run_ids, keys=keys)
        except StoreUnavailable as exc:
            raise ClaimUnconfirmed(str(exc), run_ids, keys) from exc

    async def _recover_now(
        self, worker_id: str, run_ids: list[str], keys: list[str] | None, exc: StoreUnavailable
    ) -> Claimed:
        """After a claim's transport error: what landed, read at once (a lost reply closes
        one connection, not the server), each claim marked ``recovered``; ``ClaimUnconfirmed``
        when that read fails too."""
        try:
            claimed = await self.recover(worker_id, run_ids, keys=keys)
        except StoreUnavailable as again:
            raise ClaimUnconfirmed(str(exc), run_ids, keys) from again
        return Claimed([replace(claim, recovered=True) for claim in claimed.claims], claimed.rejected)

    async def recover(
        self, worker_id: str, run_ids: Sequence[str], *, keys: Sequence[str] | None = None
    ) -> Claimed:
        with mapped_errors():
            found = await self._raw.find(x.claims_filter(worker_id, run_ids, keys)).to_list()
        docs = list(map(_decode, found))
        wanted = set(run_ids)
        claimed = Claimed([], [])
        for doc in docs:  # a task whose dead leases spent its budget was ended: no entry, not here
            run_id = next(w[f.RUN_ID] for w in doc[f.WORKERS] if w.get(f.RUN_ID) in wanted)
            try:
                claimed.claims.append(Claim(Task.from_document(doc), run_id))
            except MalformedTask as exc:
                claimed.rejected.append(exc)
                # Not recorded now? Its lease expires and a later claim counts the failure;
                # the other claims of this batch must not be lost over it.
                with suppress(StoreError):
                    await self._reject(doc[f.ID], run_id, exc)
        return claimed

    async def write_runs(self, writes: Sequence[RunWrite]) -> list[RunResult]:
        quick = [w.kind == "success" and x.storable_as_is([w.value, w.progress]) for w in writes]
        results, owned = await self._write_runs(writes, quick)
        # A quick success refused while its run still owns its entry is the uncommon case
        # (canceled, several slots): the pipeline writes it, one more round trip.
        again = [i for i, q in enumerate(quick) if q and i in owned]
        if again:
            retried, _ = await self._write_runs([writes[i] for i in again], [False] * len(again))
            for i, result in zip(again, retried, strict=True):
                results[i] = result
        return results

    async def _write_runs(
        self, writes: Sequence[RunWrite], quick: list[bool]
    ) -> tuple[list[RunResult], set[int]]:
        """Results, and which writes that did not land still own a RUNNING entry."""
        if not writes:
            return [], set()
        errors: dict[int, StoreError] = {}
        ops = [self._run_op(w, q) for w, q in zip(writes, quick, strict=True)]
        try:
            with mapped_errors():
                result = await self.collection.bulk_write(ops, ordered=False)
            matched = result.matched_count
        except PartialBulkWrite as exc:
            matched, errors = exc.matched, exc.errors
        except DocumentTooLarge as exc:
            # Refused as a whole (the driver's own check, or a command error): write each
            # alone, so that only the write that is too large gets this error.
            if len(writes) == 1:
                return [exc], set()
            return await self._write_each(writes, quick)
        if matched + len(errors) == len(writes):
            return [errors.get(i, RunStatus.DONE) for i in range(len(writes))], set()
        return await self._resolve(writes, matched, errors)

    async def _write_each(
        self, writes: Sequence[RunWrite], quick: list[bool]
    ) -> tuple[list[RunResult], set[int]]:
        results: list[RunResult] = []
        owned: set[int] = set()
        for i, (write, q) in enumerate(zip(writes, quick, strict=True)):
            [result], still_owned = await self._write_runs([write], [q])
            results.append(result)
            if still_owned:
                owned.add(i)
        return results, owned

    @staticmethod
    def _run_op(write: RunWrite, quick: bool = False) -> UpdateOne:
        if quick:
            query, plain, array_filters = x.quick_succeed(
                write.key, write.run_id, write.value, progress=write.progress
            )
            return UpdateOne(query, plain, array_filters=array_filters)
        if write.kind == "ping":
            filter_ = x.renewable(write.key, write.run_id, write.worker_id)
            return UpdateOne(filter_, x.ping(write.run_id, write.value))
        if write.kind == "success":
            update = x.succeed(write.run_id, write.value, progress=write.progress)
        else:
            failure: Failure = write.value
            error = failure.error.model_dump()
            update = x.fail(write.run_id, error, failure.retry_in, failure.final, progress=write.progress)
        return UpdateOne(x.running_entry(write.key, write.run_id), update)

    async def _resolve(
        self, writes: Sequence[RunWrite], matched: int, errors: dict[int, StoreError]
    ) -> tuple[list[RunResult], set[int]]:
        """Some writes matched nothing: read the documents back to tell which, and why;
        also which outcomes that did not land still own their RUNNING entry."""
        fields = [f.KEY, f.STATE, f.opt(f.WORKER_IDS), f"{f.WORKERS}.{f.RUN_ID}", f"{f.WORKERS}.{f.STATE}"]
        with mapped_errors():
            found = await self._raw.find(
                {f.KEY: {"$in": list({w.key for w in writes})}}, dict.fromkeys(fields, 1)
            ).to_list()
        docs = {d.get(f.KEY): d for d in map(_decode, found)}
        results: list[RunResult] = []
        for i, w in enumerate(writes):
            doc = docs.get(w.key)
            if i in errors:
                results.append(errors[i])
            elif w.kind == "ping":
                results.append(rules.renewal_status(doc, w.run_id, w.worker_id))
            else:
                state = EntryState.SUCCESS if w.kind == "success" else EntryState.FAIL
                results.append(rules.outcome_status(doc, w.run_id, state))
        if results.count(RunStatus.DONE) > matched:
            # More look done than matched (an outcome written by an earlier try counts):
            # a renewal among them cannot be shown to have landed now.
            results = [
                RunStatus.UNCONFIRMED if r is RunStatus.DONE and w.kind == "ping" else r
                for r, w in zip(results, writes, strict=True)
            ]
        owned = {
            i
            for i, (r, w) in enumerate(zip(results, writes, strict=True))
            if r is RunStatus.LOST
            and w.kind != "ping"
            and rules.running_entry(docs.get(w.key) or {}, w.run_id)
        }
        return results, owned

    async def _reject(self, doc_id: Any, run_id: str, exc: MalformedTask) -> None:
        """Record a claimed but unreadable document as this run's failure, so it cannot loop."""
        error = TaskError(type="MalformedTask", message=str(exc)).model_dump()
        fence = {
            f.ID: doc_id,
            f.WORKERS: {"$elemMatch": {f.RUN_ID: run_id, f.STATE: EntryState.RUNNING.value}},
        }
        with mapped_errors():
            await self.collection.update_one(fence, x.fail(run_id, error, final=True))

    async def _run_write(self, key: str, run_id: str, update: list[Any]) -> Task:
        with mapped_errors():
            doc = _decoded(
                await self._raw.find_one_and_update(
                    x.running_entry(key, run_id), update, return_document=ReturnDocument.AFTER
                )
            )
        if doc is None:
            raise ClaimLost(key, run_id)
        return self._task(doc)

    async def release(self, key: str, run_id: str) -> Task:
        return await self._run_write(key, run_id, x.release(run_id))

    async def snooze(self, key: str, run_id: str, seconds: float) -> Task:
        return await self._run_write(key, run_id, x.snooze(run_id, seconds))

    async def normalize(self, key: str) -> Task:
        with mapped_errors():
            doc = _decoded(await self._raw.find_one({f.KEY: key}))
        if doc is None:
            raise TaskNotFound(key)
        # The values' types decide whether it reads; the write stamps server time.
        fill, problem = rules.verdict(doc, datetime.now(UTC))
        if not (fill or problem) or (problem and rules.is_marked(doc)):
            return self._task(doc)
        update = x.normalize(fill) if fill else []
        guard: Doc = {f.ID: doc[f.ID]}
        if problem is not None:
            update += x.mark(problem.problem)
            guard |= x.unchanged(doc, sorted({f.STATE, problem.field.split(".")[0]} - {""}))
        with mapped_errors():
            after = _decoded(
                await self._raw.find_one_and_update(guard, update, return_document=ReturnDocument.AFTER)
            )
            after = after if after is not None else _decoded(await self._raw.find_one({f.ID: doc[f.ID]}))
        if after is None:
            raise TaskNotFound(key)
        return self._task(after)

    async def cancel(self, key: str, *, session: Session | None = None) -> Task:
        with mapped_errors():
            doc = _decoded(
                await self._raw.find_one_and_update(
                    x.cancelable(key),
                    x.cancel(),
                    return_document=ReturnDocument.AFTER,
                    session=_driver(session),
                )
            )
        if doc is None:
            finished = await self.get(key, session=session)  # raises TaskNotFound
            raise InvalidState(key, finished.state.value, "cancel", "WAITING, PENDING or RUNNING")
        return self._task(doc)

    async def retry(
        self, key: str, *, trace: Mapping[str, str] | None = None, session: Session | None = None
    ) -> Task:
        with mapped_errors():
            doc = _decoded(
                await self._raw.find_one_and_update(
                    x.retryable(key),
                    x.retry(trace=trace),
                    return_document=ReturnDocument.AFTER,
                    session=_driver(session),
                )
            )
        if doc is None:
            task = await self.get(key, session=session)  # raises TaskNotFound
            # No RUNNING entry here: it stopped since the update, or its entry does not read.
            running = [w.worker_id for w in task.workers if w.state is EntryState.RUNNING] or ["a worker"]
            raise rules.retry_refused(key, task.state.value, running)
        return self._task(doc)

    async def purge(self, states: Sequence[TaskState], older_than: float, *, dry_run: bool = False) -> int:
        query = x.purgeable([s.value for s in states], older_than * 1000)
        with mapped_errors():
            if dry_run:
                return await self.collection.count_documents(query)
            return (await self.collection.delete_many(query)).deleted_count

    async def stats(self) -> TaskStats:
        now = await self.server_time()
        pipeline = x.stats_pipeline(self.collection.name, now - timedelta(hours=1))
        with mapped_errors():
            rows = await (await self.collection.aggregate(pipeline)).to_list()
        counts: dict[str, dict[str, int]] = {}
        recent: dict[str, int] = {}
        oldest: Any = None
        for row in rows:
            part = row["_id"]
            if part["part"] == x.STATS_BY:
                counts.setdefault(str(part.get(f.NAME)), {})[str(part.get(f.STATE))] = row["n"]
            elif part["part"] == x.STATS_RECENT:
                recent[str(part.get(f.STATE))] = row["n"]
            else:
                oldest = row["n"]
        return TaskStats(
            counts=counts,
            running=sum(c.get(TaskState.RUNNING.value, 0) for c in counts.values()),
            oldest_pending_seconds=(now - oldest).total_seconds() if isinstance(oldest, datetime) else None,
            finished_last_hour=recent.get(EntryState.SUCCESS.value, 0) + recent.get(EntryState.FAIL.value, 0),
            failed_last_hour=recent.get(EntryState.FAIL.value, 0),
        )

    async def pinned_away(self, live: Sequence[str], *, examples: int = 5) -> list[PinnedAway]:
        with mapped_errors():
            rows = await (await self.collection.aggregate(x.pinned_away(live, examples))).to_list()
        return [PinnedAway(worker_ids=row["_id"], tasks=row["tasks"], keys=row["keys"]) for row in rows]

    async def server_time(self) -> datetime:
        with mapped_errors():
            hello = await self.client.admin.command("hello")
        now = hello["localTime"]
        assert isinstance(now, datetime)
        return now if now.tzinfo else now.replace(tzinfo=UTC)

    async def server_info(self) -> ServerInfo:
        # buildInfo first: a server older than the minimum may not know hello (4.4.2).
        with mapped_errors():
            build_info = await self.client.admin.command("buildInfo")
        if too_old(build_info):
            return read_server({}, build_info, {})
        try:
            with mapped_errors():
                hello = await self.client.admin.command("hello")
        except StoreError as exc:
            if _code(exc) != _COMMAND_NOT_FOUND:
                raise
            raise ServerTooOld(
                read_server({}, build_info, {}).version_text, MINIMUM_TEXT, WHY_MINIMUM
            ) from exc
        with mapped_errors():
            status = await self.client.admin.command("connectionStatus", showPrivileges=True)
        info = read_server(hello, build_info, status)
        if info.change_streams:
            return info
        # hello says standalone; a look-alike server may still serve change streams: ask one.
        return replace(info, change_streams=await self._streams_open())

    async def _streams_open(self) -> bool:
        try:
            with mapped_errors():
                stream = await self.collection.watch([], max_await_time_ms=1)
                await stream.close()
        except StoreUnavailable:
            raise
        except StoreError:  # ChangeStreamsUnsupported, or not allowed: either way no stream
            return False
        return True

    async def beat(self, worker: WorkerInfo, ttl: float) -> bool:
        info = worker.model_dump(by_alias=True, exclude={f.BEAT_AT, f.EXPIRES_AT, f.STOP_REQUESTED})
        stamp = {f.BEAT_AT: x.NOW, f.EXPIRES_AT: {"$add": [x.NOW, ttl * 1000]}}
        update = [{"$set": {**{k: {"$literal": v} for k, v in info.items()}, **stamp}}]
        with mapped_errors():
            doc = await self.registry.find_one_and_update(
                {f.ID: worker.worker_id},
                update,
                upsert=True,
                return_document=ReturnDocument.AFTER,
                projection={f.STOP_REQUESTED: 1},
            )
        return bool(doc and doc.get(f.STOP_REQUESTED))

    async def request_stop(self, worker_id: str) -> bool:
        live = {f.ID: worker_id, "$expr": {"$gt": [f.ref(f.EXPIRES_AT), x.NOW]}}
        with mapped_errors():
            result = await self.registry.update_one(live, {"$set": {f.STOP_REQUESTED: True}})
        return result.matched_count == 1

    async def workers(self) -> list[WorkerInfo]:
        live = {"$expr": {"$gt": [f.ref(f.EXPIRES_AT), x.NOW]}, f.EXPIRES_AT: {"$type": "date"}}
        with mapped_errors():
            docs = await self.registry.find(live).sort(f.ID, 1).to_list()
        return [WorkerInfo.model_validate(d) for d in docs]

    async def unregister(self, worker_id: str) -> None:
        with mapped_errors():
            await self.registry.delete_one({f.ID: worker_id})

    async def declare_schedule(self, schedule: Schedule, next_at: datetime) -> None:
        definition = {k: {"$literal": v} for k, v in schedule.definition().items()}
        state = {
            f.PAUSED: {"$ifNull": [f.ref(f.PAUSED), False]},
            f.NEXT_AT: next_at,
            f.CREATED_AT: {"$ifNull": [f.ref(f.CREATED_AT), x.NOW]},
            f.DECLARED_AT: x.NOW,
            f.UPDATED_AT: x.NOW,
        }
        with mapped_errors():
            await self.schedule_docs.update_one(
                {f.ID: schedule.id}, [{"$set": {**definition, **state}}], upsert=True
            )

    async def schedules(self, ids: Sequence[str] | None = None) -> dict[str, ScheduleState | Unreadable]:
        query = {} if ids is None else {f.ID: {"$in": list(ids)}}
        with mapped_errors():
            docs = await self.schedule_docs.find(query).sort(f.ID, 1).to_list()
        return {str(doc.get(f.ID)): ScheduleState.read(doc) for doc in docs}

    async def record_tick(
        self, schedule_id: str, previous: datetime | None, tick: datetime, key: str, next_at: datetime
    ) -> bool:
        with mapped_errors():
            result = await self.schedule_docs.update_one(
                {f.ID: schedule_id, f.LAST_TICK: previous},
                {
                    "$set": {f.LAST_TICK: tick, f.LAST_KEY: key, f.NEXT_AT: next_at},
                    "$currentDate": {f.UPDATED_AT: True},
                },
            )
        return result.modified_count == 1

    async def pause_schedule(self, schedule_id: str, paused: bool) -> ScheduleState:
        changes: Doc = {f.PAUSED: paused, f.UPDATED_AT: x.NOW}
        if not paused:
            changes[f.RESUMED_AT] = x.NOW
        with mapped_errors():
            doc = await self.schedule_docs.find_one_and_update(
                {f.ID: schedule_id}, [{"$set": changes}], return_document=ReturnDocument.AFTER
            )
        if doc is None:
            raise ScheduleNotFound(schedule_id)
        state = ScheduleState.read(doc)
        if isinstance(state, Unreadable):
            raise InvalidSchedule(schedule_id, f"the stored schedule is unreadable: {state}")
        return state

    async def limits(self, names: Sequence[str] | None = None) -> dict[str, LimitState | Unreadable]:
        query = {} if names is None else {f.ID: {"$in": list(names)}}
        with mapped_errors():
            docs = await self.limit_docs.find(query).sort(f.ID, 1).to_list()
        return {str(doc.get(f.ID)): LimitState.read(doc) for doc in docs}

    async def pause(self, name: str, paused: bool) -> LimitState:
        stamp = f.PAUSED_AT if paused else f.RESUMED_AT
        with mapped_errors():
            doc = await self.limit_docs.find_one_and_update(
                {f.ID: name},
                {"$set": {f.PAUSED: paused}, "$currentDate": {stamp: True, f.UPDATED_AT: True}},
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
        assert doc is not None, "an upsert returns the document"
        return readable_limit(doc)

    async def watch_limits(self) -> ChangeStream:
        # Document changes only: a drop or rename of the collection ends the stream
        # (ChangeStreamEnded), it is no change of a document.
        pipeline = [{"$match": {f.OPERATION_TYPE: {"$in": _CHANGES}}}]
        with mapped_errors():
            stream = await self.limit_docs.watch(pipeline, max_await_time_ms=_WORK_AWAIT_MS)
        return _MongoChangeStream(stream)

    async def throttle(self, name: str, seconds: float, *, gate: str | None = None) -> None:
        update = x.throttle_update(seconds) if gate is None else x.throttle_gate_update(gate, seconds)
        with mapped_errors():
            await self.limit_docs.update_one({f.ID: name}, update, upsert=True)

    async def set_limits(self, name: str, changes: Mapping[str, Any], *, clear: bool = False) -> LimitState:
        update: Doc = {"$currentDate": {f.UPDATED_AT: True}}
        dropped = {field: "" for field in (f.RATE_LIMIT, f.MAX_RUNNING) if clear and field not in changes}
        if changes:
            update["$set"] = dict(changes)
        if dropped:
            update["$unset"] = dropped
        with mapped_errors():
            doc = await self.limit_docs.find_one_and_update(
                {f.ID: name}, update, upsert=True, return_document=ReturnDocument.AFTER
            )
        assert doc is not None, "an upsert returns the document"
        return readable_limit(doc)

    async def declare_limits(self, name: str, declared: Mapping[str, Any]) -> None:
        # Only when it differs: every write wakes every worker's limits stream.
        declared = dict(sorted(declared.items()))
        try:
            with mapped_errors():
                await self.limit_docs.update_one(
                    {f.ID: name, f.DECLARED: {"$ne": declared}},
                    {"$set": {f.DECLARED: declared}, "$currentDate": {f.UPDATED_AT: True}},
                    upsert=True,
                )
        except DuplicateKey:
            pass  # another worker's upsert created it with these limits: nothing to do

    async def read_gate(self, gate: str) -> dict[str, Any] | None:
        with mapped_errors():
            return await self.gate_docs.find_one({f.ID: gate})

    async def gates(self, names: Sequence[str], *, limit: int = 1000) -> list[dict[str, Any]]:
        with mapped_errors():
            return await self.gate_docs.find({f.NAME: {"$in": list(names)}}).limit(limit).to_list()

    async def update_gate(
        self, gate: str, expect: Mapping[str, Any], changes: Mapping[str, Any], *, create: bool = False
    ) -> dict[str, Any] | None:
        update = {"$set": dict(changes), "$currentDate": {f.UPDATED_AT: True}}
        try:
            with mapped_errors():
                return await self.gate_docs.find_one_and_update(
                    {f.ID: gate, **expect}, update, upsert=create, return_document=ReturnDocument.AFTER
                )
        except DuplicateKey:
            return None  # created meanwhile by another worker: an expectation failed

    async def watch(
        self,
        *,
        resume_after: Mapping[str, Any] | None = None,
        key: str | None = None,
        work_for: Sequence[str] | None = None,
        owned: Mapping[str, Sequence[int]] | None = None,
        summary: bool = False,
    ) -> ChangeStream:
        if key is not None:
            return await _KeyStream.open(self.collection, key, resume_after)
        read = _event
        if work_for is not None:
            # A worker's stream: filtered by the server, no post-image lookups; it waits
            # long per getMore because an idle worker need not ask often.
            options: Doc = {"max_await_time_ms": _WORK_AWAIT_MS}
            pipeline = [{"$match": x.hears(list(work_for), owned)}]
        elif summary:
            options, pipeline, read = {"max_await_time_ms": _AWAIT_MS}, _SUMMARY_PIPELINE, _summary_event
        else:
            options = {"full_document": "updateLookup", "max_await_time_ms": _AWAIT_MS}
            pipeline = [{"$match": {f.OPERATION_TYPE: {"$in": _CHANGES}}}]
        with mapped_errors():
            stream = await self.collection.watch(pipeline, resume_after=resume_after, **options)
        return _MongoChangeStream(stream, read)

    # -- workflows (taskrunner.workflows) --------------------------------------------------
    async def follow_ups(
        self, *, keys: Sequence[str] | None = None, after: Sequence[str] | None = None, limit: int = 100
    ) -> list[FollowUp]:
        projection = dict.fromkeys(FOLLOW_UP_FIELDS, 1)
        found: list[Doc] = []
        with mapped_errors():
            if keys is None and after is None:
                found = await self.collection.find(x.owes_follow_up(), projection).limit(limit).to_list()
            for chunk in _chunks(keys or []):
                query = {**x.owes_follow_up(), f.KEY: {"$in": chunk}}  # strings only, as asked
                found += await self.collection.find(query, projection).to_list()
            for chunk in _chunks(after or []):
                query = {f.AFTER: {"$in": chunk}, **x.owes_follow_up()}
                found += await self.collection.find(query, projection).limit(limit).to_list()
        return [up for up in map(follow_up_of, found) if up is not None]

    async def mark_upstreams(self, keys: Sequence[str]) -> None:
        with mapped_errors():
            for chunk in _chunks(keys):
                await self.collection.update_many(x.markable(chunk), x.mark_upstream())

    async def settle(self, states: Mapping[str, str]) -> None:
        """One page of dependents (``CHUNK``) per update, found in key order: a fan-out to
        10,000 takes ten, each short, instead of one that holds the server. (A document whose
        key is not a string is not a task anyone could settle.)"""
        heard = rules.Heard(dict(states))
        query, update = x.settleable(heard.keys), x.settle(heard)
        last = ""
        with mapped_errors():
            while True:
                page = {**query, f.KEY: {"$gt": last}}
                cursor = self.collection.find(page, {f.KEY: 1}).sort(f.KEY, 1).limit(CHUNK)
                keys = [doc[f.KEY] for doc in await cursor.to_list()]
                if keys:
                    await self.collection.update_many({**query, f.KEY: {"$in": keys}}, update)
                if len(keys) < CHUNK:
                    return
                last = keys[-1]

    async def followed_up(self, done: Sequence[FollowUp]) -> None:
        # One update per counter value read (most follow-ups read 1) and CHUNK keys, not per task.
        ops = [
            UpdateMany({f.KEY: {"$in": chunk}, field: value}, {"$unset": {field: ""}})
            for (field, value), keys in counters_read(done).items()
            for chunk in _chunks(keys)
        ]
        if ops:
            with mapped_errors():
                await self.collection.bulk_write(ops, ordered=False)

    async def states(self, keys: Sequence[str], *, session: Session | None = None) -> dict[str, str]:
        found: dict[str, str] = {}
        with mapped_errors():
            for chunk in _chunks(keys):
                query = {f.KEY: {"$in": chunk}}
                docs = await self.collection.find(
                    query, {f.KEY: 1, f.STATE: 1}, session=_driver(session)
                ).to_list()
                found |= {d[f.KEY]: str(d.get(f.STATE)) for d in docs if isinstance(d.get(f.KEY), str)}
        return found

    async def get_many(self, keys: Sequence[str]) -> list[Task]:
        docs: list[Any] = []
        with mapped_errors():
            for chunk in _chunks(keys):
                docs += await self._raw.find({f.KEY: {"$in": chunk}}).to_list()
        return [self._task(_decode(doc)) for doc in docs]

    async def dependents(self, key: str, *, limit: int = 1000) -> list[Task]:
        return await self._tasks({f.AFTER: key}, limit)

    async def flow_tasks(self, flow: str, *, limit: int = 100_000) -> list[Task]:
        return await self._tasks({f.FLOW: flow}, limit)

    async def _tasks(self, query: Doc, limit: int) -> list[Task]:
        with mapped_errors():
            docs = await self._raw.find(query).sort([(f.CREATED_AT, 1), (f.ID, 1)]).limit(limit).to_list()
        return [self._task(_decode(doc)) for doc in docs]

    async def count_flow(self, flow: str, states: Sequence[TaskState]) -> int:
        query = {f.FLOW: flow, f.STATE: {"$in": [s.value for s in states]}, f.COMPENSATES: {"$exists": False}}
        with mapped_errors():
            return await self.collection.count_documents(query)

    async def stop_flow(self, flow: str, error: TaskError) -> int:
        with mapped_errors():
            result = await self.collection.update_many(x.stoppable(flow), x.stop(error.model_dump()))
        return result.modified_count

    async def close(self) -> None:
        if self._owns_client:
            await self.client.close()

    # -- internals ----------------------------------------------------------------------
    @staticmethod
    def _task(doc: Doc, *, created: bool = False) -> Task:
        return Task.read(doc, created=created)


CHUNK = 1000
"""Keys (or documents) one workflow command names at most: a fan-in or fan-out of 10,000
takes ten short commands, never one that holds the server for long."""


def _chunks(keys: Sequence[Any]) -> Iterator[list[Any]]:
    for start in range(0, len(keys), CHUNK):
        yield list(keys[start : start + CHUNK])


FOLLOW_UP_FIELDS = (f.KEY, f.STATE, f.NOTIFY, f.LINK, f.WAITING_ON, f.CANCELED_BY, f.FLOW)
"""What a follow-up reads of a task (``FollowUp``)."""


def _listing_queries(listing: Listing) -> tuple[Doc | None, Doc]:
    """A listing's two parts: documents whose sort value is a date, newest first through
    the sort's index (None once ``after`` is past them), then the others, by key. On
    MongoDB a range on a date only matches dates (type bracketing), so the others need
    their own query: bounded by their types, as a negated ``$type`` gives no index bounds."""
    query = MongoStore._query(listing.state, listing.name)
    if listing.worker_id is not None:
        query[f"{f.WORKERS}.{f.WORKER_ID}"] = listing.worker_id
    if listing.key_prefix:
        query[f.KEY] = {"$regex": "^" + re.escape(listing.key_prefix)}  # anchored: walks the key index
    not_dates = [{listing.sort: {"$in": [None, []]}}, {listing.sort: {"$type": x.NOT_DATES}}]
    undated = {**query, "$or": not_dates}
    if listing.after is None:
        return {**query, listing.sort: {"$type": "date"}}, undated
    at, key = listing.after
    if at is None:
        undated[f.KEY] = {**query.get(f.KEY, {}), "$lt": key}
        return None, undated
    # The range bounds the index scan; the $or breaks ties by key.
    dated = {**query, listing.sort: {"$type": "date", "$lte": at}}
    dated["$or"] = [{listing.sort: {"$lt": at}}, {f.KEY: {"$lt": key}}]
    return dated, undated


def _ttl(indexes: Mapping[str, Any], name: str) -> int:
    """The installed TTL index's period in seconds, 0 when there is none."""
    return int(indexes.get(name, {}).get("expireAfterSeconds", 0))


def _ttl_spec(
    direction: int, seconds: float, partial: Doc | None
) -> tuple[list[tuple[str, int]], Doc] | None:
    """A TTL index on finished_at (None for 0: no index), partial when ``partial`` is given."""
    if not seconds:
        return None
    options: Doc = {"expireAfterSeconds": int(seconds)}
    if partial is not None:
        options["partialFilterExpression"] = partial
    return [(f.FINISHED_AT, direction)], options


def _same_ttl(installed: Mapping[str, Any], options: Doc) -> bool:
    """Whether an installed index (``index_information``) has these TTL options."""
    return installed.get("expireAfterSeconds") == options["expireAfterSeconds"] and dict(
        installed.get("partialFilterExpression") or {}
    ) == dict(options.get("partialFilterExpression") or {})


def listed(docs: list[Doc], listing: Listing) -> Listed:
    """A page of ``listing`` from its documents in order, with the position after the last."""
    tasks = [Task.read(doc) for doc in docs]
    if len(docs) < listing.limit or not docs:
        return Listed(tasks, None)
    at = docs[-1].get(listing.sort)
    return Listed(tasks, (at if isinstance(at, datetime) else None, tasks[-1].key))


class _MongoChangeStream:
    """A PyMongo change stream; its resume token advances with every (even empty) batch.

    A stream the server ended raises ``ChangeStreamEnded``: MongoDB answers the getMore
    after an invalidate with cursor id 0 (even when the ``$match`` hides the invalidate
    event), and PyMongo's ``try_next`` then returns None at once, without I/O, for ever.
    """

    def __init__(
        self, stream: AsyncChangeStream[Doc], read: Callable[[Doc], ChangeEvent | None] | None = None
    ) -> None:
        self._stream = stream
        self._read = read if read is not None else _event
        self._ended: str | None = None

    @property
    def resume_token(self) -> Mapping[str, Any] | None:
        return self._stream.resume_token

    async def next(self, wait: float) -> ChangeEvent | None:
        deadline = time.monotonic() + wait
        while True:
            change = await self._try_next()
            event = None if change is None else await self._arrived(change)
            if event is not None:
                return event
            if time.monotonic() >= deadline:
                return None
            # Every pass yields to the event loop, whatever the driver did: a loop that
            # waits on the store must never starve the worker's other tasks.
            await asyncio.sleep(0)

    async def _try_next(self) -> Doc | None:
        """One change, or None after one getMore that brought none; raises once ended."""
        if self._ended is not None:
            raise ChangeStreamEnded(self._ended)
        try:
            with mapped_errors():
                change = await self._stream.try_next()
        except StoreError as exc:
            if not self._stream.alive:  # PyMongo closes a stream after an error it cannot resume
                self._ended = f"closed after an error ({exc})"
            raise
        if change is not None and change.get(f.OPERATION_TYPE) == f.INVALIDATE:
            self._ended = ChangeStreamEnded.INVALIDATED
        elif change is None and not self._stream.alive:
            self._ended = ChangeStreamEnded.CURSOR_CLOSED
        else:
            return change
        raise ChangeStreamEnded(self._ended)

    async def _arrived(self, change: Doc) -> ChangeEvent | None:
        return self._read(change)

    async def close(self) -> None:
        self._ended = self._ended or ChangeStreamEnded.CLOSED
        with mapped_errors():
            await self._stream.close()


class _KeyStream(_MongoChangeStream):
    """One task's stream (``watch(key=...)``), matched by the document's ``_id`` so the
    server skips every other task's changes while reading the oplog, before any lookup
    (MongoDB 5.1 and later; see docs/compatibility.md). A new document under the key (its
    first publish, or one after a delete) is matched by its insert, which carries the
    document; the stream then reopens there to follow the new ``_id``."""

    def __init__(
        self, collection: AsyncCollection[Doc], key: str, doc_id: Any, stream: AsyncChangeStream[Doc]
    ) -> None:
        super().__init__(stream, partial(_key_event, key))
        self._collection, self._key, self._doc_id = collection, key, doc_id

    @classmethod
    async def open(
        cls, collection: AsyncCollection[Doc], key: str, resume_after: Mapping[str, Any] | None
    ) -> _KeyStream:
        with mapped_errors():
            found = await collection.find_one({f.KEY: key}, projection={f.ID: 1})
        doc_id = found[f.ID] if found is not None else None
        return cls(collection, key, doc_id, await cls._watch(collection, key, doc_id, resume_after))

    @staticmethod
    async def _watch(
        collection: AsyncCollection[Doc], key: str, doc_id: Any, resume_after: Mapping[str, Any] | None
    ) -> AsyncChangeStream[Doc]:
        pipeline = [{"$match": _key_match(key, doc_id)}]
        with mapped_errors():
            return await collection.watch(pipeline, resume_after=resume_after, max_await_time_ms=_AWAIT_MS)

    async def _arrived(self, change: Doc) -> ChangeEvent | None:
        doc_id = (change.get(f.DOCUMENT_KEY) or {}).get(f.ID)
        if change.get(f.OPERATION_TYPE) in ("insert", "replace") and doc_id != self._doc_id:
            old = self._stream
            self._stream = await self._watch(self._collection, self._key, doc_id, change["_id"])
            self._doc_id = doc_id
            with suppress(pe.PyMongoError):
                await old.close()
        return self._read(change)


_CHANGES = ["insert", "update", "replace", "delete"]
"""The events that change a document; the others (drop, rename, invalidate, ...) concern the collection."""
_STATE_CHANGED = f"{f.UPDATE_DESCRIPTION}.{f.UPDATED_FIELDS}.{f.STATE}"

# The dashboard's stream: every change, nothing looked up, only what a page needs shipped.
_SUMMARY_PIPELINE: list[Doc] = [
    {"$match": {f.OPERATION_TYPE: {"$in": _CHANGES}}},
    {
        "$project": {
            f.OPERATION_TYPE: 1,
            f.DOCUMENT_KEY: 1,
            f"{f.FULL_DOCUMENT}.{f.KEY}": 1,
            f"{f.FULL_DOCUMENT}.{f.STATE}": 1,
            _STATE_CHANGED: 1,
        }
    },
]


def _key_match(key: str, doc_id: Any) -> Doc:
    """The ``$match`` of a key's stream. Every predicate is on ``operationType``,
    ``documentKey._id``, ``updateDescription.updatedFields`` or, for inserts and
    replacements only, ``fullDocument``: MongoDB applies all of them to the oplog entry,
    so no update of another task (and no lease renewal of this one) reaches the client."""
    arrivals: Doc = {f.OPERATION_TYPE: {"$in": ["insert", "replace"]}, f"{f.FULL_DOCUMENT}.{f.KEY}": key}
    if doc_id is None:
        return arrivals
    ours = {
        f"{f.DOCUMENT_KEY}.{f.ID}": doc_id,
        "$or": [
            {f.OPERATION_TYPE: {"$in": ["replace", "delete"]}},
            {f.OPERATION_TYPE: "update", _STATE_CHANGED: {"$exists": True}},
        ],
    }
    return {"$or": [ours, arrivals]}


def _event(change: Doc) -> ChangeEvent | None:
    kind: EventKind = change[f.OPERATION_TYPE]
    if kind not in _CHANGES:
        return None
    doc = change.get(f.FULL_DOCUMENT)
    token = change.get("_id")
    if doc is None and kind == "update" and f.UPDATE_DESCRIPTION in change:
        changed = change[f.UPDATE_DESCRIPTION].get(f.UPDATED_FIELDS) or {}
        if rules.wakes(changed):  # a worker's stream: which task is not said, only when
            return ChangeEvent(kind, None, None, token, wake=True, wake_at=rules.wake_at(changed))
    if doc is None:  # a delete, or the document was gone by lookup time
        return ChangeEvent(kind, None, None, token)
    try:
        return ChangeEvent(kind, doc.get(f.KEY), Task.from_document(doc), token)
    except MalformedTask as exc:
        return ChangeEvent(kind, doc.get(f.KEY), None, token, unreadable=Unreadable.of(doc, exc))


def _key_event(key: str, change: Doc) -> ChangeEvent | None:
    """An event of ``key``'s stream: inserts and replacements carry the task; an update
    only says the state changed, a delete that the document is gone."""
    kind = change.get(f.OPERATION_TYPE)
    if kind in ("insert", "replace"):
        return _event(change)
    if kind not in ("update", "delete"):
        return None
    return ChangeEvent(kind, key, None, change.get("_id"), doc_id=_doc_id(change), state=_state(change))


def _summary_event(change: Doc) -> ChangeEvent | None:
    """An event of a summary stream: the document's ``_id``, its key where the event
    carries the document (inserts and replacements), and the state the change wrote."""
    kind: EventKind = change[f.OPERATION_TYPE]
    if kind not in _CHANGES:
        return None
    key = (change.get(f.FULL_DOCUMENT) or {}).get(f.KEY)
    key = key if isinstance(key, str) else None
    return ChangeEvent(kind, key, None, change.get("_id"), doc_id=_doc_id(change), state=_state(change))


def _doc_id(change: Doc) -> Any:
    return (change.get(f.DOCUMENT_KEY) or {}).get(f.ID)


def _state(change: Doc) -> str | None:
    """The state a change wrote: the document's (inserts, replacements) or the update's."""
    doc = change.get(f.FULL_DOCUMENT) or {}
    changed = (change.get(f.UPDATE_DESCRIPTION) or {}).get(f.UPDATED_FIELDS) or {}
    state = doc.get(f.STATE, changed.get(f.STATE))
    return state if isinstance(state, str) else None
