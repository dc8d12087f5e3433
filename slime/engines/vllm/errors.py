"""The vLLM adapter's error answer, shared by its routes (`adapter.py`, `lora.py`)."""

from __future__ import annotations


class HTTPFailure(Exception):
    """An error answer: HTTP `status`, `message`, and the request field at fault (`field`, if any)."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field
