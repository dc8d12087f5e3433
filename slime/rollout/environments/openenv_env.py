"""OpenEnv environments (`openenv-core`) as slime rollouts: the policy talks, the environment steps.

    --custom-generate-function-path slime.rollout.environments.openenv_env.generate
    --env-id examples/openenv_env/guess.py:GuessEnvironment --env-args '{"max_value": 9}'
    [--env-server] [--env-max-turns 4] [--env-max-tokens-per-turn 32]   # slime.environment_flags

`--env-id` names an OpenEnv `Environment` subclass (`pkg.module.Class` or `file.py:Class`), built
with `--env-args` as keyword arguments. It runs in-process (a fresh instance per episode,
`reset_async`/`step_async`), or with `--env-server` behind OpenEnv's own FastAPI app
(`create_fastapi_app`, served by uvicorn on 127.0.0.1 in this process) through OpenEnv's WebSocket
client (`GenericEnvClient`), one session per episode. An episode:

1. `reset(seed=...)` (the seed is the Sample's `metadata["seed"]`, else its index: `EpisodeSource`,
   the default `--data-source-path` without `--prompt-data`, numbers the episodes 0, 1, ...);
2. the conversation is the Sample's prompt messages (if any) and the observation as a user message;
3. each turn the model replies through slime's recording OpenAI client (`openai_agent`); the reply
   text is the Action's one required text field (`GuessAction(message=...)`); the environment's
   observation is the next user message; until `done` or `--env-max-turns` replies.

An observation is shown to the model as its one text field, else as JSON of its own fields (not
`done`, `reward`, `metadata`). The episode's Samples are the recorded calls (model tokens mask 1 with
their log-probs, the observations and template glue mask 0); `metadata["env_reward"]` is the sum of
the step rewards and `metadata["env_steps"]` the environment's record of each step (action, reward,
done, observation); `reward` (the default `--custom-rm-path`) returns `env_reward`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import threading
import time
import typing
from typing import Any

from slime.data.dataset import Prompt
from slime.data.source import RolloutDataSource
from slime.engines.kinds import POLICY_LORA_NAME
from slime.environment_flags import OPENENV_PIP
from slime.rollout.api import context
from slime.rollout.openai_agent import TrajectoryRecorder
from slime.types import Sample
from slime.utils.errors import SlimeConfigError
from slime.utils.hooks import load_function

BASE_OBSERVATION_FIELDS = ("done", "reward", "metadata")
NUM_EPISODES = 10_000  # EpisodeSource: seeds 0 .. NUM_EPISODES - 1
SERVER_START_TIMEOUT = 60.0


def _openenv():
    try:
        from openenv.core.env_server import interfaces, types  # optional dependency: OpenEnv runs only
    except ImportError:
        raise SlimeConfigError(f"the OpenEnv adapter needs the `openenv-core` package: {OPENENV_PIP}") from None
    return interfaces, types


@functools.lru_cache(maxsize=None)
def environment_class(env_id: str):
    """The Environment subclass `env_id` names, with its Action and Observation classes."""
    interfaces, types = _openenv()
    cls = load_function(env_id, "--env-id")
    if not (isinstance(cls, type) and issubclass(cls, interfaces.Environment)):
        raise SlimeConfigError(f"--env-id {env_id}: {cls!r} is not an OpenEnv Environment subclass")
    hints = typing.get_type_hints(cls.step)
    action_cls, obs_cls = hints.get("action"), hints.get("return")
    for base in getattr(cls, "__orig_bases__", ()):  # Environment[ActT, ObsT, StateT]
        args = typing.get_args(base)
        if len(args) >= 2 and isinstance(args[0], type) and isinstance(args[1], type):
            action_cls, obs_cls = args[0], args[1]
    if not (isinstance(action_cls, type) and issubclass(action_cls, types.Action)):
        raise SlimeConfigError(f"--env-id {env_id}: cannot tell its Action class (annotate step(self, action: "
                               "MyAction) -> MyObservation, or subclass Environment[MyAction, MyObservation, State])")
    if not (isinstance(obs_cls, type) and issubclass(obs_cls, types.Observation)):
        obs_cls = types.Observation
    text = [n for n, f in action_cls.model_fields.items() if f.is_required() and f.annotation is str]
    if len(text) != 1:
        raise SlimeConfigError(f"--env-id {env_id}: its action {action_cls.__name__} must have exactly one required "
                               f"str field for the model's reply; it has {text or 'none'}")
    return cls, action_cls, obs_cls, text[0]


def observation_text(obs: dict[str, Any]) -> str:
    """What the model is shown of an observation (module docstring)."""
    own = {k: v for k, v in obs.items() if k not in BASE_OBSERVATION_FIELDS}
    texts = [v for v in own.values() if isinstance(v, str)]
    if len(own) == 1 and texts or len(texts) == 1 and all(isinstance(v, str) or v is None for v in own.values()):
        return texts[0]
    return json.dumps(own, sort_keys=True, default=str)


class _InProcess:
    """One episode's environment instance, called directly."""

    def __init__(self, env_id: str, env_args: dict):
        cls, self.action_cls, _, self.field = environment_class(env_id)
        self.env = cls(**env_args)

    async def reset(self, seed: int) -> tuple[dict, float | None, bool]:
        return self._result(await self.env.reset_async(seed=seed))

    async def step(self, text: str) -> tuple[dict, float | None, bool]:
        return self._result(await self.env.step_async(self.action_cls(**{self.field: text})))

    @staticmethod
    def _result(obs) -> tuple[dict, float | None, bool]:
        return obs.model_dump(), obs.reward, bool(obs.done)

    async def aclose(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class _Served:
    """One episode's WebSocket session with the environment's server (OpenEnv's GenericEnvClient)."""

    def __init__(self, env_id: str, env_args: dict, timeout: float):
        from openenv.core.generic_client import GenericEnvClient  # optional dependency: OpenEnv runs only

        server = serve(env_id, json.dumps(env_args, sort_keys=True))
        self.field, self.lock = environment_class(env_id)[3], server.lock
        self.client = GenericEnvClient(base_url=server.url, message_timeout_s=timeout)

    async def reset(self, seed: int) -> tuple[dict, float | None, bool]:
        return self._result(await self.client.reset(seed=seed))

    async def step(self, text: str) -> tuple[dict, float | None, bool]:
        return self._result(await self.client.step({self.field: text}))

    @staticmethod
    def _result(r) -> tuple[dict, float | None, bool]:
        return dict(r.observation or {}), r.reward, bool(r.done)

    async def aclose(self) -> None:
        # say "close" and let the server close the socket: OpenEnv's client closes it at once, and the server's
        # own close then fails with a logged traceback per episode
        ws = getattr(self.client, "_ws", None)
        if ws is not None:
            try:
                await ws.send(json.dumps({"type": "close"}))
                await asyncio.wait_for(ws.wait_closed(), timeout=5.0)
            except Exception:  # best effort: the client closes the socket below either way
                pass
        await self.client.close()


class _Server:
    def __init__(self, url: str, lock: asyncio.Lock | None, server):
        self.url, self.lock, self.server = url, lock, server


@functools.lru_cache(maxsize=None)
def serve(env_id: str, env_args_json: str) -> _Server:
    """OpenEnv's FastAPI app for the environment, served by uvicorn on 127.0.0.1 (a free port) in a
    thread of this process, once per process and arguments. Its routes take no key: it listens on
    loopback only."""
    import uvicorn  # optional dependency: OpenEnv's server runs only with --env-server
    from openenv.core.env_server.http_server import create_fastapi_app  # optional dependency, as above

    cls, action_cls, obs_cls, _ = environment_class(env_id)
    env_args = json.loads(env_args_json)
    concurrent = bool(getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False))
    app = create_fastapi_app(lambda: cls(**env_args), action_cls, obs_cls, max_concurrent_envs=64 if concurrent else 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="openenv-server", daemon=True).start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError(f"--env-server: the OpenEnv server of {env_id} did not start in "
                               f"{SERVER_START_TIMEOUT:g} s")
        time.sleep(0.05)
    # an environment without concurrent sessions serves one episode at a time
    return _Server(f"http://127.0.0.1:{sock.getsockname()[1]}", None if concurrent else asyncio.Lock(), server)


