"""`stream: true` on `/v1/completions` and `/v1/chat/completions`: OpenAI's chunk format.

Every chunk is `data: {json}\\n\\n`; the stream ends with `data: [DONE]\\n\\n`. One chunk
carries one choice (choices of several prompts / `n` samples interleave, told apart by
`index`); text deltas follow `streaming.TextStream` (never past a stop string).

completions (`object: "text_completion"`)::

    {"id", "object", "created", "model",
     "choices": [{"index", "text": delta, "logprobs": null | {tokens, token_logprobs,
                  top_logprobs: null, text_offset} of this chunk's tokens,
                  "finish_reason": null | "stop" | "length" | "abort",
                  "token_ids": [ids new in this chunk],
                  ["prompt_token_ids": [...]  (the first chunk of each choice)],
                  ["matched_stop": ...        (the last chunk of each choice)]}],
     ["weight_version"  (the last chunk of each choice)]}

chat (`object: "chat.completion.chunk"`): first one chunk per choice with
`delta: {"role": "assistant", "content": ""}` and the top-level `prompt_token_ids`, then
`delta: {"content": ...}` chunks with `token_ids` and `logprobs: {"content": [...]}` for
their tokens, and a last chunk per choice with `finish_reason`, `matched_stop` and the
top-level `weight_version`.

`stream_options: {"include_usage": true}` adds `"usage": null` to every chunk and one
last chunk `{"choices": [], "usage": {prompt_tokens, completion_tokens, total_tokens},
"weight_version"}` before `[DONE]`.

The concatenation of a choice's `text` / `content` deltas is the non-streaming text, of
its `token_ids` the non-streaming `token_ids`, of its log-probs the non-streaming ones.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from slime.engines.native.engine import NativeEngine
from slime.engines.native.streaming import StreamState, serve_stream
from slime.engines.protocol import GenerateInput, ProtocolError


def parse_stream_options(body: dict) -> tuple[bool, bool]:
    """`(stream, include_usage)` of an OpenAI request body."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ProtocolError("stream", f"must be a boolean, got {stream!r}")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise ProtocolError("stream_options", "is only allowed with stream: true")
    if not isinstance(opts, dict):
        raise ProtocolError("stream_options", "must be an object")
    for k in opts:
        if k != "include_usage":
            raise ProtocolError(f"stream_options.{k}", "unknown field (only include_usage is supported)")
    usage = opts.get("include_usage", False)
    if usage is None:
        usage = False
    if not isinstance(usage, bool):
        raise ProtocolError("stream_options.include_usage", f"must be a boolean, got {usage!r}")
    return stream, usage


def _finish_reason(fr: dict) -> str:
    t = fr.get("type")
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(t, t)


class _Chunks:
    """Builds the chunks of one streamed OpenAI response."""

    def __init__(self, engine: NativeEngine, inputs: list[GenerateInput], n: int, model: str, obj: str, prefix: str,
                 include_usage: bool):
        self.engine = engine
        self.inputs = inputs
        self.n = n  # samples per prompt (inputs are prompt-major)
        self.model = model
        self.obj = obj
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = include_usage
        self.offsets: dict[int, int] = {}  # completions text_offset per choice

    def chunk(self, choices: list[dict], **extra: Any) -> dict:
        c: dict[str, Any] = {"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                             "choices": choices}
        if self.include_usage:
            c["usage"] = None
        c.update(extra)
        return c

    def step(self, st: StreamState) -> tuple[str, list[int], list[float], int] | None:
        """(text delta, new ids, their log-probs, index of the first) or None when nothing is new."""
        res, start = st.result, st.sent_tokens
        delta = st.text.finish(res.text) if res is not None else st.text.update(st.output_ids)
        n = len(st.output_ids)
        if res is None and not delta and n == start:
            return None
        st.sent_tokens = n
        return delta, st.output_ids[start:], st.logprobs[start:n], start

    def tail(self, states: list[StreamState]) -> list[dict]:
        if not self.include_usage:
            return []
        pt = sum(len(inp.input_ids) for inp in self.inputs[:: self.n])
        ct = sum(len(st.output_ids) for st in states)
        version = next((st.result.weight_version for st in states if st.result is not None),
                       self.engine.weight_version)
        return [self.chunk([], usage={"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
                           weight_version=version)]


async def stream_completions(request: web.Request, engine: NativeEngine, inputs: list[GenerateInput], n: int,
                             model: str, logprobs: int | None, include_usage: bool) -> web.StreamResponse:
    ch = _Chunks(engine, inputs, n, model, "text_completion", "cmpl", include_usage)

    def update(st: StreamState) -> list[dict]:
        step = ch.step(st)
        if step is None:
            return []
        delta, ids, lps, start = step
        c: dict[str, Any] = {"index": st.index, "text": delta, "logprobs": None, "finish_reason": None,
                             "token_ids": ids}
        if start == 0:
            c["prompt_token_ids"] = list(st.inp.input_ids)
        if logprobs is not None:
            toks = st.texts(engine, start + len(ids))[start:]
            pos = ch.offsets.get(st.index)
            if pos is None:
                pos = len(engine.tokenizer.decode(st.inp.input_ids))
            offsets = []
            for t in toks:
                offsets.append(pos)
                pos += len(t)
            ch.offsets[st.index] = pos
            c["logprobs"] = {"tokens": toks, "token_logprobs": [float(x) for x in lps], "top_logprobs": None,
                             "text_offset": offsets}
        return [ch.chunk([c], **_finish_fields(c, st))]

    return await serve_stream(request, engine, inputs, update, tail=ch.tail)


async def stream_chat(request: web.Request, engine: NativeEngine, inputs: list[GenerateInput], model: str,
                      logprobs: bool, include_usage: bool) -> web.StreamResponse:
    ch = _Chunks(engine, inputs, len(inputs), model, "chat.completion.chunk", "chatcmpl", include_usage)
    prompt_ids = list(inputs[0].input_ids)
    head = [ch.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}], prompt_token_ids=prompt_ids) for i in range(len(inputs))]

    def update(st: StreamState) -> list[dict]:
        step = ch.step(st)
        if step is None:
            return []
        delta, ids, lps, start = step
        c: dict[str, Any] = {"index": st.index, "delta": {"content": delta} if delta else {}, "logprobs": None,
                             "finish_reason": None, "token_ids": ids}
        if logprobs:
            toks = st.texts(engine, start + len(ids))[start:]
            c["logprobs"] = {"content": [
                {"token": t, "logprob": float(x), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                for t, x in zip(toks, lps)
            ]}
        return [ch.chunk([c], **_finish_fields(c, st))]

    return await serve_stream(request, engine, inputs, update, head=head, tail=ch.tail)


def _finish_fields(choice: dict, st: StreamState) -> dict:
    """On a choice's last chunk: its finish_reason and matched_stop, and the chunk's weight_version."""
    if st.result is None:
        return {}
    choice["finish_reason"] = _finish_reason(st.result.finish_reason)
    choice["matched_stop"] = st.result.finish_reason.get("matched")
    return {"weight_version": st.result.weight_version}
