"""Agents written against the `openai` client, captured as trainable Samples.

Agent code talks to the rollout engines through the OpenAI chat API (`openai.AsyncOpenAI`
pointed at `context().openai_base_url`). A `TrajectoryRecorder` hands the agent such a
client whose HTTP transport records every `/v1/chat/completions` (and `/v1/completions`)
exchange: the prompt token ids the server built, the generated token ids and their
log-probs. Every response of slime's native engine carries them (vLLM's
`return_token_ids` layout: top-level `prompt_token_ids` and `choices[0].token_ids`); the
recorder asks for log-probs (`logprobs`) and token ids (`return_token_ids`) on every call.

`to_samples(sample)` turns the recorded calls into training data without re-tokenizing:

- the first call's prompt ids are the Sample's prompt;
- each model output is appended as model tokens (loss mask 1, its log-probs kept);
- a later call whose prompt ids extend the previous prompt + output contributes the
  difference (tool results, user turns, chat-template glue) as environment tokens (mask 0);
- a later call whose prompt does not extend it (the agent rewrote or dropped history, or the
  chat template re-rendered an earlier turn differently) starts a new Sample.

So one episode gives one Sample per contiguous stretch; a custom generate function may
return them all (`run_agent` does). Each call must ask for one choice (`n` = 1).

    from slime.rollout.openai_agent import run_agent

    async def my_agent(client, model, sample):
        r = await client.chat.completions.create(model=model, messages=sample.prompt)
        ...

    async def generate(args, sample, sampling_params):        # --custom-generate-function-path
        return await run_agent(my_agent, args, sample, sampling_params)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import httpx
import openai

from slime.engines.auth import env_api_key
from slime.engines.kinds import POLICY_LORA_NAME
from slime.observability.spans import add_span
from slime.rollout.api import context
from slime.types import Sample, SampleStatus

_STATUS = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@dataclass
class RecordedCall:
    """One model call of an episode: what the server fed the model and what it generated."""

    prompt_ids: list[int]
    output_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    text: str
    weight_version: int | None = None
    started: float = 0.0  # time.time() when the request went out and its answer came back (the timeline)
    finished: float = 0.0


class RecorderError(RuntimeError):
    pass


def _endpoint(path: str) -> str | None:
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    return None


def _version(v) -> int | None:
    return int(v) if v is not None and str(v).isdigit() else None


class TrajectoryRecorder:
    """Records an agent's OpenAI-API calls; `client` is an `openai.AsyncOpenAI` that goes through it.

    `sampling_params` (slime's, as a custom generate function receives them) fill in what a request
    leaves unset: temperature, top_p, top_k, stop, stop_token_ids, the seed (`sampling_seed` + the
    call's number) and max_tokens (`max_new_tokens`). With `max_response_len`, max_tokens is also
    capped to what is left of that response budget after the calls so far.
    """

    def __init__(self, base_url: str, sampling_params: dict | None = None, *, model: str = "default",
                 max_response_len: int | None = None, timeout: float = 600.0, api_key: str | None = None):
        self.calls: list[RecordedCall] = []
        self.model = model
        self.sampling_params = dict(sampling_params or {})
        self.max_response_len = max_response_len
        self._http = httpx.AsyncClient(transport=_RecordingTransport(self, httpx.AsyncHTTPTransport()),
                                       timeout=timeout)
        # the run's engine key (slime.engines.auth); "none" for a server that requires none
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or env_api_key() or "none",
                                         http_client=self._http,
                                         max_retries=0, timeout=timeout)

    async def aclose(self) -> None:
        await self.client.close()
        await self._http.aclose()

    async def __aenter__(self) -> "TrajectoryRecorder":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- the transport's two hooks ----------------------------------------------------------
    def _used(self) -> int:
        """Response tokens of the stretch so far (environment tokens counted up to the last prompt)."""
        if not self.calls:
            return 0
        first, last = self.calls[0], self.calls[-1]
        return len(last.prompt_ids) + len(last.output_ids) - len(first.prompt_ids)

    def _prepare(self, kind: str, body: dict) -> dict:
        body = dict(body)
        n = body.get("n")
        if n not in (None, 1):
            raise RecorderError(f"the trajectory recorder records one choice per call; got n={n}")
        sp = self.sampling_params
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                             ("stop", "stop"), ("stop_token_ids", "stop_token_ids")):
            if sp.get(ours) is not None and body.get(theirs) is None:
                body[theirs] = sp[ours]
        if sp.get("sampling_seed") is not None and body.get("seed") is None:
            body["seed"] = int(sp["sampling_seed"]) + len(self.calls)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        limit = body.get(key)
        if limit is None:
            limit = sp.get("max_new_tokens")
        if self.max_response_len is not None:
            left = max(1, self.max_response_len - self._used())
            limit = left if limit is None else min(int(limit), left)
        if limit is not None:
            body[key] = int(limit)
        if kind == "chat":
            body["logprobs"] = True
            body.pop("top_logprobs", None)
        else:
            body["logprobs"] = 1
        body["return_token_ids"] = True
        return body

    def _record(self, kind: str, data: dict, started: float = 0.0, finished: float = 0.0) -> None:
        try:
            choice = data["choices"][0]
            if kind == "chat":
                prompt_ids = data["prompt_token_ids"]
                content = (choice.get("logprobs") or {}).get("content") or []
                log_probs = [float(t["logprob"]) for t in content]
                text = (choice.get("message") or {}).get("content") or ""
            else:
                prompt_ids = choice["prompt_token_ids"]
                log_probs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
                text = choice.get("text") or ""
            output_ids = choice["token_ids"]
        except (KeyError, IndexError, TypeError) as e:
            raise RecorderError(
                f"the server's {kind} response has no token ids ({type(e).__name__}: {e}); the recorder needs "
                "top-level prompt_token_ids (chat) and choices[0].token_ids, as slime's native engine and vLLM "
                "(return_token_ids) return them") from None
        if prompt_ids is None or output_ids is None:
            raise RecorderError(f"the server's {kind} response has null token ids")
        if len(log_probs) != len(output_ids):
            raise RecorderError(f"the server returned {len(log_probs)} log-probs for {len(output_ids)} tokens")
        self.calls.append(RecordedCall(
            prompt_ids=[int(t) for t in prompt_ids], output_ids=[int(t) for t in output_ids], log_probs=log_probs,
            finish_reason=str(choice.get("finish_reason") or "stop"), text=text,
            weight_version=_version(data.get("weight_version")), started=started, finished=finished))

    # -- the episode as training data -------------------------------------------------------
    def to_samples(self, sample: Sample, tokenizer=None) -> list[Sample]:
        """The recorded episode as Samples (one per stretch of calls whose prompts extend each other).

        Each keeps `sample`'s prompt, label, index, group index and metadata (plus `calls`, the number
        of model calls in it, `segment`/`segments`, and `last_turn`, the text of its last call).
        Past `max_response_len` response tokens a Sample is cut there and marked TRUNCATED."""
        if not self.calls:
            raise RecorderError("the agent made no chat completion calls through the recorder's client")
        stretches: list[list[RecordedCall]] = []
        context: list[int] | None = None
        for call in self.calls:
            if context is None or call.prompt_ids[: len(context)] != context:
                stretches.append([])
            stretches[-1].append(call)
            context = call.prompt_ids + call.output_ids
        out = []
        for k, calls in enumerate(stretches):
            s = Sample(prompt=sample.prompt, label=sample.label, index=sample.index, group_index=sample.group_index,
                       metadata=dict(sample.metadata), tokens=list(calls[0].prompt_ids), loss_mask=[],
                       rollout_log_probs=[])
            for j, call in enumerate(calls):
                if j and call.started > calls[j - 1].finished > 0:  # the agent's own work between two calls
                    add_span(s, "env", calls[j - 1].finished, call.started, name="agent")
                if call.finished:
                    add_span(s, "generate", call.started, call.finished, weight_version=call.weight_version,
                             tokens=len(call.output_ids))
                s.append_env_tokens(call.prompt_ids[len(s.tokens):])
                s.append_model_tokens(call.output_ids, call.log_probs)
                s.status = _STATUS.get(call.finish_reason, SampleStatus.COMPLETED)
                s.weight_version = call.weight_version
                if call.weight_version is not None and s.weight_versions[-1:] != [call.weight_version]:
                    s.weight_versions = s.weight_versions + [call.weight_version]
            if self.max_response_len is not None and s.response_length > self.max_response_len:
                cut = s.response_length - self.max_response_len
                s.tokens, s.response_length = s.tokens[:-cut], self.max_response_len
                s.loss_mask, s.rollout_log_probs = s.loss_mask[:-cut], s.rollout_log_probs[:-cut]
                s.status = SampleStatus.TRUNCATED
            s.response = (tokenizer.decode(s.response_tokens, skip_special_tokens=False) if tokenizer is not None
                          else "".join(c.text for c in calls))
            s.metadata.update(calls=len(calls), segment=k, segments=len(stretches), last_turn=calls[-1].text)
            out.append(s)
        return out


class _RecordingTransport:
    """An httpx async transport that completes the recorder's requests and records the answers."""

    def __init__(self, recorder: TrajectoryRecorder, inner):
        self.recorder, self.inner = recorder, inner

    async def handle_async_request(self, request):
        kind = _endpoint(request.url.path)
        if request.method != "POST" or kind is None:
            return await self.inner.handle_async_request(request)
        body = self.recorder._prepare(kind, json.loads(await request.aread()))
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
        sent = httpx.Request(request.method, request.url, headers=headers, content=json.dumps(body).encode(),
                             extensions=request.extensions)
        started = time.time()
        response = await self.inner.handle_async_request(sent)
        if response.status_code != 200:
            return response
        raw = await response.aread()
        await response.aclose()
        self.recorder._record(kind, json.loads(raw), started, time.time())
        drop = (b"content-length", b"content-encoding", b"transfer-encoding")
        return httpx.Response(response.status_code, content=raw, extensions=response.extensions,
                              headers=[(k, v) for k, v in response.headers.raw if k.lower() not in drop])

    async def aclose(self) -> None:
        await self.inner.aclose()


Agent = Callable[[Any, str, Sample], Awaitable[Any]]


async def run_agent(agent: Agent, args, sample: Sample, sampling_params: dict, *, base_url: str | None = None,
                    tokenizer=None) -> list[Sample]:
    """Run `await agent(client, model, sample)` with a recording client and return the episode's Samples.

    `client` is an `openai.AsyncOpenAI` pointed at the rollout engines (`context().openai_base_url`
    unless `base_url` is given), `model` the name to pass as `model=`. Whatever the agent returns is
    kept in every Sample's `metadata["agent_result"]` (a reward function can read it). An agent that
    raises after at least one call gives its Samples so far, with `agent_result` None and the error
    in `metadata["agent_error"]`; one that raises before any call fails the rollout. The response
    budget is `sampling_params["max_new_tokens"]` (--rollout-max-response-len, or the eval one)."""
    if base_url is None or tokenizer is None:
        ctx = context()
        base_url = base_url or ctx.openai_base_url
        tokenizer = tokenizer if tokenizer is not None else ctx.tokenizer
    budget = sampling_params.get("max_new_tokens") or args.rollout_max_response_len
    # --lora-sync adapter: the policy is the engines' base plus the trained adapter, which OpenAI
    # routes select by its name in `model` (vLLM's convention, the native engine's too)
    model = POLICY_LORA_NAME if getattr(args, "lora_sync", None) == "adapter" else str(args.hf_checkpoint)
    recorder = TrajectoryRecorder(base_url, sampling_params, model=model,
                                  max_response_len=budget, timeout=float(args.rollout_request_timeout))
    error = None
    async with recorder:
        try:
            result = await agent(recorder.client, recorder.model, sample)
        except Exception as e:  # an agent that fails after some calls still made training data
            if not recorder.calls:
                raise
            result, error = None, f"{type(e).__name__}: {e}"
    samples = recorder.to_samples(sample, tokenizer)
    for s in samples:
        s.metadata["agent_result"] = result
        if error is not None:
            s.metadata["agent_error"] = error
    return samples
