"""Log-prob options of `POST /generate` beyond the sampled tokens', as SGLang has them.

Request (top level, per prompt or one list entry per prompt of a batch; read only with
`return_logprob: true`, ignored otherwise, as SGLang does):

- `logprob_start_len: K` -- also return `meta_info.input_token_logprobs` for the prompt tokens
  from position K on. -1 / null (SGLang's default) means K = prompt length - 1 (K = prompt length
  when `max_new_tokens` is 0); a K past the prompt's last token is refused.
- `top_logprobs_num: N` (0..`MAX_TOP_LOGPROBS_NUM`) -- the N most likely tokens at each output
  position (`output_top_logprobs`) and at each returned prompt position (`input_top_logprobs`).

Response, SGLang's shapes (`[logprob, token_id, text]` triples, text null unless
`return_text_in_logprobs`)::

    input_token_logprobs: [[null, ids[K], t], [lp, ids[K+1], t], ...]   one per ids[K:]
    input_top_logprobs:   [null, [[lp, id, t] x N], ...]                one per ids[K:]  (N > 0)
    output_top_logprobs:  [[[lp, id, t] x N], ...]                      one per output token (N > 0)

The first returned prompt position always has a null log-prob (SGLang computes positions
K+1 .. L-1, each from the tokens before it; `scheduler_output_processor_mixin`: `[None] +
input_token_logprobs[:-1]`), whatever K is. Prompt log-probs are plain `log_softmax(logits)`
(temperature 1: SGLang's logits processor does not temperature-scale them unless
`temp_scaled_logprobs`, which is off by default); the output top log-probs follow the sampled
tokens' convention, `log_softmax(logits / T)`. Top lists are sorted by log-prob, descending.
"""

from __future__ import annotations

from typing import Any, Callable

from slime.engines.protocol.errors import ProtocolError, is_int

MAX_TOP_LOGPROBS_NUM = 20  # vLLM's default --max-logprobs; SGLang sets no cap
Decode = Callable[[list[int]], list[str]]  # token ids -> the text of each token alone


def _per_prompt(value: Any, n: int, is_batch: bool, key: str) -> list:
    if isinstance(value, list):
        if not is_batch:
            raise ProtocolError(key, "must be an integer (a list is for a batch of prompts)")
        if len(value) != n:
            raise ProtocolError(key, f"a list needs one value per prompt ({n}), got {len(value)}")
        return [(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return [(value, key)] * n


def parse_logprob_options(body: dict, n: int, is_batch: bool) -> list[tuple[int, int]]:
    """(logprob_start_len, top_logprobs_num) per prompt from a `/generate` body (defaults -1, 0)."""
    starts = []
    for v, name in _per_prompt(body.get("logprob_start_len"), n, is_batch, "logprob_start_len"):
        if v is None:
            v = -1
        if not is_int(v) or v < -1:
            raise ProtocolError(name, f"must be -1 (the last prompt token only) or an integer >= 0, got {v!r}")
        starts.append(v)
    tops = []
    for v, name in _per_prompt(body.get("top_logprobs_num"), n, is_batch, "top_logprobs_num"):
        if v is None:
            v = 0
        if not is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS_NUM:
            raise ProtocolError(name, f"must be an integer from 0 to {MAX_TOP_LOGPROBS_NUM}, got {v!r}")
        tops.append(v)
    return list(zip(starts, tops))


def logprob_start(requested: int, prompt_len: int, max_new_tokens: int, field: str = "logprob_start_len") -> int:
    """SGLang's first prompt position of `input_token_logprobs` for a request's `logprob_start_len`:
    -1 -> the last prompt token (past it when nothing is generated). ProtocolError when `requested`
    is not below the prompt's length."""
    if requested < 0:
        return prompt_len if max_new_tokens == 0 else prompt_len - 1
    if requested >= prompt_len:
        raise ProtocolError(field, f"{requested} is not below the prompt's length ({prompt_len} tokens); the "
                                   f"prompt's positions are 0..{prompt_len - 1}")
    return requested


def check_logprob_start(inp, prompt_len: int, field: str = "logprob_start_len") -> None:
    """ProtocolError when `inp` asks for log-probs from a position past its prompt."""
    if inp.return_logprob:
        logprob_start(inp.logprob_start_len, prompt_len, inp.sampling_params.max_new_tokens, field)


def scores_prompt(inp, prompt_len: int) -> bool:
    """Whether `inp` needs prompt log-probs computed (a position past its first returned one)."""
    return inp.return_logprob and 0 <= inp.logprob_start_len < prompt_len - 1


def _texts(ids: list[int], decode: Decode | None) -> list:
    return list(decode(ids)) if decode is not None and ids else [None] * len(ids)


def token_triples(values: list[float | None], ids: list[int], decode: Decode | None = None) -> list[list]:
    """`[[logprob | None, token_id, text | None], ...]`."""
    return [[None if v is None else float(v), int(t), s] for v, t, s in zip(values, ids, _texts(ids, decode))]


def top_triples(rows: list[list[tuple[float, int]] | None], decode: Decode | None = None) -> list:
    """Per position: None, or `[[logprob, token_id, text | None] x N]` (sorted as given)."""
    out: list = []
    for row in rows:
        if row is None:
            out.append(None)
        else:
            out.append(token_triples([v for v, _ in row], [t for _, t in row], decode))
    return out


def logprob_meta(*, input_ids: list[int], start: int, input_values: list[float | None],
                 input_top: list | None, output_top: list | None, top_logprobs_num: int,
                 decode: Decode | None = None) -> dict:
    """The `meta_info` entries beyond `output_token_logprobs`: `input_token_logprobs` (aligned with
    `input_ids[start:]`, `input_values` likewise), and with `top_logprobs_num` > 0 `input_top_logprobs`
    and `output_top_logprobs` (`input_top` / `output_top`: per position None or [(logprob, id)])."""
    tail = list(input_ids[start:])
    meta: dict[str, Any] = {"input_token_logprobs": token_triples(list(input_values), tail, decode)}
    if top_logprobs_num > 0:
        meta["input_top_logprobs"] = top_triples(list(input_top or [None] * len(tail)), decode)
        meta["output_top_logprobs"] = top_triples(list(output_top or []), decode)
    return meta
