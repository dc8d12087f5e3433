"""One generation request inside the native engine: its state, finish rules and result."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from slime.engines.protocol import SamplingParams, finish_abort, finish_length, finish_stop

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    rid: str
    output_ids: list[int]
    text: str
    finish_reason: dict
    prompt_tokens: int
    weight_version: str
    output_token_logprobs: list[float]
    # with return_logprob (`protocol.logprobs`): SGLang's first prompt position of the input log-probs,
    # their values from there (the first None), per position None or [(logprob, id)] x top_logprobs_num
    logprob_start: int | None = None
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list | None = None
    output_top_logprobs: list | None = None
    # with return_routed_experts (`routing.py`): Tensor[len(prompt) + len(output) - 1, MoE layers, top-k] int32
    routed_experts: torch.Tensor | None = None
    # seconds: submit -> admitted into a batch, admitted -> first token sampled, submit -> complete
    # (meta_info `queue_time`, `prefill_time`, `e2e_latency`: the rollout timeline's split); None when
    # the request never got there (aborted while waiting)
    queue_time: float | None = None
    prefill_time: float | None = None
    e2e_latency: float | None = None


Callback = Callable[[GenerationResult | None, BaseException | None], None]
# on_token(token_ids, logprobs): tokens that did not end their request, as they are sampled
TokenHook = Callable[[list[int], list[float]], None]


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    callback: Callback
    generator: torch.Generator | None = None
    on_token: TokenHook | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with, looked up by name at every step
    logprob_start: int | None = None  # with return_logprob: SGLang's first prompt position of input log-probs
    top_logprobs_num: int = 0  # with return_logprob: top tokens recorded per position
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)  # prompt positions logprob_start+1 .. on
    input_top: list = field(default_factory=list)  # [(logprob, id)] x top_logprobs_num, the same positions
    output_top: list = field(default_factory=list)  # [(logprob, id)] x top_logprobs_num per output token
    routed: list[torch.Tensor] | None = None  # with return_routed_experts: its rows [n, layers, top-k] (`routing.py`)
    # with image_data (`vision.py`): the sources, their pixel inputs, and the rope delta of its decode positions
    image_sources: list | None = None
    pixels: dict | None = None
    rope_delta: int = 0
    finish: dict | None = None
    aborted: bool = False
    done: bool = False
    # time.perf_counter() when it was submitted, admitted into a batch, and its first token sampled
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    first_token: float | None = None
    # stop strings: the output's text, decoded incrementally (each token decodes a few tokens, not
    # the whole output): text so far, and the token offsets of the last decode's context and end
    _text: str = ""
    _prefix_offset: int = 0
    _read_offset: int = 0

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's log-probs are computed (a position past the first returned one is asked for)."""
        return self.logprob_start is not None and self.logprob_start < len(self.input_ids) - 1

    def add_token(self, t: int, eos_token_ids: set[int], max_context_length: int, tokenizer) -> None:
        """Append a sampled token (its log-prob is already in `logprobs`) and apply the finish
        rules in SGLang's order: length, then EOS / stop tokens (unless ignore_eos), then stop
        strings. Tokens that do not end the request go to `on_token`."""
        self.output_ids.append(t)
        if self.first_token is None:
            self.first_token = time.perf_counter()
        if self.finish is not None:
            return
        if self.aborted:
            self.finish = finish_abort()
            return
        sp = self.params
        n_out = len(self.output_ids)
        if n_out >= sp.max_new_tokens or len(self.input_ids) + n_out >= max_context_length:
            self.finish = finish_length(len(self.output_ids))
        elif not sp.ignore_eos and (t in eos_token_ids or t in sp.stop_token_ids):
            self.finish = finish_stop(t)
        elif sp.stop:
            matched = self._match_stop(sp.stop, tokenizer, sp.skip_special_tokens)
            if matched is not None:
                self.finish = finish_stop(matched)
        if self.finish is None and self.on_token is not None:
            try:
                self.on_token([t], self.logprobs[len(self.output_ids) - 1 : len(self.output_ids)])
            except Exception:  # noqa: BLE001 - a streamer's bug must not fail the batch
                logger.exception("on_token hook failed")

    def _match_stop(self, stops: list[str], tokenizer, skip_special_tokens: bool) -> str | None:
        """The stop string that the newest token completes (the one starting first), or None.

        The text grows by what the new token adds: the tokens since the previous decode's context
        decoded with and without it (as vLLM detokenizes incrementally; a token that ends inside a
        multi-byte character adds nothing until the character is whole, so a stop string right
        before such a token matches once the character completes, as in SGLang's and vLLM's
        detokenizers), and only the tail that could hold a newly completed stop string is searched."""
        ids = self.output_ids
        before = tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip_special_tokens)
        after = tokenizer.decode(ids[self._prefix_offset :], skip_special_tokens=skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        new = after[len(before) :]
        self._text += new
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        start = max(0, len(self._text) - len(new) - max(len(s) for s in stops) + 1)
        best = None
        for s in stops:
            k = self._text.find(s, start)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, s)
        return best[1] if best is not None else None

    def complete(self, finish: dict, weight_version: str, tokenizer) -> None:
        """Build the result (text trimmed at a matched stop unless no_stop_trim) and call the
        callback, once."""
        if self.done:
            return
        self.done = True
        try:
            sp = self.params
            ids = self.output_ids
            # logprobs/output_ids may be one longer than each other only transiently
            lps = self.logprobs[: len(ids)]
            matched = finish.get("matched")
            text_ids = ids
            if isinstance(matched, int) and finish["type"] == "stop" and not sp.no_stop_trim and ids:
                text_ids = ids[:-1]
            text = tokenizer.decode(text_ids, skip_special_tokens=sp.skip_special_tokens) if text_ids else ""
            if isinstance(matched, str) and not sp.no_stop_trim and matched in text:
                text = text[: text.find(matched)]  # the output decoded once, cut where the stop string starts
            res = GenerationResult(
                rid=self.rid,
                output_ids=list(ids),
                text=text,
                finish_reason=finish,
                prompt_tokens=len(self.input_ids),
                weight_version=weight_version,
                output_token_logprobs=list(lps),
                e2e_latency=time.perf_counter() - self.submitted,
            )
            if self.admitted is not None:
                res.queue_time = self.admitted - self.submitted
                if self.first_token is not None:
                    res.prefill_time = self.first_token - self.admitted
            if self.logprob_start is not None:
                n_in = len(self.input_ids) - self.logprob_start
                res.logprob_start = self.logprob_start
                res.input_token_logprobs = ([None] + self.input_logprobs)[:n_in]
                if self.top_logprobs_num:
                    res.input_top_logprobs = ([None] + self.input_top)[:n_in]
                    res.output_top_logprobs = self.output_top[: len(ids)]
            if self.routed is not None:
                res.routed_experts = torch.cat(self.routed) if self.routed else None  # None: no forward saw it
        except BaseException as e:  # noqa: BLE001
            self.callback(None, e)
            return
        try:
            self.callback(res, None)
        except Exception:  # noqa: BLE001
            logger.exception("callback failed")


def eos_token_ids(tokenizer, model) -> set[int]:
    """The token ids that end a request: the tokenizer's, the model config's and its generation config's EOS."""
    ids: set[int] = set()

    def add(v):
        if v is None:
            return
        if isinstance(v, (list, tuple, set)):
            for x in v:
                add(x)
        elif isinstance(v, int):
            ids.add(int(v))

    add(tokenizer.eos_token_id)
    add(getattr(model.config, "eos_token_id", None))
    gc = getattr(model, "generation_config", None)
    if gc is not None:
        add(getattr(gc, "eos_token_id", None))
    return ids
