"""slime's (SGLang's) prompt and top log-probs <-> vLLM's `/v1/completions`: pure translation (no I/O).

Request (with `return_logprob`; `protocol.logprobs` has the protocol):

    top_logprobs_num N            -> logprobs = N (vLLM returns the sampled token plus the N most
                                     likely at each output position)
    logprob_start_len K (>= 0,    -> prompt_logprobs = N (vLLM returns every prompt position but
      below the last position)       the first: the prompt token plus the N most likely)
    max_new_tokens 0 with K       -> max_tokens = 1, temperature 0 (vLLM generates at least one
                                     token); the token is dropped from the answer

With N > 0 vLLM is asked for token ids (`return_tokens_as_token_ids`), since its top entries
are keyed by the token's text otherwise; texts (`return_text_in_logprobs`) then come from the
adapter's tokenizer (`decode`).

Response: vLLM's `prompt_logprobs` (a list over prompt positions, each null or
`{"<id>": {"logprob", "rank", "decoded_token"}}`) gives the prompt token's log-prob at each
position K+1 .. L-1 and the N largest entries; `logprobs.top_logprobs` (a list over output tokens
of `{"token_id:<id>": logprob}`) the output's. Both are sorted by log-prob, descending, and cut
to N. vLLM computes prompt log-probs from the raw logits (temperature 1, as SGLang) whatever its
`--logprobs-mode`; output ones follow `--logprobs-mode` (slime's default `processed_logprobs`:
after temperature and any top-k / top-p masking).
"""

from __future__ import annotations

from typing import Any

from slime.engines.protocol import GenerateInput, logprob_meta, logprob_start
from slime.engines.protocol.logprobs import Decode


class LogprobsError(RuntimeError):
    """vLLM's log-probs are not what was asked for (translated to `UpstreamError` by the caller)."""


def wants_prompt_logprobs(inp: GenerateInput) -> bool:
    """Whether vLLM must compute prompt log-probs for `inp` (unknown prompt length: a text prompt)."""
    if not inp.return_logprob or inp.logprob_start_len < 0:
        return False
    return inp.input_ids is None or inp.logprob_start_len < len(inp.input_ids) - 1


def token_ids_mode(inp: GenerateInput) -> bool:
    """Whether vLLM names log-prob tokens by id (`return_tokens_as_token_ids`)."""
    return not inp.return_text_in_logprobs or inp.top_logprobs_num > 0


def logprob_params(inp: GenerateInput) -> dict:
    """The completions body's log-prob entries for `inp` (none unless it returns log-probs)."""
    if not inp.return_logprob:
        return {}
    body: dict[str, Any] = {"logprobs": inp.top_logprobs_num, "return_tokens_as_token_ids": token_ids_mode(inp)}
    if wants_prompt_logprobs(inp):
        body["prompt_logprobs"] = inp.top_logprobs_num
    if inp.sampling_params.max_new_tokens == 0:  # scoring: vLLM generates at least one token, dropped
        body.update(max_tokens=1, temperature=0.0)  # greedy: vLLM drops top_k / top_p for it
    return body


def _entry_id(key: Any) -> int:
    s = str(key)
    if s.startswith("token_id:"):
        s = s[len("token_id:"):]
    try:
        return int(s)
    except ValueError:
        raise LogprobsError(f"vLLM named a log-prob token {str(key)[:80]!r}, not by id") from None


def _value(v: Any) -> float:
    lp = v.get("logprob") if isinstance(v, dict) else v
    if not isinstance(lp, (int, float)) or isinstance(lp, bool):
        raise LogprobsError(f"vLLM returned a log-prob that is not a number: {str(v)[:80]}")
    return float(lp)


def _top(entries: dict, n: int) -> list[tuple[float, int]]:
    """The `n` largest of one position's `{key: logprob | {"logprob": ...}}`, descending."""
    pairs = sorted(((_value(v), _entry_id(k)) for k, v in entries.items()), key=lambda p: (-p[0], p[1]))
    return pairs[:n]


def prompt_logprobs_of(choice: dict, prompt_ids: list[int], start: int, n: int) -> tuple[list, list | None]:
    """(values, top) aligned with `prompt_ids[start:]` from vLLM's `prompt_logprobs`: the first value
    None (SGLang's), then each prompt token's log-prob; top: None, then the `n` largest (n > 0)."""
    rows = choice.get("prompt_logprobs")
    L = len(prompt_ids)
    if not isinstance(rows, list) or len(rows) != L:
        raise LogprobsError(f"vLLM returned {len(rows) if isinstance(rows, list) else 'no'} prompt log-prob "
                            f"positions for a prompt of {L} tokens")
    values: list[float | None] = [None]
    top: list | None = [None] if n else None
    for p in range(start + 1, L):
        row = rows[p]
        if not isinstance(row, dict):
            raise LogprobsError(f"vLLM returned no prompt log-probs at position {p}")
        by_id = {_entry_id(k): v for k, v in row.items()}
        if prompt_ids[p] not in by_id:
            raise LogprobsError(f"vLLM's prompt log-probs at position {p} lack the prompt token {prompt_ids[p]}")
        values.append(_value(by_id[prompt_ids[p]]))
        if top is not None:
            top.append(_top(row, n))
    return values[: L - start], (top[: L - start] if top is not None else None)


def output_top_of(choice: dict, num_tokens: int, n: int) -> list:
    """The `n` largest log-probs at each of the first `num_tokens` output positions (vLLM's
    `logprobs.top_logprobs`, keyed `token_id:<id>`)."""
    rows = (choice.get("logprobs") or {}).get("top_logprobs")
    if not isinstance(rows, list) or len(rows) < num_tokens:
        raise LogprobsError(f"vLLM returned {len(rows) if isinstance(rows, list) else 'no'} top log-prob "
                            f"positions for {num_tokens} tokens")
    out = []
    for row in rows[:num_tokens]:
        if not isinstance(row, dict):
            raise LogprobsError("vLLM returned a null top log-prob position for a generated token")
        out.append(_top(row, n))
    return out


def extra_logprob_meta(inp: GenerateInput, choice: dict, prompt_ids: list[int], num_output: int,
                       decode: Decode | None) -> dict:
    """`input_token_logprobs` (and with `top_logprobs_num` the top lists) of `inp`'s answer."""
    n = inp.top_logprobs_num
    start = logprob_start(inp.logprob_start_len, len(prompt_ids), inp.sampling_params.max_new_tokens)
    if wants_prompt_logprobs(inp) and start < len(prompt_ids) - 1:
        values, in_top = prompt_logprobs_of(choice, prompt_ids, start, n)
    else:  # the first returned position only (its value is None), or none
        values, in_top = [None] * (len(prompt_ids) - start), ([None] * (len(prompt_ids) - start) if n else None)
    out_top = output_top_of(choice, num_output, n) if n and num_output else []
    return logprob_meta(input_ids=prompt_ids, start=start, input_values=values, input_top=in_top, output_top=out_top,
                        top_logprobs_num=n, decode=decode if inp.return_text_in_logprobs else None)
