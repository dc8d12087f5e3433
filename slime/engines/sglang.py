"""The SGLang rollout backend (`--rollout-backend sglang`): its server's command line.

`sglang_command(args, rank, host, port)` is engine `rank`'s
`python -m sglang.launch_server --model-path ... --tp-size ... --base-gpu-id ...` plus every
`--sglang-*` flag forwarded verbatim. The flags are checked against the *installed* SGLang's
own parser (`ServerArgs.add_cli_args`), so a new SGLang version needs no change here and a typo
fails at start-up naming the flag. Control calls go through `slime.engines.control` (the native
engine speaks the same protocol; docs/engines/sglang.md lists the gaps); the kind itself (weight
updates by broadcast, weight-update sessions) is declared in `slime.engines.kinds`.

Flags slime manages (`MANAGED_FLAGS`): giving one through `--sglang-*` is an error naming
the slime flag to use instead (an override would desynchronise slime's placement, its
client or its weight-sync group from the server). Values slime only *defaults*
(`--random-seed`) are overridden by the user's `--sglang-*` value. Colocated SGLang engines
are refused at parse time: their weight updates need CUDA-IPC handles, not implemented.

LoRA (`--lora-rank R --lora-sync adapter`): the server also gets `LORA_FLAGS`, `--enable-lora
--max-lora-rank R --lora-target-modules all --max-loras-per-batch 1` (each overridable through
`--sglang-*`), and slime loads the trained adapters through `/load_lora_adapter`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import ray

from slime.engines.passthrough import PassThrough, RaisingParser, option_table
from slime.utils.errors import SlimeConfigError
from slime.utils.net import free_port

logger = logging.getLogger(__name__)

PIP_PACKAGE = "sglang"
NOT_INSTALLED = (
    "--rollout-backend sglang needs SGLang installed on every node that runs an engine "
    f"(pip install {PIP_PACKAGE}, in the same environment as slime); it could not be imported: {{err}}"
)

# SGLang dest -> why slime sets it. Aliases (e.g. --tensor-parallel-size, --model) map to these dests.
MANAGED_FLAGS = {
    "model_path": "use --hf-checkpoint",
    "host": "slime binds every engine itself",
    "port": "slime picks a free port per engine",
    "tp_size": "use --rollout-num-gpus-per-engine",
    "base_gpu_id": "slime derives it from the engine's rank and --rollout-num-gpus-per-engine",
    "nccl_port": "slime picks a free port per engine",
}
# Would make one engine use other devices than the --rollout-num-gpus-per-engine slime reserved for it.
ONE_ONLY_FLAGS = ("dp_size", "pp_size", "nnodes")


def sglang_parser() -> argparse.ArgumentParser:
    """The installed SGLang's server parser (built by its own `ServerArgs.add_cli_args`).

    Raises SlimeConfigError naming `--rollout-backend sglang` and the pip package when SGLang
    is not importable.
    """
    try:
        from sglang.srt.server_args import ServerArgs  # optional, heavy: only for --rollout-backend sglang
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything
        raise SlimeConfigError(NOT_INSTALLED.format(err=f"{type(e).__name__}: {e}")) from None
    parser = RaisingParser(prog="sglang.launch_server", add_help=False, allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    return parser


def sglang_pass_through(parser: argparse.ArgumentParser) -> PassThrough:
    """`--sglang-*` for a real SGLang server: checked against its parser, strictly."""
    return PassThrough("--sglang-", "the installed SGLang's server", options=option_table(parser),
                       managed=MANAGED_FLAGS, strict=True, one_only=ONE_ONLY_FLAGS)


def base_gpu_id(args, rank: int, gpus_per_node: int | None = None, ray_gpu_ids: list | None = None,
                visible_devices: str | None = None) -> int:
    """SGLang's --base-gpu-id for engine `rank`: an index into the GPUs the engine process sees.

    - When the actor launching the engine holds a share of its bundle's GPU, Ray names it
      (`ray_gpu_ids`, from `ray.get_gpu_ids()`): that GPU, as an index into
      `visible_devices` (CUDA_VISIBLE_DEVICES) when set. Exact.
    - Otherwise (the EngineServer actor asks for no GPU, so Ray leaves CUDA_VISIBLE_DEVICES
      alone): placement (slime/ray/placement.py) puts engine `rank` on bundles from
      `first = rank * per_engine` (`--colocate`: the train ranks' bundles) or
      `dp_size + rank * per_engine`, one GPU per bundle, packed in order onto nodes of
      `gpus_per_node` GPUs (the Ray node's GPU count; default --actor-num-gpus-per-node), so the
      first GPU is `first % gpus_per_node`. This assumes Ray gives bundle i the i-th GPU of a
      node, which holds on a fresh cluster but is not promised by Ray.
    """
    per_engine = args.rollout_num_gpus_per_engine
    if ray_gpu_ids:
        gpu = str(min(int(g) for g in ray_gpu_ids))
        if visible_devices:
            visible = [v.strip() for v in visible_devices.split(",") if v.strip()]
            if gpu not in visible:
                raise SlimeConfigError(f"engine {rank}: Ray gave GPU {gpu}, which CUDA_VISIBLE_DEVICES="
                                       f"{visible_devices} hides from the engine")
            if len(visible) - visible.index(gpu) < per_engine:
                raise SlimeConfigError(
                    f"engine {rank} needs {per_engine} GPUs from GPU {gpu} but CUDA_VISIBLE_DEVICES="
                    f"{visible_devices}; start the engine actor with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1")
            return visible.index(gpu)
        return int(gpu)
    first = rank * per_engine + (0 if args.colocate else args.dp_size)
    gpus_per_node = max(1, gpus_per_node or args.actor_num_gpus_per_node)
    gpu = first % gpus_per_node
    if gpu + per_engine > gpus_per_node:
        raise SlimeConfigError(
            f"engine {rank} would span two nodes (GPUs {gpu}..{gpu + per_engine - 1} of a "
            f"{gpus_per_node}-GPU node): make --rollout-num-gpus-per-engine ({per_engine}) divide the GPUs "
            f"per node" + ("" if args.colocate else f" and the train ranks ({args.dp_size}) fill whole nodes"))
    return gpu


def _ray_gpu_context() -> tuple[int | None, list]:
    """(GPUs of this Ray node, GPU ids Ray assigned to this actor); (None, []) outside Ray."""
    try:
        if not ray.is_initialized():
            return None, []
        node_id = ray.get_runtime_context().get_node_id()
        gpus = next((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["NodeID"] == node_id), 0)
        return (gpus or None), list(ray.get_gpu_ids())
    except Exception as e:  # noqa: BLE001 - placement falls back to the flags
        logger.warning("could not read the Ray node's GPUs (%s); assuming --actor-num-gpus-per-node per node", e)
        return None, []


def lora_flags(args) -> dict[str, list[str]]:
    """{SGLang dest: its argv} to serve LoRA adapters of rank --lora-rank when the run syncs adapters
    (`--lora-rank` with `--lora-sync adapter`); else {}. `--lora-target-modules all` covers whatever
    linear layers the trainer targets (SGLang sizes its adapter buffers by these). One adapter per
    batch: SGLang counts a base-model request as one too, so base and adapter requests run in
    separate batches, and `pinned: true` loads are refused (it pins at most max-loras-per-batch - 1)."""
    if not ((getattr(args, "lora_rank", None) or 0) > 0 and getattr(args, "lora_sync", None) == "adapter"):
        return {}
    return {
        "enable_lora": ["--enable-lora"],
        "max_lora_rank": ["--max-lora-rank", str(int(args.lora_rank))],
        "lora_target_modules": ["--lora-target-modules", "all"],
        "max_loras_per_batch": ["--max-loras-per-batch", "1"],
    }


def sglang_command(args, rank: int, host: str, port: int, parser: argparse.ArgumentParser | None = None,
                   dtype: str | None = None) -> list[str]:
    """Command line of SGLang engine `rank` serving on host:port (in `dtype` unless `--sglang-dtype`
    says; None: SGLang's own choice).

    Checked by parsing it with the installed SGLang's own parser (so a bad value, e.g.
    `--sglang-mem-fraction-static abc` or an unknown `--sglang-attention-backend`, fails here,
    naming the flag).
    """
    if parser is None:
        parser = sglang_parser()
    user, user_dests = sglang_pass_through(parser).forward(args.sglang_args)
    node_gpus, ray_gpus = _ray_gpu_context()
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", args.hf_checkpoint,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(args.rollout_num_gpus_per_engine),
        "--base-gpu-id", str(base_gpu_id(args, rank, node_gpus, ray_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))),
        "--nccl-port", str(free_port(host)),
    ]
    if "random_seed" not in user_dests:
        cmd += ["--random-seed", str(args.seed + rank)]
    if dtype is not None and "dtype" not in user_dests:
        cmd += ["--dtype", dtype]
    for dest, argv in lora_flags(args).items():
        if dest not in user_dests:
            cmd += argv
    if args.use_rollout_routing_replay and "enable_return_routed_experts" not in user_dests:
        cmd += ["--enable-return-routed-experts"]  # R3: the routed experts of every token come back
    cmd += user
    try:
        parser.parse_args(cmd[3:])
    except SlimeConfigError as e:
        # argparse names the server flag (`argument --x: ...`); say which slime flag it came from
        raise SlimeConfigError(f"SGLang rejects engine {rank}'s command line: {e} "
                               f"(server flags come from --sglang-*: {' '.join(user) or 'none'})") from None
    return cmd


def check_sglang_args(args) -> None:
    """Validate `--sglang-*` against the installed SGLang without building a command (for a
    driver that wants to fail before placing engines). Raises SlimeConfigError."""
    sglang_pass_through(sglang_parser()).forward(args.sglang_args)


def broadcast_layout(num_engines: int, tp_size: int) -> tuple[int, list[int]]:
    """(world_size, rank_offset per engine) of the weight-update group: the trainer is rank 0
    and engine i's tensor-parallel rank r joins as `rank_offset[i] + r` (SGLang adds its
    tp_rank to the rank_offset it is given)."""
    if num_engines < 1 or tp_size < 1:
        raise ValueError(f"need num_engines >= 1 and tp_size >= 1, got {num_engines}, {tp_size}")
    return 1 + num_engines * tp_size, [1 + i * tp_size for i in range(num_engines)]
