"""`--rollout-backend vllm`: vLLM's OpenAI server behind slime's protocol adapter.

Each engine is two processes:

    python -m slime.engines.vllm.adapter --host H --port P ... -- <vLLM server command>
      └─ <venv>/bin/python -m vllm.entrypoints.openai.api_server --model M ... --port <private>

The adapter (slime's own venv) serves slime's SGLang-native protocol on H:P and translates
to vLLM's `/v1/completions` with token-id prompts (see `adapter.py`); vLLM runs from
its own virtual environment (`scripts/install_vllm_cpu.sh`), found through `SLIME_VLLM_VENV`
(default `<repo>/.venv-vllm`), on a private loopback port with every `--vllm-*` flag
forwarded (`--vllm-max-model-len 512` -> `--max-model-len 512`; a bare flag stays bare).

LoRA (`--lora-rank R --lora-sync adapter`): vLLM also gets `--enable-lora --max-lora-rank R'
--max-loras 1` (R' = R rounded up to a rank vLLM accepts, `vllm_lora_rank`) and the adapter starts
it with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (its `/v1/load_lora_adapter` routes exist only then);
the adapter loads, unloads and selects adapters by name (`adapter.py`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from slime.engines.passthrough import PassThrough
from slime.utils.errors import SlimeConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
INSTALL_SCRIPT = "scripts/install_vllm_cpu.sh"
WORKER_EXTENSION = "slime.engines.vllm.worker.SlimeWorkerExtension"
SERVED_MODEL_NAME = "slime"

# Set by slime; giving them again through --vllm-* is an error naming the flag.
MANAGED_FLAGS = {
    "model": "from --hf-checkpoint",
    "host": "vLLM listens on a private loopback port behind the adapter",
    "port": "vLLM listens on a private loopback port behind the adapter",
    "served_model_name": "the adapter names the model",
    "worker_extension_cls": "slime's weight loader is a worker extension",
}
# slime's defaults, overridable through --vllm-*.
DEFAULT_FLAGS = {
    # log-prob of the sampled token after temperature (slime's definition when top-p/top-k are off)
    "logprobs_mode": "processed_logprobs",
}
# Environment defaults for vLLM's CPU backend, used only when the caller's environment lacks them.
DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc (weight updates), /pause, /abort_requests, ...
}
# Set in vLLM's environment when its command has --enable-lora: /v1/load_lora_adapter and
# /v1/unload_lora_adapter exist only with it.
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
# The LoRA ranks vLLM's --max-lora-rank accepts (vllm.config.lora.MaxLoRARanks, vLLM 0.11-0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VllmNotInstalled(SlimeConfigError):
    """No vLLM venv where slime looks for one (a user-facing one-line error)."""


def vllm_venv() -> Path:
    return Path(os.environ.get("SLIME_VLLM_VENV") or REPO_ROOT / ".venv-vllm")


def vllm_python() -> str:
    """The vLLM venv's python; a clear error naming the install script when it is missing."""
    venv = vllm_venv()
    py = venv / "bin" / "python"
    if not py.exists():
        raise VllmNotInstalled(
            f"--rollout-backend vllm needs vLLM in its own virtual environment, and {py} does not exist; "
            f"run `bash {INSTALL_SCRIPT}` (or point SLIME_VLLM_VENV at a venv that has vllm installed)"
        )
    return str(py)


# vLLM lives in its own venv, so slime cannot see its parser: every --vllm-* flag is forwarded and
# vLLM's own parser judges it when the server starts (its log names the flag).
VLLM_PASS_THROUGH = PassThrough("--vllm-", "vLLM's server", options=None, managed=MANAGED_FLAGS, strict=True,
                                defaults=DEFAULT_FLAGS)


def forwarded_vllm_flags(vllm_args: dict) -> list[str]:
    """`args.vllm_args` ({key_with_underscores: value | True}) -> vLLM server flags, with slime's
    defaults for the keys not given. A slime-managed key is a SlimeConfigError naming the flag."""
    return VLLM_PASS_THROUGH.forward(vllm_args)[0]


