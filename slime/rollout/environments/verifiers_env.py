"""`verifiers` environments as slime rollouts: the environment's own loop and rubric, the run's engines.

    --custom-generate-function-path slime.rollout.environments.verifiers_env.generate
    --env-id wordle --env-args '{"num_train_examples": 200}'       # slime.environment_flags

Any installed verifiers environment (the classic API that environment packages implement:
`load_environment(**env_args) -> vf.Environment`; single-turn, multi-turn and tool environments
alike) runs unchanged. Its OpenAI client is `slime.rollout.openai_agent`'s recording client pointed
at the run's engines, wrapped in verifiers' own chat (or completions) client, so each model call's
prompt ids, output ids and log-probs are recorded as the server produced them, and verifiers records
the same tokens in its trajectory (`state["trajectory"][i]["tokens"]`). `generate` then:

- runs `env.rollout(input, client, model, sampling_args)` and scores it with the environment's
  rubric (`env.rubric.score_rollout`), as verifiers' own `run_rollout` does;
- turns the recorded calls into Samples (`TrajectoryRecorder.to_samples`): the first prompt is the
  prompt, each reply is model tokens (loss mask 1, its log-probs), what a later prompt adds (the
  environment's turns, tool results, template glue) is environment tokens (loss mask 0); a prompt
  that does not extend the previous one starts another Sample;
- keeps the rubric's reward in `metadata["env_reward"]` and its metrics in `metadata["env_metrics"]`;
  `reward` (the default `--custom-rm-path` with `--env-id`) returns it.

The input of an episode is the Sample's `metadata["vf_input"]` (a row of the environment's dataset,
which `VerifiersDataSource`, the default `--data-source-path` without `--prompt-data`, serves), else
the Sample's prompt (a string becomes one user message), label (`answer`) and `metadata["info"]`.
Group-level rubric functions (scored over a group of rollouts) are not supported: the rubric must
score each rollout by itself.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import types
from typing import Any

from transformers import AutoTokenizer

from slime.data.dataset import Prompt
from slime.data.source import RolloutDataSource
from slime.environment_flags import VERIFIERS_PIP, validate_verifiers_id
from slime.engines.kinds import POLICY_LORA_NAME
from slime.rollout.api import context
from slime.rollout.openai_agent import RecordedCall, TrajectoryRecorder
from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError
from slime.utils.hooks import load_function

INPUT_KEYS = ("prompt", "answer", "info", "task", "example_id")


def _verifiers():
    try:
        import verifiers as vf  # optional dependency: only runs that use a verifiers environment need it
    except ImportError:
        raise SlimeConfigError(f"the verifiers adapter needs the `verifiers` package: {VERIFIERS_PIP}") from None
    if not hasattr(vf, "load_environment") or not hasattr(vf, "OpenAIChatCompletionsClient"):
        raise SlimeConfigError(f"verifiers {getattr(vf, '__version__', '?')} is not supported: the adapter needs the "
                               "classic environment API (load_environment, Environment.rollout) with its client "
                               f"classes (verifiers 0.3; 0.4 moved to verifiers.v1): {VERIFIERS_PIP}")
    return vf


@contextlib.contextmanager
def _keep_signal_handlers(vf):
    """verifiers' Environment installs SIGINT/SIGTERM handlers when built (to tear itself down), which fails
    off the main thread (a Ray actor's method) and would take the rollout process's signals from Ray: while
    the environment is built, its module's `signal.signal` does nothing (its atexit teardown stays)."""
    module = sys.modules.get(vf.Environment.__module__)
    real = getattr(module, "signal", None)
    if real is None:
        yield
        return
    module.signal = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    module.signal.signal = lambda *a, **k: None
    try:
        yield
    finally:
        module.signal = real


@functools.lru_cache(maxsize=None)
def _load(env_id: str, env_args_json: str):
    vf = _verifiers()
    env_args = json.loads(env_args_json)
    validate_verifiers_id(env_id)
    with _keep_signal_handlers(vf):
        return _build(vf, env_id, env_args)


def _build(vf, env_id: str, env_args: dict):
    if env_id.endswith(".py"):  # an environment written next to the run (examples/verifiers_env/)
        env = load_function(f"{env_id}:load_environment", "--env-id")(**env_args)
    else:
        env = vf.load_environment(env_id, **env_args)
    if not isinstance(env, vf.Environment):
        raise SlimeConfigError(f"--env-id {env_id}: load_environment returned {type(env).__name__}, "
                               "not a verifiers Environment")
    return env


def load_environment(env_id: str, env_args: dict | None = None):
    """The verifiers Environment of `env_id` with `env_args` (loaded once per process and arguments)."""
    return _load(env_id, json.dumps(env_args or {}, sort_keys=True))


def rollout_input(sample: Sample) -> dict[str, Any]:
    """The verifiers RolloutInput of a Sample (module docstring)."""
    given = sample.metadata.get("vf_input")
    if isinstance(given, dict):
        inp = dict(given)
    else:
        prompt = sample.prompt if isinstance(sample.prompt, list) else [{"role": "user", "content": str(sample.prompt)}]
        inp = {"prompt": prompt}
        if sample.label is not None:
            inp["answer"] = str(sample.label)
        for key in ("info", "task"):
            if sample.metadata.get(key) is not None:
                inp[key] = sample.metadata[key]
    inp.setdefault("example_id", sample.index if sample.index is not None else 0)
    return inp


async def run_episode(env, client, model: str, inp: dict[str, Any], max_tokens: int | None = None):
    """One episode of `env` with the OpenAI client `client`, scored by the environment's rubric, as
    verifiers' `Environment.run_rollout` runs it (`max_tokens` per turn unless the environment sets its
    own). Returns verifiers' State."""
    vf = _verifiers()
    wrap = vf.OpenAICompletionsClient if env.message_type == "completion" else vf.OpenAIChatCompletionsClient
    sampling_args = {k: v for k, v in env.sampling_args.items() if k != "extra_body" or v}
    if max_tokens is not None:
        sampling_args.setdefault("max_tokens", max_tokens)
    state = await env.rollout(inp, wrap(client), model, sampling_args)
    if env.score_rollouts:
        await env.rubric.score_rollout(state)
    else:
        await env.rubric.dummy_score_rollout(state)
    await env.rubric.cleanup(state)
    return state


def episode_summary(state) -> dict[str, Any]:
    """What Samples keep of a verifiers State (plain values only)."""
    error = state.get("error")
    return {"reward": None if state.get("reward") is None else float(state["reward"]),
            "metrics": {k: float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, (int, float))},
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "stop_condition": state.get("stop_condition"), "turns": len(state.get("trajectory") or []),
            "truncated": bool(state.get("is_truncated"))}


