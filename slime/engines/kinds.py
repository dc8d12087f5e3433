"""The engine kinds slime runs, each declared once: `--rollout-backend native | sglang | vllm`.

An `EngineKind` says everything that differs between them:
- `command(args, rank, host, port)`: the server command line of engine `rank`, with the kind's
  pass-through flags (`--sglang-*`, `--vllm-*`; `slime.engines.passthrough`) forwarded by its rule;
- `check(args)`: the parse-time checks (installed, pass-through flags valid), run by
  `slime.argument_checks.validate_engines` before anything starts;
- `update_weights_modes` and `default_update_weights_mode(colocate)`: how weights may reach it
  (`--update-weights-mode`; `auto` resolves here) and `weight_group_ranks(args)`: how many ranks one
  engine joins a broadcast group with; `weight_update_sessions`: SGLang's begin/end around a push;
- `pause_mode`: how `/pause_generation` holds the requests in flight while the weights change;
- `deterministic_flags(args)` / `launch_env(args)`: what `--deterministic-mode` turns on in the server
  (batch-invariant numerics): `--enable-deterministic-inference` for the native engine and SGLang,
  `VLLM_BATCH_INVARIANT=1` for vLLM (docs/reproducibility.md).

Nothing else in slime branches on the engine kind: code asks `engine_kind(args)`.
"""

from __future__ import annotations

from slime.engines.auth import run_weight_dirs
from slime.engines.native.cli import native_command
from slime.engines.sglang import check_sglang_args, sglang_command
from slime.engines.vllm.launch import check_vllm_args, checkpoint_dtype, vllm_command
from slime.utils.errors import SlimeConfigError

UPDATE_WEIGHTS_MODES = ("auto", "tensor", "distributed", "disk")
POLICY_LORA_NAME = "slime-policy"  # the name engines serve the trained LoRA adapter under (--lora-sync adapter)


class EngineKind:
    name: str = ""
    update_weights_modes: tuple[str, ...] = ("tensor", "distributed")
    weight_update_sessions = False
    serves_lora_adapters = True  # /load_lora_adapter, /unload_lora_adapter and /generate's lora_path
    # whether an adapter can be swapped while requests using it are paused (--fully-async): SGLang and
    # the vLLM adapter unload only once the adapter's running requests finish
    swaps_lora_under_pause = False
    pause_mode: str | None = None  # None: the server's own (the native engine and vLLM hold requests in place)
    returns_routed_experts = True  # /generate's return_routed_experts (R3, --use-rollout-routing-replay)
    takes_images = True  # /generate's image_data (--multimodal-keys)
    # pushed weights carry the checkpoint's names (per-expert MoE weights), as the server loads them;
    # False: transformers' in-memory names (the native engine is a transformers model)
    loads_checkpoint_names = True

    def command(self, args, rank: int, host: str, port: int) -> list[str]:
        raise NotImplementedError

    def launch_command(self, args, rank: int, host: str, port: int, master_addresses: list[str]) -> list[str]:
        """What the launcher runs: `command` with the `access_flags` where the server reads them."""
        return (self.command(args, rank, host, port) + self.deterministic_flags(args)
                + self.access_flags(args, master_addresses))

    def deterministic_flags(self, args) -> list[str]:
        """--deterministic-mode: the server flag of batch-invariant numerics (SGLang's name; the
        native engine takes the same one)."""
        return ["--enable-deterministic-inference"] if args.deterministic_mode else []

    def launch_env(self, args) -> dict[str, str]:
        """Environment variables the server process needs on top of the launcher's."""
        return {}

    def check(self, args) -> None:
        """Parse-time checks of the kind's own flags; raises SlimeConfigError naming the flag."""

    def access_flags(self, args, master_addresses: list[str]) -> list[str]:
        """What the server is told about who may call it (slime.engines.auth); the key itself goes
        in the environment (`SLIME_ENGINE_API_KEY`), never on slime's own servers' command lines."""
        return ["--weight-dirs", *run_weight_dirs(args), "--allowed-master-addresses", *master_addresses]

    def default_update_weights_mode(self, colocate: bool) -> str:
        """What `--update-weights-mode auto` means: a broadcast group for engines on their own
        devices; with --colocate, what the kind takes from a process on the same device."""
        return "tensor" if colocate else "distributed"

    def resolve_update_weights_mode(self, mode: str, colocate: bool) -> str:
        mode = self.default_update_weights_mode(colocate) if mode == "auto" else mode
        if mode not in self.update_weights_modes:
            raise SlimeConfigError(self.unsupported_mode_message(mode))
        return mode

    def unsupported_mode_message(self, mode: str) -> str:
        return (f"--update-weights-mode {mode} needs --rollout-backend native (SGLang and vLLM load whole model "
                f"directories from disk); use {' or '.join(self.update_weights_modes)}")

    def weight_group_ranks(self, args) -> int:
        """Ranks each engine joins the trainer's broadcast group with (one per tensor-parallel worker)."""
        return 1

    def own_args(self, args) -> dict:
        """The kind's pass-through flags ({key: value}): `--sglang-*`, or `--vllm-*` for vLLM."""
        return args.sglang_args

    def serve_dtype(self, args) -> str | None:
        """The dtype the engines serve in: the kind's own `dtype` flag, else bfloat16 with --bf16,
        else the kind's default (None: the engine decides, e.g. SGLang's `auto`). Weights are pushed
        in it."""
        given = self.own_args(args).get("dtype")
        if given and given != "auto":
            return given
        return "bfloat16" if args.bf16 else self.default_dtype(args)

    def default_dtype(self, args) -> str | None:
        return None


