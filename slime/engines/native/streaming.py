"""Streaming responses (Server-Sent Events) of the native engine.

`EngineStream` submits requests with the engine's `on_token` hook: the worker thread hands
every sampled token to the event loop (`loop.call_soon_threadsafe` onto an asyncio queue),
and the request's result arrives on the same queue, after its tokens. Tokens that pile up
while the loop is busy are coalesced into one update. A stream that ends early (the client
went away, the handler was cancelled) aborts its unfinished requests, which frees their rows.

Text shown before a request finishes (`TextStream`) is the decode of its tokens so far,
minus a trailing incomplete UTF-8 character and minus the last `len(longest stop) - 1`
characters while stop strings are set, so text never streams past a stop string matched
later; the last event carries the engine's final text, the one a non-streaming request gets.

`POST /generate` with `"stream": true` answers SGLang's way (`text/event-stream`)::

    data: {"text": ..., "output_ids": [...], "meta_info": {"id", "finish_reason": null,
           "prompt_tokens", "completion_tokens", "weight_version",
           ["output_token_logprobs"]}}\\n\\n        (one per update)
    data: {... the non-streaming response, finish_reason set}\\n\\n
    data: [DONE]\\n\\n

The last event also carries `input_token_logprobs` (with `return_logprob`); a streamed request may
not ask for `logprob_start_len` >= 0 or `top_logprobs_num` > 0 (400 naming `stream`), nor for
`return_routed_experts` (400 naming it).
`text`, `output_ids` and `output_token_logprobs` are cumulative (SGLang's default);
with `--incremental-streaming-output` each event carries only what is new since the
previous one (SGLang's flag of that name). `completion_tokens` is always the total.
A batch request streams the events of all its items interleaved, each with `"index"`.
An engine error becomes `data: {"error": {"message": ...}}` before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from slime.engines.native.engine import NativeEngine
from slime.engines.native.requests import GenerationResult
from slime.engines.protocol import GenerateInput, ProtocolError, build_generate_response, error_body, logprob_meta

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One Server-Sent Event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def pop_stream_flag(body: Any) -> bool:
    """Remove and validate `stream` from a decoded `/generate` body (the rest goes to the parser)."""
    if not isinstance(body, dict):
        return False
    stream = body.pop("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise ProtocolError("stream", f"must be a boolean, got {stream!r}")
    return stream


class TextStream:
    """The text of a growing output that is safe to show before the request finishes."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def update(self, output_ids: list[int]) -> str:
        """New visible text after `output_ids` (all tokens so far); "" when none."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=self.skip_special_tokens)
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 character: wait for its other bytes
        if self.hold:
            text = text[: max(0, len(text) - self.hold)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new (or the tokenizer re-spaced earlier text: wait for the end)
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text."""
        if not final_text.startswith(self.sent):
            logger.warning("streamed text %r is not a prefix of the final text %r", self.sent[-40:], final_text[-40:])
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta


@dataclass
class StreamState:
    """One streamed request: what has arrived and what has been sent."""

    index: int
    inp: GenerateInput
    text: TextStream
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    result: GenerationResult | None = None
    error: BaseException | None = None
    sent_tokens: int = 0  # tokens already sent to the client (for incremental formats)
    token_texts: list[str] = field(default_factory=list)  # per-token text, filled on demand

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def texts(self, engine: NativeEngine, upto: int) -> list[str]:
        if len(self.token_texts) < upto:
            self.token_texts.extend(engine.token_texts(self.output_ids[len(self.token_texts):upto]))
        return self.token_texts[:upto]