def _in_trajectory(calls: list[RecordedCall], trajectory) -> list[RecordedCall]:
    """The recorded calls that are steps of the environment's trajectory, in order. A call the environment
    dropped (an empty reply it rejected, say: the episode then ends with an error) is not trained on."""
    steps = [t.get("tokens") for t in trajectory]
    if any(t is None for t in steps):
        return calls
    kept, i = [], 0
    for call in calls:
        step = steps[i] if i < len(steps) else None
        if step is not None and (call.prompt_ids, call.output_ids) == (step["prompt_ids"], step["completion_ids"]):
            kept.append(call)
            i += 1
    return kept


async def generate(args, sample: Sample, sampling_params: dict) -> list[Sample]:
    """`--custom-generate-function-path`: one episode of `--env-id` for `sample` (module docstring)."""
    samples, _ = await episode(args, sample, sampling_params)
    return samples


async def episode(args, sample: Sample, sampling_params: dict, *, base_url: str | None = None,
                  tokenizer=None) -> tuple[list[Sample], Any]:
    """One episode of `--env-id` for `sample`: its Samples and verifiers' State (the environment's own
    record of it). `base_url`/`tokenizer` default to the rollout's (`context()`)."""
    env = load_environment(args.env_id, args.env_args)
    if base_url is None or tokenizer is None:
        ctx = context()
        base_url, tokenizer = base_url or ctx.openai_base_url, tokenizer if tokenizer is not None else ctx.tokenizer
    # --lora-sync adapter: the policy is the engines' base plus the adapter, chosen by its name (as run_agent)
    model = POLICY_LORA_NAME if getattr(args, "lora_sync", None) == "adapter" else str(args.hf_checkpoint)
    budget = sampling_params.get("max_new_tokens") or args.rollout_max_response_len
    async with TrajectoryRecorder(base_url, sampling_params, model=model, max_response_len=budget,
                                  timeout=float(args.rollout_request_timeout)) as rec:
        state = await run_episode(env, rec.client, rec.model, rollout_input(sample), args.env_max_tokens_per_turn)
    summary = episode_summary(state)
    rec.calls = _in_trajectory(rec.calls, state.get("trajectory") or [])
    if not rec.calls:
        raise RuntimeError(f"verifiers environment {args.env_id}: the episode has no model turn "
                           f"({summary['error'] or 'no call reached the engines'})")
    samples = rec.to_samples(sample, tokenizer)
    for s in samples:
        s.metadata.update(env_reward=summary["reward"], env_metrics=summary["metrics"], env_turns=summary["turns"],
                          env_stop=summary["stop_condition"])
        if summary["error"]:
            s.metadata["env_error"] = summary["error"]
        if summary["truncated"] and s.status == SampleStatus.COMPLETED:
            s.status = SampleStatus.TRUNCATED
    return samples, state


def reward(args, sample: Sample) -> float:
    """The environment's rubric reward of the episode (`metadata["env_reward"]`); an episode the
    rubric did not score fails the sample."""
    value = sample.metadata.get("env_reward")
    if value is None:
        raise ValueError(f"the verifiers environment gave no reward ({sample.metadata.get('env_error') or 'unscored'})")
    return float(value)


class VerifiersDataSource(RolloutDataSource):
    """`--data-source-path`: the rows of the environment's own dataset (`env.get_dataset()`) as prompts;
    each Sample carries its row in `metadata["vf_input"]`."""

    def __init__(self, args):
        env = load_environment(args.env_id, args.env_args)
        dataset = env.build_dataset()
        if dataset is None or len(dataset) == 0:
            raise SlimeConfigError(f"--env-id {args.env_id}: the environment has no training dataset; give "
                                   "--prompt-data (rows with the prompt, and the answer as the label)")
        tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        prompts = []
        for i, row in enumerate(dataset):
            inp = {k: row[k] for k in INPUT_KEYS if row.get(k) is not None}
            prompt = inp["prompt"]
            if isinstance(prompt, list):
                ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False, **(args.apply_chat_template_kwargs or {}))
            else:
                ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if args.rollout_max_prompt_len is not None and len(ids) > args.rollout_max_prompt_len:
                continue
            prompts.append(Prompt(prompt, list(ids), inp.get("answer"), {"vf_input": inp}, where=f"{args.env_id}[{i}]"))
        if not prompts:
            raise SlimeConfigError(f"--env-id {args.env_id}: every prompt of the environment's dataset is over "
                                   f"--rollout-max-prompt-len {args.rollout_max_prompt_len}")
        super().__init__(args, prompts)
