"""`ProtocolError`, the JSON body an error response carries, and the value checks every
parser of the engine protocol shares (`slime.engines.protocol` re-exports them)."""

from __future__ import annotations

import math
from typing import Any


class ProtocolError(ValueError):
    """A malformed request. `field` names the offending field (dotted path); `status` is the HTTP
    status a server answers it with: 400, or 413 (a body over the route's limit) and 429 (more
    generations than the engine's queue holds)."""

    def __init__(self, field: str, message: str, status: int = 400):
        self.field = field
        self.message = message
        self.status = status
        super().__init__(f"{field}: {message}" if field else message)


def error_body(message: str | Exception, field: str | None = None) -> dict:
    """The JSON body of an error response (SGLang's shape, plus the field name)."""
    if isinstance(message, ProtocolError):
        field = message.field if field is None else field
        message = str(message)
    body: dict[str, Any] = {"message": str(message)}
    if field:
        body["param"] = field
    return {"error": body}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)
