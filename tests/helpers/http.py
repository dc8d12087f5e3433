"""Raw calls on a server's routes for tests that check a server's own answers route by route (slime's
code uses the typed calls of slime.engines.control)."""

from __future__ import annotations

from slime.engines.auth import bearer, env_api_key
from slime.engines.control import EngineControl

# the header a raw request to a server started by a test needs (tests/conftest.py sets the key)
AUTH = bearer(env_api_key())


def get_json(url: str, path: str, timeout: float = 30.0):
    return EngineControl(url, timeout=timeout).request("GET", path)


def post_json(url: str, path: str, payload=None, timeout: float = 60.0):
    return EngineControl(url, timeout=timeout).request("POST", path, json=payload if payload is not None else {})


def post_bytes(url: str, path: str, data: bytes, params: dict | None = None, timeout: float = 600.0):
    return EngineControl(url, timeout=timeout).request("POST", path, data=data, params=params)