async def run_episode(env, client, model: str, sample: Sample, seed: int, max_turns: int,
                      max_tokens: int | None = None) -> dict[str, Any]:
    """Play one episode: reset, then model reply -> env step until done or `max_turns` replies. Returns the
    environment's record: `reset` (the first observation) and `steps` (action, observation, reward, done)."""
    obs, _, done = await env.reset(seed)
    first = obs
    messages = list(sample.prompt) if isinstance(sample.prompt, list) else []
    messages.append({"role": "user", "content": observation_text(obs)})
    steps = []
    for _ in range(max_turns):
        if done:
            break
        extra = {} if max_tokens is None else {"max_tokens": max_tokens}
        r = await client.chat.completions.create(model=model, messages=messages, **extra)
        text = r.choices[0].message.content or ""
        obs, reward, done = await env.step(text)
        steps.append({"action": text, "observation": obs, "reward": reward, "done": done})
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": observation_text(obs)}]
    return {"reset": first, "steps": steps}


async def episode(args, sample: Sample, sampling_params: dict, *, base_url: str | None = None,
                  tokenizer=None) -> tuple[list[Sample], dict[str, Any]]:
    """One episode for `sample`: its Samples and the environment's record (`run_episode`)."""
    if base_url is None or tokenizer is None:
        ctx = context()
        base_url, tokenizer = base_url or ctx.openai_base_url, tokenizer if tokenizer is not None else ctx.tokenizer
    # --lora-sync adapter: the policy is the engines' base plus the adapter, chosen by its name (as run_agent)
    model = POLICY_LORA_NAME if getattr(args, "lora_sync", None) == "adapter" else str(args.hf_checkpoint)
    budget = sampling_params.get("max_new_tokens") or args.rollout_max_response_len
    env_args = args.env_args or {}
    seed = int(sample.metadata.get("seed", sample.index if sample.index is not None else 0))
    env = (_Served(args.env_id, env_args, float(args.rollout_request_timeout)) if args.env_server
           else _InProcess(args.env_id, env_args))
    lock = getattr(env, "lock", None)
    async with TrajectoryRecorder(base_url, sampling_params, model=model, max_response_len=budget,
                                  timeout=float(args.rollout_request_timeout)) as rec:
        try:
            if lock is not None:
                async with lock:
                    record = await run_episode(env, rec.client, rec.model, sample, seed, args.env_max_turns,
                                                 args.env_max_tokens_per_turn)
            else:
                record = await run_episode(env, rec.client, rec.model, sample, seed, args.env_max_turns,
                                                 args.env_max_tokens_per_turn)
        finally:
            await env.aclose()
    if not rec.calls:
        raise RuntimeError(f"OpenEnv environment {args.env_id}: the episode (seed {seed}) ended at reset, before "
                           "any model turn")
    total = sum(float(s["reward"]) for s in record["steps"] if s["reward"] is not None)
    samples = rec.to_samples(sample, tokenizer)
    for s in samples:
        s.metadata.update(env_reward=total, env_steps=record["steps"], env_seed=seed,
                          env_done=bool(record["steps"] and record["steps"][-1]["done"]))
    return samples, record


async def generate(args, sample: Sample, sampling_params: dict) -> list[Sample]:
    """`--custom-generate-function-path`: one episode of `--env-id` for `sample` (module docstring)."""
    samples, _ = await episode(args, sample, sampling_params)
    return samples


def reward(args, sample: Sample) -> float:
    """The episode's summed step rewards (`metadata["env_reward"]`)."""
    return float(sample.metadata["env_reward"])


class EpisodeSource(RolloutDataSource):
    """`--data-source-path`: numbered episodes (the reset seeds 0, 1, ...), no prompt data; shuffled with
    --rollout-shuffle."""

    def __init__(self, args):
        super().__init__(args, [Prompt("", [], None, {"seed": i}, where=f"episode {i}") for i in range(NUM_EPISODES)])
