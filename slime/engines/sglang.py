"""The SGLang rollout backend (`--rollout-backend sglang`).

Three jobs:

1. `sglang_command(args, rank, host, port)`: the command line of engine `rank`,
   `python -m sglang.launch_server --model-path ... --tp-size ... --base-gpu-id ...`
   plus every `--sglang-*` flag forwarded verbatim. The flags are checked against the
   *installed* SGLang's own parser (`ServerArgs.add_cli_args`), so a new SGLang
   version needs no change here and a typo fails at start-up naming the flag.
2. `SGLangControl`: every control call slime makes to an SGLang server, with the
   request bodies of SGLang's request structs (`sglang/srt/managers/io_struct.py`) and
   the answers SGLang gives (JSON, plain text, an empty body or `null`) read the same way.
   The native engine speaks the same protocol; see docs/engines/sglang.md for the gaps.
3. `broadcast_layout(...)`: the ranks of a weight broadcast to SGLang engines (both ends build
   the group with `slime.engines.native.weight_group.new_group`, SGLang's way) (the mode itself is `--update-weights-mode`, resolved by
   `slime.training.weight_push.resolve_mode`; router registration is `slime.engines.router`).

Flags slime manages (`MANAGED_FLAGS`): giving one through `--sglang-*` is an error naming
the slime flag to use instead (an override would desynchronise slime's placement, its
client or its weight-sync group from the server). Values slime only *defaults*
(`--random-seed`) are overridden by the user's `--sglang-*` value. Colocated SGLang engines
are refused at parse time: their weight updates need CUDA-IPC handles, not implemented.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from typing import Any

from slime.engines.client import EngineClient, EngineError
from slime.utils.errors import SlimeConfigError

logger = logging.getLogger(__name__)

PIP_PACKAGE = "sglang"
NOT_INSTALLED = (
    "--rollout-backend sglang needs SGLang installed on every node that runs an engine "
    f"(pip install {PIP_PACKAGE}, in the same environment as slime); it could not be imported: {{err}}"
)

# SGLang dest -> what to use instead. Aliases (e.g. --tensor-parallel-size, --model) map to these dests.
MANAGED_FLAGS = {
    "model_path": "--hf-checkpoint",
    "host": "nothing: slime binds every engine itself",
    "port": "nothing: slime picks a free port per engine",
    "tp_size": "--rollout-num-gpus-per-engine",
    "base_gpu_id": "nothing: slime derives it from the engine's rank and --rollout-num-gpus-per-engine",
    "nccl_port": "nothing: slime picks a free port per engine",
}
# Would make one engine use other devices than the --rollout-num-gpus-per-engine slime reserved for it.
ONE_ONLY_FLAGS = ("dp_size", "pp_size", "nnodes")
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput.mode


class _RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of printing usage and exiting."""

    def error(self, message: str):
        raise SlimeConfigError(message)


