"""What the embedded server adds to mongoeco's in-memory engine before it stores a document
(``taskrunner.dev.patches`` installs it on the server's own engine instance).

* Inserts that do not read the collection.  Before every single-document insert
  (and the wire ``insert`` command inserts one document at a time) mongoeco compares
  the new ``_id`` with the ``_id`` of every stored document, so that ``1``, ``1.0``
  and ``Int64(1)`` stay one ``_id``: inserting n documents cost O(n²).  Its storage
  key already tells equal ``_id`` values apart for every other type, so the patch
  keeps that scan only for an ``_id`` holding a number or binary data (whose storage
  keys differ between equal values).  Task documents (ObjectId ``_id``) insert in
  constant time.
* MongoDB's document size limit.  mongoeco stores documents of any size; MongoDB
  refuses one over 16 MiB (``maxBsonObjectSize``).  The patch checks each document
  mongoeco is about to store and answers as MongoDB 6.0, 7.0 and 8.0 do (and as the
  7.0 that ``buildInfo`` reports): an insert gets BadValue (2) "object to insert too
  large" (``fixDocumentForInsert``), an update's result 17419 and an upsert's new document
  17420 (the update and upsert stages), as MongoDB's ``jstests/core/max_doc_size.js``
  checks them.  Only servers built after SERVER-104405 (MongoDB's main branch in 2025, not
  8.0) answer BSONObjectTooLarge (10334) for all three; taskrunner's store takes every one
  of these answers as ``DocumentTooLarge`` (docs/compatibility.md).

"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import bson

from taskrunner.dev.wire import MONGOECO_AVAILABLE, failure

if MONGOECO_AVAILABLE:
    from mongoeco.core.bson_scalars import is_bson_numeric
    from mongoeco.wire.bson_bridge import encode_wire_value

MAX_BSON_OBJECT_SIZE = 16 * 1024 * 1024  # MongoDB's BSONObjMaxUserSize, hello's maxBsonObjectSize

# The write command being executed, set by the bridge for the engine's size check.
current_command: contextvars.ContextVar[str] = contextvars.ContextVar("current_command", default="")
# Size of the wire message being executed: a document cannot be larger than the message.
current_message_size: contextvars.ContextVar[int] = contextvars.ContextVar(
    "current_message_size", default=MAX_BSON_OBJECT_SIZE + 1
)


def needs_logical_id_scan(value: object) -> bool:
    """An ``_id`` whose equal values may have different storage keys: numbers (1, 1.0,
    Int64(1)) and binary data (bytes and Binary subtype 0), at any depth."""
    if isinstance(value, dict):
        return any(needs_logical_id_scan(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(needs_logical_id_scan(item) for item in value)
    return isinstance(value, bytes) or bool(is_bson_numeric(value))


def bson_size(document: dict[str, Any]) -> int:
    encoded: bytes = bson.encode(encode_wire_value(document))
    return len(encoded)


def _too_large(document: dict[str, Any], *, replacing: bool) -> Exception | None:
    if current_command.get() == "insert" and current_message_size.get() <= MAX_BSON_OBJECT_SIZE:
        return None  # an inserted document is part of the message, so it is smaller
    size = bson_size(document)
    if size <= MAX_BSON_OBJECT_SIZE:
        return None
    if current_command.get() in ("update", "findAndModify"):
        if replacing:
            message = f"Resulting document after update is larger than {MAX_BSON_OBJECT_SIZE}"
            return failure(message, 17419, "Location17419")
        return failure(f"Document to upsert is larger than {MAX_BSON_OBJECT_SIZE}", 17420, "Location17420")
    message = f"object to insert too large. size in bytes: {size}, max size: {MAX_BSON_OBJECT_SIZE}"
    return failure(message, 2, "BadValue")


def checked_store(ensure_unique: Callable[..., None]) -> Callable[..., None]:
    """``ensure_unique`` (the engine's unique-index check, run before every document mongoeco
    stores: inserts, updates, upserts and ``$merge``) with both rules above first."""

    def checked(db_name: str, coll_name: str, candidate: dict[str, Any], **options: Any) -> None:
        error = _too_large(candidate, replacing=options.get("exclude_storage_key") is not None)
        if error is not None:
            raise error
        if options.get("scan_payload_id") and not needs_logical_id_scan(candidate.get("_id")):
            options["scan_payload_id"] = False
        ensure_unique(db_name, coll_name, candidate, **options)

    return checked
