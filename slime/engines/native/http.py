"""What the native engine's HTTP handlers share: the app key that holds the engine, submitting a
request to the engine's worker thread as an awaitable, and tokenizing a prompt."""

from __future__ import annotations

import asyncio

from aiohttp import web

from slime.engines.native.engine import NativeEngine
from slime.engines.protocol import ProtocolError

ENGINE_KEY = web.AppKey("engine", NativeEngine)
INCREMENTAL_STREAM_KEY = web.AppKey("incremental_streaming_output", bool)


def submit(engine: NativeEngine, inp, routed_experts: bool = False) -> asyncio.Future:
    """Queue `inp` on the engine (`routed_experts`: with the experts each token was routed to); the
    future resolves (on this loop) with its GenerationResult."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def _set(res, err):
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(res)

    def cb(res, err):
        try:
            loop.call_soon_threadsafe(_set, res, err)
        except RuntimeError:  # loop closed: nobody is waiting any more
            pass

    engine.submit(inp, cb, routed_experts=routed_experts)
    return fut


def tokenize(tokenizer, text: str, name: str) -> list[int]:
    """`text`'s token ids (call it off the event loop); a text the tokenizer refuses is a ProtocolError
    naming `name`."""
    try:
        return list(tokenizer.encode(text))
    except Exception as e:  # noqa: BLE001 - e.g. lone surrogates from \ud800 escapes
        raise ProtocolError(name, f"cannot be tokenized: {type(e).__name__}: {e}") from None