class EngineStream:
    """Requests submitted with a token hook; `updates()` yields the states that changed."""

    def __init__(self, engine: NativeEngine, inputs: list[GenerateInput]):
        self.engine = engine
        self.states = [
            StreamState(i, inp, TextStream(engine.tokenizer, list(inp.sampling_params.stop),
                                           inp.sampling_params.skip_special_tokens))
            for i, inp in enumerate(inputs)
        ]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._submitted = 0

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    def start(self) -> None:
        try:
            for st in self.states:
                i = st.index
                self.engine.submit(st.inp, lambda res, err, i=i: self._put((i, None, res, err)),
                                   on_token=lambda ids, lps, i=i: self._put((i, ids, lps, None)))
                self._submitted += 1
        except BaseException:
            self.abort_unfinished()
            raise

    def abort_unfinished(self) -> None:
        for st in self.states[: self._submitted]:
            if not st.finished:
                self.engine.abort(st.inp.rid)

    async def updates(self):
        pending = len(self.states)
        while pending:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            changed: dict[int, StreamState] = {}
            for i, ids, payload, err in items:
                st = self.states[i]
                if st.finished:
                    continue
                if ids is not None:  # tokens
                    st.output_ids.extend(ids)
                    st.logprobs.extend(payload)
                else:  # the end
                    pending -= 1
                    if err is not None:
                        st.error = err
                    else:
                        st.result = payload
                        st.output_ids = list(payload.output_ids)
                        st.logprobs = list(payload.output_token_logprobs)
                changed[i] = st
            yield [changed[i] for i in sorted(changed)]


async def serve_stream(
    request: web.Request,
    engine: NativeEngine,
    inputs: list[GenerateInput],
    on_update: Callable[[StreamState], list[dict]],
    head: list[dict] | None = None,
    tail: Callable[[list[StreamState]], list[dict]] | None = None,
) -> web.StreamResponse:
    """Run `inputs` and answer with an SSE stream: `head`, then `on_update(state)` for every
    update of every request, then `tail(states)` and `data: [DONE]`."""
    stream = EngineStream(engine, inputs)
    stream.start()
    try:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        try:
            if head:
                await resp.write(b"".join(sse(c) for c in head))
            async for states in stream.updates():
                out = b""
                for st in states:
                    if st.error is not None:
                        logger.error("streamed request %s failed: %r", st.inp.rid, st.error)
                        out += sse(error_body(f"{type(st.error).__name__}: {st.error}"))
                    else:
                        out += b"".join(sse(c) for c in on_update(st))
                if out:
                    await resp.write(out)
            out = b"".join(sse(c) for c in tail(stream.states)) if tail else b""
            await resp.write(out + DONE)
            await resp.write_eof()
        except ConnectionError:  # the client went away mid-stream
            logger.debug("client of %s disconnected mid-stream", request.path)
        except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
            logger.exception("error streaming %s", request.path)
            try:
                await resp.write(sse(error_body(f"{type(e).__name__}: {e}")) + DONE)
                await resp.write_eof()
            except ConnectionError:
                pass
        return resp
    finally:
        stream.abort_unfinished()  # no-op when every request finished


# ---------------------------------------------------------------- POST /generate
def generate_update(engine: NativeEngine, st: StreamState, is_batch: bool, incremental: bool) -> list[dict]:
    """The SGLang `/generate` stream event(s) for one update of `st`."""
    inp, res = st.inp, st.result
    n = len(st.output_ids)
    start = st.sent_tokens if incremental else 0
    if res is not None:
        delta = st.text.finish(res.text)
        text = delta if incremental else res.text
        finish, version = res.finish_reason, res.weight_version
    else:
        delta = st.text.update(st.output_ids)
        if incremental and not delta and n == st.sent_tokens:
            return []
        text = delta if incremental else st.text.sent
        finish, version = None, engine.weight_version
    texts = None
    if inp.return_logprob and inp.return_text_in_logprobs:
        texts = st.texts(engine, n)[start:]
    ev = build_generate_response(
        rid=inp.rid, text=text, output_ids=st.output_ids[start:], finish_reason=finish,
        prompt_tokens=len(inp.input_ids), weight_version=version, output_token_logprobs=st.logprobs[start:n],
        return_logprob=inp.return_logprob, logprob_token_texts=texts,
    )
    ev["meta_info"]["completion_tokens"] = n
    if res is not None and inp.return_logprob and res.logprob_start is not None:  # the prompt's, in the last event
        ev["meta_info"].update(logprob_meta(
            input_ids=inp.input_ids, start=res.logprob_start, input_values=res.input_token_logprobs, input_top=None,
            output_top=None, top_logprobs_num=0, decode=engine.token_texts if inp.return_text_in_logprobs else None))
    if is_batch:
        ev["index"] = st.index
    st.sent_tokens = n
    return [ev]


async def stream_generate(request: web.Request, engine: NativeEngine, inputs: list[GenerateInput], is_batch: bool,
                          incremental: bool) -> web.StreamResponse:
    return await serve_stream(request, engine, inputs,
                              lambda st: generate_update(engine, st, is_batch, incremental))
