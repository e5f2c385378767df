"""What the embedded server's bridge modules share: mongoeco's error type made MongoDB-shaped,
Int64 unwrapping, and the request context of a command the bridge answers itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:
    from mongoeco.core.bson_scalars import BsonInt64
    from mongoeco.errors import OperationFailure
except ImportError:  # Python < 3.13 or the 'embedded' extra is missing.
    MONGOECO_AVAILABLE = False
else:
    MONGOECO_AVAILABLE = True


def failure(message: str, code: int, code_name: str, *labels: str) -> Exception:
    # mongoeco renders codeName from details; labels drive driver resume logic.
    error: Exception = OperationFailure(
        message, code=code, details={"codeName": code_name}, error_labels=labels
    )
    return error


def plain_int(value: Any) -> Any:
    return value.value if isinstance(value, BsonInt64) else value


@dataclass(frozen=True, slots=True)
class BridgedCommand:
    """Request context for commands the bridge answers; the proxy only passes it back to us."""

    name: str
    db: str
    body: dict[str, Any]
