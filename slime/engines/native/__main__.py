"""Serve one native engine standalone, the way `sglang.launch_server` does.

    python -m slime.engines.native --model-path DIR --host 127.0.0.1 --port 30000
"""

from __future__ import annotations

import os

# Sleep rather than spin between OpenMP regions: a spinning intra-op pool next to the
# event-loop thread (and other engines / trainers on the same cores) can slow decoding
# down by 10-100x. Must be set before torch is imported; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import asyncio  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from aiohttp import web  # noqa: E402

from slime.engines.auth import access_of  # noqa: E402
from slime.engines.native.cli import build_parser, limits_of  # noqa: E402
from slime.engines.native.engine import NativeEngine  # noqa: E402
from slime.engines.native.server import create_app  # noqa: E402


async def _serve(args) -> None:
    engine = NativeEngine(
        args.model_path,
        tokenizer_path=args.tokenizer_path,
        dtype=args.dtype,
        device=args.device,
        max_running_requests=args.max_running_requests,
        num_threads=args.num_threads,
        random_seed=args.random_seed,
        context_length=args.context_length,
        max_prefill_tokens=args.max_prefill_tokens,
        max_total_tokens=args.max_total_tokens,
        deterministic=args.enable_deterministic_inference,
    )
    access = access_of(args)
    if access.api_key is None:
        logging.getLogger(__name__).warning("no --api-key: any local process may call this engine "
                                            "(docs/security.md)")
    app = create_app(engine, incremental_streaming_output=args.incremental_streaming_output, access=access,
                     limits=limits_of(args))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    print(f"slime native engine ready on http://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        engine.abort(abort_all=True)  # in-flight requests answer with their partial output
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not os.path.isdir(args.model_path):
        print(f"error: --model-path {args.model_path!r} is not a directory", file=sys.stderr, flush=True)
        return 2
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        print(f"error: --model-path {args.model_path!r} has no config.json (not a Hugging Face model directory)",
              file=sys.stderr, flush=True)
        return 2
    if args.tokenizer_path is not None and not os.path.isdir(args.tokenizer_path):
        print(f"error: --tokenizer-path {args.tokenizer_path!r} is not a directory", file=sys.stderr, flush=True)
        return 2
    try:
        asyncio.run(_serve(args))
    except OSError as e:  # e.g. port in use
        print(f"error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the slow interpreter teardown of torch/transformers (~2 s)
