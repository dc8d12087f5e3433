"""What custom rollout code gets: the run's context and token-in/token-out engine calls.

Custom functions (`--custom-generate-function-path`, `--custom-rm-path`,
`--rollout-function-path`, `--eval-function-path`, `--data-source-path`; signatures in
docs/custom_rollout.md) run inside the RolloutManager process. There they reach the engines
through the router with token ids in and token ids out:

    from slime.rollout.api import context, generate_tokens, continue_sample, sample_span

    async def generate(args, sample, sampling_params):
        out = await continue_sample(sample, sampling_params)   # model tokens appended, mask 1
        ...
        with sample_span(sample, "tool", name="search"):        # a timeline span (docs/timeline.md)
            tool_ids = ...
        sample.append_env_tokens(tool_ids)                       # tool tokens, mask 0

`context()` holds the args, the tokenizer, the engine pool, the OpenAI-compatible base URL
(for agent code using the `openai` client) and the `--custom-config-path` values. Models served
beside the policy (`--sglang-config`: a teacher, a judge, a reward model) are reached by name:
`context().model(name)` is that model's engine pool (`await pool.generate(payload)`, or pass it as
`engines=` to `generate_tokens`), `get_model_url(args, name, "/generate")` the URL of its router.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from slime.engines.control import Route
from slime.observability import spans
from slime.types import Sample, SampleStatus
from slime.utils.vision import inline_source

sample_span = spans.sample_span  # `with sample_span(sample, "tool", name=...)`: custom code's timeline spans


@dataclass
class EngineOutput:
    """One engine call's result: the generated token ids, their log-probs and why it stopped."""

    output_ids: list[int]
    text: str
    log_probs: list[float]
    finish_reason: str  # "stop", "length" or "abort"
    weight_version: int | None = None
    prompt_tokens: int = 0
    # the experts every token that went through a forward was routed to: Tensor[prompt + output - 1,
    # MoE layers, top-k] (--use-rollout-routing-replay; SGLang's `routed_experts`), else None
    routed_experts: Any = None
    # the timeline (slime.observability.spans): when the client sent the request and got the answer
    # (time.time()), the engine that served it and its timing (queue_time, prefill_time, e2e_latency
    # in seconds) where the engine reports them (the native engine does)
    started: float = 0.0
    finished: float = 0.0
    engine: str | None = None
    timing: dict[str, float] = field(default_factory=dict)


