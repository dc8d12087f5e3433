"""Environment flags: run a `verifiers` or OpenEnv environment as the rollout (docs/environments.md).

    --custom-generate-function-path slime.rollout.environments.verifiers_env.generate
    --env-id wordle --env-args '{"num_train_examples": 200}'

    --custom-generate-function-path slime.rollout.environments.openenv_env.generate
    --env-id examples/openenv_env/countdown.py:CountdownEnvironment [--env-server] [--env-max-turns 4]

- `--env-id`: verifiers: an installed environment's id (`wordle`, `owner/wordle`: the module
  `wordle`), or a Python file defining `load_environment`; OpenEnv: the `Environment` subclass, as
  `pkg.module.Class` or `file.py:Class`.
- `--env-args`: a JSON object, the keyword arguments of `load_environment` (verifiers) or of the
  environment class (OpenEnv). In a `--config` file, a mapping.
- `--env-server` (OpenEnv): serve the environment with OpenEnv's own FastAPI app on 127.0.0.1 and
  talk to it through OpenEnv's WebSocket client, instead of calling it in-process.
- `--env-max-turns` (OpenEnv): model turns per episode (the environment may end it sooner).
- `--env-max-tokens-per-turn`: max_tokens of each model turn (a verifiers environment's own
  `max_tokens` wins); the episode's budget is `--rollout-max-response-len` either way.

Which adapter runs is the generate function's choice; its reward (`reward` of the same module) and,
for verifiers without `--prompt-data`, its data source (the environment's own dataset) become the
defaults of `--custom-rm-path` and `--data-source-path`. `validate_environment(args)` gives one line
for each bad input: an adapter without `--env-id` or the reverse, a package that is not installed
(naming what to pip install), an environment id that is not installed, a file that does not exist.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from slime.utils.errors import SlimeConfigError
from slime.utils.flag_parsing import json_object

ADAPTERS = "slime.rollout.environments."
VERIFIERS_GENERATE = ADAPTERS + "verifiers_env.generate"
OPENENV_GENERATE = ADAPTERS + "openenv_env.generate"
VERIFIERS_PIP = "pip install 'verifiers>=0.3.1,<0.4'"  # the classic environment API (load_environment) + clients
OPENENV_PIP = "pip install openenv-core"


def add_environment_flags(p) -> None:
    g = p.add_argument_group("environments (verifiers, OpenEnv: docs/environments.md)")
    g.add_argument("--env-id", default=None,
                   help="the environment: verifiers: an installed environment id (its module, e.g. wordle) or a "
                        ".py file with load_environment; OpenEnv: its Environment class (pkg.module.Class or "
                        "file.py:Class). Run by --custom-generate-function-path "
                        f"{VERIFIERS_GENERATE} or {OPENENV_GENERATE}")
    g.add_argument("--env-args", type=json_object, default=None, metavar="JSON",
                   help="keyword arguments of the environment (verifiers' load_environment, or the OpenEnv class), "
                        "a JSON object")
    g.add_argument("--env-server", action="store_true",
                   help="OpenEnv: serve the environment on 127.0.0.1 (OpenEnv's app) and use its client, instead "
                        "of calling it in-process")
    g.add_argument("--env-max-turns", type=int, default=8,
                   help="OpenEnv: model turns per episode at most (the environment may end it sooner)")
    g.add_argument("--env-max-tokens-per-turn", type=int, default=None, metavar="N",
                   help="max_tokens of each model turn (default: the environment's own, else what is left of "
                        "--rollout-max-response-len, the episode's budget)")


def _kind(args) -> str | None:
    path = args.custom_generate_function_path or ""
    return {VERIFIERS_GENERATE: "verifiers", OPENENV_GENERATE: "openenv"}.get(path)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def verifiers_module(env_id: str) -> str:
    """The module of a verifiers environment id, as verifiers names it (`owner/my-env` -> `my_env`)."""
    return env_id.split("@", 1)[0].rsplit("/", 1)[-1].replace("-", "_")


def validate_verifiers_id(env_id: str) -> None:
    if not _installed("verifiers"):
        raise SlimeConfigError(f"--env-id {env_id}: the verifiers adapter needs the `verifiers` package: "
                               f"{VERIFIERS_PIP}")
    if env_id.endswith(".py"):
        if not Path(env_id).is_file():
            raise SlimeConfigError(f"--env-id {env_id}: file does not exist")
        return
    module = verifiers_module(env_id)
    if not _installed(module):
        package = env_id.split("@", 1)[0].rsplit("/", 1)[-1]
        hub = f" (from the Environments Hub: prime env install {env_id})" if "/" in env_id else ""
        raise SlimeConfigError(f"--env-id {env_id}: no verifiers environment {env_id!r} is installed (no module "
                               f"{module!r}); install its package: pip install {package}{hub}")


def _check_openenv(env_id: str) -> None:
    if not _installed("openenv"):
        raise SlimeConfigError(f"--env-id {env_id}: the OpenEnv adapter needs the `openenv-core` package: "
                               f"{OPENENV_PIP}")
    if ":" in env_id:
        file = env_id.rpartition(":")[0]
        if not Path(file).is_file():
            raise SlimeConfigError(f"--env-id {env_id}: file {file} does not exist")
        return
    module, _, cls = env_id.rpartition(".")
    if not module or not cls:
        raise SlimeConfigError(f"--env-id {env_id}: an OpenEnv environment is its Environment class, "
                               "pkg.module.Class or file.py:Class")
    if not _installed(module):
        raise SlimeConfigError(f"--env-id {env_id}: module {module!r} is not installed; install the environment's "
                               f"package (pip install {module.split('.')[0].replace('_', '-')})")


def validate_environment(args) -> None:
    """The environment flags (module docstring); sets the adapter's reward and data source defaults."""
    kind = _kind(args)
    if kind is None:
        given = [f for f, v in (("--env-id", args.env_id), ("--env-args", args.env_args),
                                ("--env-server", args.env_server),
                                ("--env-max-tokens-per-turn", args.env_max_tokens_per_turn)) if v]
        if given:
            raise SlimeConfigError(f"{given[0]} needs an environment adapter: --custom-generate-function-path "
                                   f"{VERIFIERS_GENERATE} (verifiers) or {OPENENV_GENERATE} (OpenEnv)")
        return
    if not args.env_id:
        raise SlimeConfigError(f"--custom-generate-function-path {args.custom_generate_function_path} needs --env-id "
                               "(the environment to run)")
    if kind == "verifiers":
        if args.env_server:
            raise SlimeConfigError("--env-server is an OpenEnv flag; verifiers environments run in-process")
        validate_verifiers_id(args.env_id)
    else:
        _check_openenv(args.env_id)
    if args.env_max_turns < 1:
        raise SlimeConfigError(f"--env-max-turns must be >= 1, got {args.env_max_turns}")
    if args.env_max_tokens_per_turn is not None and args.env_max_tokens_per_turn < 1:
        raise SlimeConfigError(f"--env-max-tokens-per-turn must be >= 1, got {args.env_max_tokens_per_turn}")
    module = args.custom_generate_function_path.rpartition(".")[0]
    if args.custom_rm_path is None and args.reward_functions is None and args.rm_type is None:
        args.custom_rm_path = module + ".reward"  # the environment's own reward (its rubric, its step rewards)
    if kind == "verifiers" and args.prompt_data is None and args.data_source_path is None:
        args.data_source_path = module + ".VerifiersDataSource"  # the environment's own dataset
    if kind == "openenv" and args.prompt_data is None and args.data_source_path is None:
        args.data_source_path = module + ".EpisodeSource"  # episodes numbered 0, 1, ... (their reset seeds)