class NativeKind(EngineKind):
    """The embedded PyTorch engine: `python -m slime.engines.native`."""

    name = "native"
    loads_checkpoint_names = False
    update_weights_modes = ("tensor", "distributed", "disk")
    swaps_lora_under_pause = True  # the adapter is looked up by name at every step

    def command(self, args, rank, host, port):
        return native_command(args, rank, host, port, self.serve_dtype(args))

    def default_dtype(self, args):
        return "float32"  # the trainer's dtype on CPU

    def default_update_weights_mode(self, colocate):
        return "disk" if colocate else "distributed"  # colocated: same host, bytes through /dev/shm


class SGLangKind(EngineKind):
    """`python -m sglang.launch_server` with every `--sglang-*` flag, checked by SGLang's own parser."""

    name = "sglang"
    update_weights_modes = ("distributed",)
    weight_update_sessions = True  # SGLang >= 0.5.23 refuses weight updates outside one
    # SGLang's default pause mode aborts the running requests; retract keeps them queued and
    # recomputes their KV after the update (in_place would keep stale KV and refuse a cache flush)
    pause_mode = "retract"

    def command(self, args, rank, host, port):
        return sglang_command(args, rank, host, port, dtype=self.serve_dtype(args))

    def check(self, args):
        check_sglang_args(args)

    def access_flags(self, args, master_addresses):
        return ["--api-key", args.engine_api_key]  # SGLang's own flag (it reads no environment variable)

    def unsupported_mode_message(self, mode):
        # its /update_weights_from_tensor wants CUDA-IPC handles (not implemented here)
        return ("--rollout-backend sglang takes weights by broadcast (--update-weights-mode distributed) on its "
                "own GPUs; colocated SGLang (CUDA-IPC tensor updates) is not implemented, so drop --colocate")

    def weight_group_ranks(self, args):
        return args.rollout_num_gpus_per_engine


class VllmKind(EngineKind):
    """vLLM's OpenAI server (its own venv) behind slime's protocol adapter."""

    name = "vllm"
    returns_routed_experts = False  # vLLM's CPU build does not return the routing (the adapter refuses the field)
    takes_images = False  # the adapter's /v1/completions takes no images (docs/vlm.md)

    def command(self, args, rank, host, port):
        return vllm_command(args, rank, host, port, dtype=self.serve_dtype(args))

    def launch_command(self, args, rank, host, port, master_addresses):
        # the adapter's own flags come before the `--` that starts vLLM's command
        return vllm_command(args, rank, host, port, access=self.access_flags(args, master_addresses),
                            dtype=self.serve_dtype(args))

    def own_args(self, args):
        return args.vllm_args

    def deterministic_flags(self, args):
        return []  # vLLM has no such flag: batch invariance is an environment variable

    def launch_env(self, args):
        # vLLM's batch-invariant kernels (NVIDIA GPUs; docs.vllm.ai features/batch_invariance)
        return {"VLLM_BATCH_INVARIANT": "1"} if args.deterministic_mode else {}

    def default_dtype(self, args):
        return checkpoint_dtype(args.hf_checkpoint)  # vLLM's CPU backend would downcast float32 otherwise

    def check(self, args):
        check_vllm_args(args)  # the venv exists, no --vllm-* flag overrides a managed one

    def weight_group_ranks(self, args):  # --vllm-tensor-parallel-size, else the engine's devices
        return int(args.vllm_args.get("tensor_parallel_size", args.rollout_num_gpus_per_engine))


KINDS: dict[str, EngineKind] = {k.name: k for k in (NativeKind(), SGLangKind(), VllmKind())}


def engine_kind(args) -> EngineKind:
    """The kind of the run's engines (`--rollout-backend`)."""
    return KINDS[args.rollout_backend]