def sglang_parser() -> argparse.ArgumentParser:
    """The installed SGLang's server parser (built by its own `ServerArgs.add_cli_args`).

    Raises SlimeConfigError naming `--rollout-backend sglang` and the pip package when SGLang
    is not importable.
    """
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything
        raise SlimeConfigError(NOT_INSTALLED.format(err=f"{type(e).__name__}: {e}")) from None
    parser = _RaisingParser(prog="sglang.launch_server", add_help=False, allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _option_table(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """`foo_bar` -> the action of `--foo-bar` (every long option string, aliases included)."""
    table = {}
    for action in parser._actions:
        for s in action.option_strings:
            if s.startswith("--"):
                table[s[2:].replace("-", "_")] = action
    return table


def _flag(key: str, prefix: str = "--sglang-") -> str:
    return prefix + key.replace("_", "-")


def forwarded_flags(sglang_args: dict[str, Any], parser: argparse.ArgumentParser) -> tuple[list[str], set[str]]:
    """The `--sglang-*` flags as SGLang server flags, checked against `parser`.

    Returns (argv fragment, the SGLang dests they set). `True` is a bare flag (also accepted
    by options whose value is optional, nargs '?' / '*'); a value for an option that takes a
    list (nargs '+' / '*' / N) is split on whitespace, so `--sglang-cuda-graph-bs-decode "1 2 4"`
    forwards `--cuda-graph-bs-decode 1 2 4`.
    Raises SlimeConfigError naming the `--sglang-*` flag for an unknown flag, a flag slime
    manages, a missing value or a value given to a bare flag.
    """
    table = _option_table(parser)
    argv: list[str] = []
    dests: set[str] = set()
    for key, value in sglang_args.items():
        action = table.get(key)
        if action is None:
            close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.75)
            hint = f" (did you mean {_flag(close[0])}?)" if close else ""
            raise SlimeConfigError(
                f"{_flag(key)}: the installed SGLang's server has no flag --{key.replace('_', '-')}{hint}")
        if action.dest in MANAGED_FLAGS:
            raise SlimeConfigError(f"{_flag(key)} is set by slime for every engine; use {MANAGED_FLAGS[action.dest]}")
        if action.dest in ONE_ONLY_FLAGS and str(value) != "1":
            raise SlimeConfigError(
                f"{_flag(key)} {value}: slime gives each SGLang engine --rollout-num-gpus-per-engine devices "
                f"as one tensor-parallel group; run more engines with --rollout-num-gpus instead")
        takes_value, value_optional = action.nargs != 0, action.nargs in ("?", "*")
        if takes_value and value is True and not value_optional:
            raise SlimeConfigError(f"{_flag(key)} needs a value")
        if not takes_value and value is not True:
            raise SlimeConfigError(f"{_flag(key)} is a switch and takes no value (got {value!r})")
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            if action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1):
                argv.extend(str(value).split())
            else:
                argv.append(str(value))
        dests.add(action.dest)
    return argv, dests


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
        import ray

        if not ray.is_initialized():
            return None, []
        node_id = ray.get_runtime_context().get_node_id()
        gpus = next((int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["NodeID"] == node_id), 0)
        return (gpus or None), list(ray.get_gpu_ids())
    except Exception as e:  # noqa: BLE001 - placement falls back to the flags
        logger.warning("could not read the Ray node's GPUs (%s); assuming --actor-num-gpus-per-node per node", e)
        return None, []


