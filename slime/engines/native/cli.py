"""The native engine's command line: its parser, and the command slime runs for engine `rank`."""

from __future__ import annotations

import argparse
import sys

from slime.engines.auth import add_access_flags
from slime.engines.passthrough import PassThrough, option_table
from slime.utils.threads import cpu_threads


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slime.engines.native", description=__doc__.strip().splitlines()[0])
    p.add_argument("--model-path", required=True, help="Hugging Face model directory")
    p.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--max-running-requests", type=int, default=128)
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="prompt tokens admitted per prefill step")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV cache budget in tokens (rows x padded length of the running batch); requests wait "
                        "when admitting them could exceed it. Default: 30%% of free memory")
    p.add_argument("--context-length", type=int, default=None, help="defaults to the config's max_position_embeddings")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: $OMP_NUM_THREADS if set, else the usable CPU count)")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="streamed /generate events carry only the text, output_ids and log-probs new since the "
                        "previous event (SGLang's flag); default: cumulative")
    p.add_argument("--log-level", default="warning")
    add_access_flags(p)
    return p


# --sglang-* flags are written for SGLang's server; the native engine takes the ones it shares
# (max-running-requests, context-length, random-seed, dtype, device, ...) and skips the rest with
# a warning, so a run can switch --rollout-backend without editing its flags.
NATIVE_PASS_THROUGH = PassThrough("--sglang-", "the native engine", options=option_table(build_parser()),
                                  managed={"model_path": "use --hf-checkpoint", "host": "slime binds every engine",
                                           "port": "slime picks a free port per engine",
                                           "api_key": "use --engine-api-key",
                                           "weight_dirs": "slime passes the run's directories",
                                           "allowed_master_addresses": "slime passes the cluster's addresses"},
                                  strict=False)


def native_command(args, rank: int, host: str, port: int, dtype: str = "float32") -> list[str]:
    """Command line of the embedded engine for engine `rank` serving in `dtype`; the `--sglang-*`
    flags it shares with SGLang's server come last and override slime's defaults (argparse keeps
    the last value)."""
    extra, _ = NATIVE_PASS_THROUGH.forward(args.sglang_args)
    return [
        sys.executable, "-m", "slime.engines.native",
        "--model-path", args.hf_checkpoint,
        "--host", host,
        "--port", str(port),
        "--num-threads", str(cpu_threads(args, "rollout")),
        "--random-seed", str(args.seed + rank),
        "--dtype", dtype,
        *extra,
    ]
