"""What slime's HTTP servers (the native engine, the vLLM adapter) share: handlers registered by
`slime.engines.control.Route` (the one table of the protocol's paths), a body cap per route, and
JSON bodies read the same way.

A server that installs `body_limits(app, ...)` refuses a body over its route's cap with 413 before
reading a byte of it when the request says its length (Content-Length), and as soon as the cap is
passed while reading a chunked one; the 413 closes the connection, so the rest of the body is
never read. `read_body` / `read_json` read within that cap (without the middleware: no cap)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from slime.engines.control import Route
from slime.engines.protocol import ProtocolError, error_body, parse_json_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# (bytes, why): a route's body cap and what sets it (a flag or a rule), named in the 413
BodyCap = tuple[int, str]
BODY_CAPS = web.AppKey("body_caps", tuple)  # (caps by path, default cap)
_OFF_LOOP_JSON_BYTES = 1 << 20  # bigger JSON bodies are decoded on a worker thread


def add_routes(app: web.Application, handlers: dict[Route, Handler]) -> None:
    """Register each handler at its route. `/flush_cache` answers any method (SGLang takes GET and POST)."""
    for route, handler in handlers.items():
        app.router.add_route("*" if route is Route.FLUSH_CACHE else route.method, route.path, handler)


def too_large(request: web.Request, size: int | str, cap: BodyCap) -> ProtocolError:
    limit, why = cap
    return ProtocolError("body", f"{size} bytes is over the {limit}-byte limit of {request.method} {request.path} "
                                 f"({why})", status=413)


def refusal(err: ProtocolError) -> web.Response:
    """The JSON answer to a refused request; a 413 also closes the connection (its body stays unread)."""
    resp = web.json_response(error_body(err), status=err.status)
    if err.status == 413:
        resp.force_close()
    return resp


def body_limits(app: web.Application, caps: dict[str, BodyCap], default: BodyCap) -> None:
    """Give `app`'s routes their body caps (`caps` by path, else `default`): its next middleware
    refuses a Content-Length over the cap, `read_body` a body that grows past it."""
    app[BODY_CAPS] = (caps, default)

    @web.middleware
    async def middleware(request: web.Request, handler):
        cap = body_cap(request)
        n = request.content_length
        if cap is not None and n is not None and n > cap[0]:
            return refusal(too_large(request, n, cap))
        return await handler(request)

    app.middlewares.append(middleware)


def body_cap(request: web.Request) -> BodyCap | None:
    """The cap of the request's route (None: the app has no body limits)."""
    limits = request.app.get(BODY_CAPS)
    if limits is None:
        return None
    caps, default = limits
    return caps.get(request.path, default)


async def read_body(request: web.Request) -> bytes:
    """The request's body, read within its route's cap (ProtocolError 413 past it)."""
    cap = body_cap(request)
    if cap is None:
        return await request.read()
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > cap[0]:
            raise too_large(request, f"at least {size}", cap)
        chunks.append(chunk)
    return b"".join(chunks)


def json_of(raw: bytes, allow_empty: bool = False):
    """A JSON request body; an empty body is `{}` when `allow_empty`, else a ProtocolError."""
    if not raw.strip():
        if allow_empty:
            return {}
        raise ProtocolError("body", "empty request body; expected a JSON object")
    return parse_json_body(raw)


async def read_json(request: web.Request, allow_empty: bool = False):
    """The request's JSON body (read within its cap; a large one decoded off the event loop); an
    empty body is `{}` when `allow_empty`, else a ProtocolError."""
    raw = await read_body(request)
    if len(raw) > _OFF_LOOP_JSON_BYTES:
        return await asyncio.to_thread(json_of, raw, allow_empty)
    return json_of(raw, allow_empty)