@dataclass
class RolloutContext:
    args: Any
    tokenizer: Any
    engines: Any  # slime.engines.router.EnginePool (or the router in front of the engines)
    base_url: str  # the URL generation goes to; OpenAI clients use base_url + "/v1"
    custom_config: dict[str, Any] = field(default_factory=dict)
    loop: Any = None  # the rollout's event loop (the engine clients live on it)
    models: dict[str, Any] = field(default_factory=dict)  # served model name -> its engine pool (the policy's too)

    def model(self, name: str):
        """The engine pool of the served model `name` (`--sglang-config`; the policy under its own
        name): `await ctx.model("teacher").generate(payload)`."""
        if name not in self.models:
            raise KeyError(f"no served model named {name!r}; this run serves {sorted(self.models) or 'none yet'} "
                           "(--sglang-config)")
        return self.models[name]

    def model_url(self, name: str) -> str:
        """The URL of the router in front of model `name`'s engines (requests need `api_key`)."""
        return self.model(name).router_url

    @property
    def openai_base_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1"

    @property
    def api_key(self) -> str:
        """The run's engine key: `openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key)`,
        or the header `Authorization: Bearer <key>` for a raw HTTP call (docs/security.md)."""
        return self.args.engine_api_key

    def run(self, coro):
        """Run a coroutine on the rollout's event loop from synchronous custom code (e.g. a sync
        `--rollout-function-path` function calling `generate_tokens`) and return its result."""
        if self.loop is None:
            raise RuntimeError("no rollout event loop yet (the engines are not up)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_CONTEXT: RolloutContext | None = None


def set_context(ctx: RolloutContext | None) -> None:
    """Called by the RolloutManager once its engines are up."""
    global _CONTEXT
    _CONTEXT = ctx


def context() -> RolloutContext:
    if _CONTEXT is None:
        raise RuntimeError("slime.rollout.api.context() is only available inside a rollout "
                           "(the RolloutManager sets it once the engines are up)")
    return _CONTEXT


def get_model_url(args, name: str, endpoint: str = Route.GENERATE.value[1]) -> str:
    """Original slime's helper: the URL of `endpoint` on the router of the served model `name`
    (`--sglang-config`), e.g. `get_model_url(args, "teacher", "/generate")`. Calls need the run's key
    (`context().api_key`). An unknown name raises KeyError naming the served models."""
    return context().model_url(name).rstrip("/") + endpoint


def parse_engine_output(out: dict) -> EngineOutput:
    """An SGLang-native `/generate` response -> EngineOutput (checks log-probs match the tokens)."""
    meta = out["meta_info"]
    output_ids = [int(t) for t in out["output_ids"]]
    log_probs = [float(lp[0]) for lp in meta.get("output_token_logprobs", [])]
    if len(log_probs) != len(output_ids):
        raise RuntimeError(f"engine returned {len(log_probs)} log-probs for {len(output_ids)} tokens")
    version = meta.get("weight_version")
    prompt_tokens = int(meta.get("prompt_tokens", 0))
    return EngineOutput(
        output_ids=output_ids, text=out.get("text", ""), log_probs=log_probs,
        finish_reason=meta["finish_reason"]["type"],
        weight_version=int(version) if version is not None and str(version).isdigit() else None,
        prompt_tokens=prompt_tokens,
        routed_experts=_routed_experts(meta, prompt_tokens + len(output_ids) - 1),
        engine=meta.get("engine_url"),
        timing={k: float(meta[k]) for k in TIMING_KEYS if isinstance(meta.get(k), (int, float))},
    )


TIMING_KEYS = ("queue_time", "prefill_time", "e2e_latency")  # meta_info seconds (SGLang's e2e_latency)


def _routed_experts(meta: dict, rows: int):
    """meta_info's `routed_experts` (base64 of int32 [rows, layers, top-k]) as a Tensor, or None (none
    returned, or none recorded)."""
    data = meta.get("routed_experts")
    if data is None:
        return None
    if int(meta.get("routed_experts_start_len", 0) or 0) != 0:
        raise RuntimeError("engine returned routed experts from a later start (routed_experts_start_len); slime "
                           "asks for every token's")
    raw = base64.b64decode(data)
    if not raw:  # no forward saw the request (aborted while it waited): the sample keeps the routing it has
        return None
    flat = torch.frombuffer(bytearray(raw), dtype=torch.int32)
    if rows < 1 or flat.numel() % rows:
        raise RuntimeError(f"engine returned {flat.numel()} routed expert ids for {rows} tokens")
    return flat.reshape(rows, -1)


async def generate_tokens(input_ids: list[int], sampling_params: dict, engines=None,
                          image_data: list | None = None) -> EngineOutput:
    """Continue `input_ids` with one `/generate` call through the router (token ids in and out);
    `image_data`: the prompt's images (a vision-language model's `Sample.images`)."""
    engines = engines if engines is not None else context().engines
    started = time.time()
    body = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params), "return_logprob": True}
    if image_data:  # local files travel as their bytes: the engine may run on another machine
        body["image_data"] = [inline_source(x) for x in image_data]
    out = await engines.generate(body)
    finished = time.time()
    out = parse_engine_output(out)
    out.started, out.finished = started, finished
    return out


def record_engine_call(sample: Sample, out: EngineOutput) -> None:
    """The timeline spans of one `generate_tokens` call on `sample` (queued/prefill/decode, or one
    `generate` span when the engine reports no split); `continue_sample` calls it."""
    spans.add_engine_call(sample, out.started, out.finished, out.timing, engine=out.engine,
                          weight_version=out.weight_version, tokens=len(out.output_ids))


STATUS_OF_FINISH = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


async def continue_sample(sample: Sample, sampling_params: dict, engines=None) -> EngineOutput:
    """Generate from everything the sample holds so far (prompt and earlier turns), append the new
    tokens as model tokens (loss mask 1, log-probs kept) and set the sample's status and weight
    version from this call. Returns the call's output (its `text` is this turn's text)."""
    out = await generate_tokens(sample.tokens, sampling_params, engines, image_data=sample.images)
    record_engine_call(sample, out)
    sample.append_model_tokens(out.output_ids, out.log_probs)
    if out.routed_experts is not None:  # every token's experts so far (this call saw the whole sequence)
        sample.rollout_routed_experts = out.routed_experts
    sample.status = STATUS_OF_FINISH.get(out.finish_reason, SampleStatus.COMPLETED)
    sample.weight_version = out.weight_version
    if out.weight_version is not None and (not sample.weight_versions or sample.weight_versions[-1] != out.weight_version):
        sample.weight_versions = sample.weight_versions + [out.weight_version]
    return out
