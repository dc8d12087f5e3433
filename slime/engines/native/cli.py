"""The native engine's command line: its parser, and the command slime runs for engine `rank`."""

from __future__ import annotations

import argparse
import sys

from slime.engines.auth import add_access_flags
from slime.engines.native.limits import ServerLimits
from slime.engines.passthrough import PassThrough, option_table
from slime.utils.threads import cpu_threads


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


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
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (default: $OMP_NUM_THREADS if set, else the usable CPU count)")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant numerics (SGLang's flag): each sequence is its own forward and is sampled "
                        "from its own generator, so its tokens and log-probs do not depend on its batch neighbours "
                        "(slime's --deterministic-mode; docs/reproducibility.md)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="accepted for SGLang's flag of that name and changes nothing: the native engine always "
                        "serves /generate's return_routed_experts for a mixture-of-experts model (the experts "
                        "each token was routed to, recorded only for the requests that ask)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="streamed /generate events carry only the text, output_ids and log-probs new since the "
                        "previous event (SGLang's flag); default: cumulative")
    p.add_argument("--log-level", default="warning")
    add_request_limit_flags(p)
    add_access_flags(p)
    return p


def add_request_limit_flags(p: argparse.ArgumentParser) -> None:
    """What one request may ask of the server (slime/engines/native/limits.py, docs/security.md)."""
    d = ServerLimits()
    p.add_argument("--max-request-bytes", type=_positive(int), default=d.max_request_bytes,
                   help="largest body of a generation route (/generate, /v1/completions, /v1/chat/completions); "
                        "larger ones are refused (413) before they are read. Default: --max-prompts-per-request x "
                        "--max-prompt-tokens x 16 bytes + 1 MiB, at most 256 MiB")
    p.add_argument("--max-prompts-per-request", type=_positive(int), default=d.max_prompts_per_request,
                   help="most prompts in one request (a /generate batch, an OpenAI prompt list)")
    p.add_argument("--max-prompt-tokens", type=_positive(int), default=d.max_prompt_tokens,
                   help="most tokens in one prompt (default and at most: the context length - 1)")
    p.add_argument("--max-queued-requests", type=_positive(int), default=d.max_queued_requests,
                   help="generations running and waiting at once; a request whose n x prompts do not fit is "
                        "refused with 429")
    p.add_argument("--weight-group-timeout", type=_positive(float), default=d.weight_group_timeout,
                   help="seconds a weight-group rendezvous or broadcast waits for its peers before it fails")
    p.add_argument("--trust-request-templates", action="store_true",
                   help="accept a chat template in a request (chat_template, chat_template_kwargs.chat_template); "
                        "refused by default")


def limits_of(args) -> ServerLimits:
    """The `ServerLimits` the flags of `build_parser` set."""
    return ServerLimits(max_request_bytes=args.max_request_bytes, max_prompts_per_request=args.max_prompts_per_request,
                        max_prompt_tokens=args.max_prompt_tokens, max_queued_requests=args.max_queued_requests,
                        trust_request_templates=args.trust_request_templates,
                        weight_group_timeout=args.weight_group_timeout)


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