def checkpoint_dtype(model_path: str) -> str | None:
    """The dtype a Hugging Face checkpoint declares (config.json `dtype` / `torch_dtype`)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return dtype if dtype in ("float32", "float16", "bfloat16") else None


def vllm_server_command(python: str, model_path: str, seed: int, vllm_args: dict) -> list[str]:
    """vLLM's OpenAI server command, less --host/--port (the adapter adds a private port).

    Unless `--vllm-dtype` is given, vLLM serves the checkpoint's own dtype (vLLM's CPU backend
    would otherwise downcast float32 checkpoints to bfloat16, and rollout log-probs would then
    differ from the trainer's float32 ones by ~1e-2)."""
    if "dtype" not in vllm_args and checkpoint_dtype(model_path):
        vllm_args = dict(vllm_args, dtype=checkpoint_dtype(model_path))
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--served-model-name", SERVED_MODEL_NAME,
        "--seed", str(seed),
        "--worker-extension-cls", WORKER_EXTENSION,
        *forwarded_vllm_flags(vllm_args),
    ]


def adapter_command(model_path: str, host: str, port: int, seed: int, vllm_args: dict, *,
                    startup_timeout: float = 600.0, python: str | None = None,
                    access: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The adapter process's command line (slime's python), wrapping vLLM's server command;
    `access`: the adapter's access flags (`slime.engines.auth.add_access_flags`)."""
    return [
        sys.executable, "-m", "slime.engines.vllm.adapter",
        "--host", host, "--port", str(port),
        "--model-path", model_path,
        "--startup-timeout", str(startup_timeout),
        "--sleep-mode", "1" if vllm_args.get("enable_sleep_mode") else "0",
        *access,
        "--",
        *vllm_server_command(python or vllm_python(), model_path, seed, vllm_args),
    ]


def check_vllm_args(args) -> None:
    """Parse-time check for `--rollout-backend vllm` (cheap: no vLLM import): the venv exists and
    no --vllm-* flag names a slime-managed one. Raises SlimeConfigError naming the problem."""
    vllm_python()
    forwarded_vllm_flags(args.vllm_args)


def vllm_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds adapters of rank `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise SlimeConfigError(f"--lora-rank {rank}: vLLM serves LoRA adapters of rank at most {VLLM_LORA_RANKS[-1]}; "
                           f"use a smaller rank or --lora-sync merged")


def serves_lora_adapters(args) -> bool:
    """Whether the run's engines load LoRA adapters (`--lora-rank` with `--lora-sync adapter`)."""
    return (getattr(args, "lora_rank", None) or 0) > 0 and getattr(args, "lora_sync", None) == "adapter"


def lora_flags(args, vllm_args: dict) -> dict:
    """`vllm_args` plus vLLM's LoRA flags when the run syncs LoRA adapters (a `--vllm-*` value wins)."""
    if not serves_lora_adapters(args):
        return vllm_args
    defaults = {"enable_lora": True, "max_lora_rank": str(vllm_lora_rank(int(args.lora_rank))), "max_loras": "1"}
    return {**defaults, **vllm_args}


def vllm_command(args, rank: int, host: str, port: int, access: list[str] | tuple[str, ...] = (),
                 dtype: str | None = None) -> list[str]:
    """Command line of engine `rank` for `--rollout-backend vllm` (used by the launcher), serving in
    `dtype` (None: vllm_server_command's default); with LoRA adapters (`serves_lora_adapters`)
    vLLM serves them (`lora_flags`)."""
    vllm_args = lora_flags(args, dict(args.vllm_args))
    if args.rollout_num_gpus_per_engine != 1 and "tensor_parallel_size" not in vllm_args:
        vllm_args["tensor_parallel_size"] = str(args.rollout_num_gpus_per_engine)
    if dtype is not None and "dtype" not in vllm_args:
        vllm_args["dtype"] = dtype
    return adapter_command(args.hf_checkpoint, host, port, args.seed + rank, vllm_args,
                           startup_timeout=args.engine_startup_timeout, access=access)


def vllm_env(base: dict | None = None, lora: bool = False) -> dict:
    """The vLLM process's environment: slime's repo on PYTHONPATH (for the worker extension),
    slime's vLLM defaults where unset, `LORA_ENV` when it serves LoRA adapters (`lora`), and none
    of slime's venv."""
    env = dict(os.environ if base is None else base)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONHOME", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                            if p and Path(p).resolve() != REPO_ROOT])
    for k, v in DEFAULT_ENV.items():
        env.setdefault(k, v)
    if lora:
        env.update(LORA_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    return env
