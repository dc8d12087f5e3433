"""Prompt log-probs and top log-probs of the native engine (`protocol.logprobs` has the protocol).

- Prompt log-probs (`logprob_start_len` K with `return_logprob`): when a request is admitted, the
  worker runs one forward of its prompt alone (no padding, no cache, its LoRA adapter), keeps the
  logits of positions K .. L-2 and gathers `log_softmax(logits)` (temperature 1, as SGLang's prompt
  log-probs) at the tokens K+1 .. L-1, in chunks of `CHUNK` positions. A request with
  `max_new_tokens: 0` finishes there (`score_prompts`): scoring a sequence without generating.
  One sequence per forward, so the numbers do not depend on what else is batched (deterministic
  mode holds), at the price of prefilling a generating request's prompt twice.
- Top log-probs (`top_logprobs_num` N): at every sampled position the N largest entries of
  `log_softmax(logits / T)` (the sampled tokens' convention), recorded as the token is sampled
  (`record_output_top`); for the prompt, the N largest of the same rows as its log-probs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from slime.engines.native.requests import Request
from slime.engines.protocol import GenerateInput, finish_abort, finish_length, logprob_start

if TYPE_CHECKING:  # the engine imports this module
    from slime.engines.native.engine import NativeEngine

CHUNK = 1024  # prompt positions whose full-vocabulary log-softmax is held at once


def logprob_options(inp: GenerateInput) -> dict:
    """The `Request` fields of `inp`'s log-prob options (none unless it returns log-probs)."""
    if not inp.return_logprob:
        return {}
    return {"logprob_start": logprob_start(inp.logprob_start_len, len(inp.input_ids),
                                           inp.sampling_params.max_new_tokens),
            "top_logprobs_num": inp.top_logprobs_num}


def score_prompts(engine: NativeEngine, reqs: list[Request]) -> list[Request]:
    """Compute the prompt log-probs of the admitted requests that ask for them; finish those that
    generate nothing (`max_new_tokens: 0`). Returns the requests that go on to generate."""
    rest = []
    for r in reqs:
        if r.aborted:
            r.finish = finish_abort()
        elif r.scores_prompt:
            _score(engine, r)
            with engine._cv:
                engine._stats["scored_prompt_tokens"] += len(r.input_ids)
        if r.finish is None and r.routed is not None and r.params.max_new_tokens == 0:
            engine.routing.route_prompt(engine, r)  # its routed experts come from a forward of their own
        if r.finish is None and r.params.max_new_tokens > 0:
            rest.append(r)
        else:
            engine._finish(r, r.finish or finish_length(0))
    return rest


@torch.inference_mode()
def _score(engine: NativeEngine, r: Request) -> None:
    L, K, n_top = len(r.input_ids), r.logprob_start, r.top_logprobs_num
    ids = torch.tensor([r.input_ids], dtype=torch.long, device=engine.device)
    with engine._lora_rows([r.lora_name]):
        out = engine.model(input_ids=ids, use_cache=False, logits_to_keep=L - K)
    logits = out.logits[0, :-1]  # [L-K-1, V]: position p predicts token p+1, for p = K .. L-2
    targets = ids[0, K + 1:]
    for a in range(0, logits.shape[0], CHUNK):
        lp = torch.log_softmax(logits[a:a + CHUNK].float(), -1)
        r.input_logprobs.extend(lp.gather(1, targets[a:a + CHUNK, None]).view(-1).tolist())
        if n_top:
            r.input_top.extend(_top_rows(lp, n_top))


def _top_rows(lp: torch.Tensor, n: int) -> list[list[tuple[float, int]]]:
    vals, idx = lp.topk(min(n, lp.shape[-1]), dim=-1)  # sorted, descending
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]


def record_output_top(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Append the top log-probs of each request that asks for them, from its row of `logits` [B, V]
    (the logits its next token is sampled from), at its temperature."""
    for i, r in enumerate(reqs):
        if r.top_logprobs_num:
            row = logits[i:i + 1].float() / r.params.logprob_temperature
            r.output_top.extend(_top_rows(torch.log_softmax(row, -1), r.top_logprobs_num))
