"""What slime's HTTP servers (the native engine, the vLLM adapter) share: handlers registered by
`slime.engines.control.Route` (the one table of the protocol's paths) and JSON bodies read the
same way."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from slime.engines.control import Route
from slime.engines.protocol import ProtocolError, parse_json_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_routes(app: web.Application, handlers: dict[Route, Handler]) -> None:
    """Register each handler at its route. `/flush_cache` answers any method (SGLang takes GET and POST)."""
    for route, handler in handlers.items():
        app.router.add_route("*" if route is Route.FLUSH_CACHE else route.method, route.path, handler)


async def read_json(request: web.Request, allow_empty: bool = False):
    """The request's JSON body; an empty body is `{}` when `allow_empty`, else a ProtocolError."""
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise ProtocolError("body", "empty request body; expected a JSON object")
    return parse_json_body(raw)