def sglang_command(args, rank: int, host: str, port: int, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """Command line of SGLang engine `rank` serving on host:port.

    Checked by parsing it with the installed SGLang's own parser (so a bad value, e.g.
    `--sglang-mem-fraction-static abc` or an unknown `--sglang-attention-backend`, fails here,
    naming the flag).
    """
    from slime.engines.launcher import free_port

    if parser is None:
        parser = sglang_parser()
    user, user_dests = forwarded_flags(args.sglang_args, parser)
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
    forwarded_flags(args.sglang_args, sglang_parser())


# ---------------------------------------------------------------- weight sync


def broadcast_layout(num_engines: int, tp_size: int) -> tuple[int, list[int]]:
    """(world_size, rank_offset per engine) of the weight-update group: the trainer is rank 0
    and engine i's tensor-parallel rank r joins as `rank_offset[i] + r` (SGLang adds its
    tp_rank to the rank_offset it is given)."""
    if num_engines < 1 or tp_size < 1:
        raise ValueError(f"need num_engines >= 1 and tp_size >= 1, got {num_engines}, {tp_size}")
    return 1 + num_engines * tp_size, [1 + i * tp_size for i in range(num_engines)]


# ---------------------------------------------------------------- control calls


def _ok(resp: Any, client: EngineClient, path: str) -> Any:
    """SGLang answers {"success": false, "message": ...} with HTTP 400 (EngineClient raises);
    this also catches a 200 that says success: false."""
    if isinstance(resp, dict) and resp.get("success") is False:
        raise EngineError(f"POST {client.base_url}{path} did not succeed: {resp.get('message', resp)!r}",
                          url=client.base_url, endpoint=path, server_message=str(resp.get("message")))
    return resp


class SGLangControl:
    """The control calls slime makes to one SGLang server (or the native engine).

    Bodies carry only fields of SGLang's request structs; optional fields slime does not
    need are left out so SGLang's defaults apply. Methods raise EngineError on failure.
    """

    def __init__(self, client: EngineClient):
        self.client = client

    # -- generation
    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by rid, or every request when rid is None (AbortReq)."""
        body = {"rid": rid} if rid is not None else {"abort_all": True}
        await self.client.post("/abort_request", body)

    async def pause(self, mode: str = "retract") -> None:
        """Stop scheduling (PauseGenerationReqInput). 'retract' keeps the requests and
        recomputes their KV after /continue_generation; 'abort' returns them at once as
        aborted; 'in_place' keeps their KV (a cache flush then fails)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self.client.post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.client.post("/continue_generation", {})

    async def flush_cache(self) -> None:
        """Drop the prefix cache. SGLang answers 400 while requests are running or queued."""
        await self.client.post("/flush_cache", {})

    # -- memory (colocation)
    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Free GPU memory (ReleaseMemoryOccupationReqInput; tags 'weights' / 'kv_cache',
        None = both). SGLang needs --enable-memory-saver, which --colocate adds."""
        await self.client.post("/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.client.post("/resume_memory_occupation", {"tags": tags} if tags else {})

    # -- weights
    async def weight_version(self) -> str:
        """The served weight version: `/model_info` (SGLang >= 0.5.x, which has no
        /get_weight_version), else the older `/get_model_info` (native engine, older SGLang)."""
        try:
            info = await self.client.get("/model_info")
        except EngineError as e:
            if e.status != 404:
                raise
            info = await self.client.get("/get_model_info")
        return str(info["weight_version"])

    async def begin_weight_update(self) -> bool:
        """Open SGLang's weight-update session (newer SGLang refuses tensor/distributed updates
        outside one). Returns False when the server has no such endpoint (404: older SGLang,
        native engine), where none is needed."""
        return await self._optional("/begin_weight_update")

    async def end_weight_update(self) -> bool:
        return await self._optional("/end_weight_update")

    async def _optional(self, path: str) -> bool:
        try:
            _ok(await self.client.post(path, {}), self.client, path)
        except EngineError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                       flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        """Reload weights from a Hugging Face directory (UpdateWeightFromDiskReqInput)."""
        body = {"model_path": model_path, "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return _ok(await self.client.post("/update_weights_from_disk", body), self.client, "/update_weights_from_disk")

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict:
        """Join the trainer's broadcast group (InitWeightsUpdateGroupReqInput). Blocks in the
        server until every rank of the group has joined."""
        body = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                "world_size": int(world_size), "group_name": group_name, "backend": backend}
        return _ok(await self.client.post("/init_weights_update_group", body), self.client,
                   "/init_weights_update_group")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: str | None = None, flush_cache: bool = True) -> dict:
        """Receive one bucket broadcast by rank 0 in `names` order (UpdateWeightsFromDistributedReqInput).
        dtypes are torch names without the 'torch.' prefix ('bfloat16')."""
        body = {"names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
                "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return _ok(await self.client.post("/update_weights_from_distributed", body), self.client,
                   "/update_weights_from_distributed")

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return _ok(await self.client.post("/destroy_weights_update_group", {"group_name": group_name}),
                   self.client, "/destroy_weights_update_group")

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], weight_version: str | None = None,
                                         flush_cache: bool = True, load_format: str | None = None) -> dict:
        """Colocated update (UpdateWeightsFromTensorReqInput): one base64 string per engine TP
        rank, each a torch-multiprocessing pickle of [(name, cuda tensor), ...] that the engine
        opens by CUDA IPC. Producing those strings is the trainer's job (see the docs)."""
        if not serialized_named_tensors or not all(isinstance(s, str) for s in serialized_named_tensors):
            raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings, one per TP rank")
        body: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors), "flush_cache": flush_cache}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return _ok(await self.client.post("/update_weights_from_tensor", body), self.client,
                   "/update_weights_from_tensor")
