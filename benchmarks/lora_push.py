"""Bytes and time of one weight push: LoRA adapter vs full weights, trainer -> native engine.

    python benchmarks/lora_push.py [--model DIR] [--rank 16] [--pushes 3] [--threads 2]

One native engine serving `--model` (default SmolLM2-135M-Instruct, converted once into
~/.cache/slime; see slime/utils/pretrained.py) on loopback, and one in-process train rank of the same
model pushing to it `--pushes` times in each configuration:

- full, `--update-weights-mode tensor`: every parameter as safetensors bytes in HTTP bodies;
- full, `--update-weights-mode disk`: every parameter through a file in /dev/shm;
- LoRA adapter (`--lora-rank R --lora-sync adapter`): the adapter as a peft directory, which the engine
  swaps in with `/unload_lora_adapter` + `/load_lora_adapter` + `/update_weight_version`;
- LoRA merged (`--lora-sync merged`, tensor mode): base + adapter merged into full weights.

Printed as a table: tensor bytes per push, bytes on the wire or disk, and the median seconds of a
push (gathering the tensors, serializing, the engine loading them). fp32 engine and trainer (CPU).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {
    "full, tensor": ["--update-weights-mode", "tensor"],
    "full, disk": ["--update-weights-mode", "disk"],
    "LoRA, adapter": ["--lora-sync", "adapter", "LORA"],
    "LoRA, merged (tensor)": ["--lora-sync", "merged", "--update-weights-mode", "tensor", "LORA"],
}


def _engine(model: str, key: str, weights_dir: str, threads: int, log: Path):
    from slime.engines.startup import wait_until_healthy
    from slime.utils.net import free_port

    port = free_port()
    env = dict(os.environ, SLIME_ENGINE_API_KEY=key)
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "slime.engines.native", "--model-path", model, "--port",
                                 str(port), "--num-threads", str(threads), "--weight-dirs", weights_dir],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, timeout=300, process=proc)
    return url, proc


def run(model: str, rank: int, pushes: int, threads: int) -> list[dict]:
    from slime.arguments import parse_args
    from slime.engines.auth import run_weights_dir
    from slime.training.actor import TrainActor
    from slime.utils.net import free_port

    key = secrets.token_hex(16)  # hex: a key starting with "-" would read as a flag
    saved = os.environ.get("SLIME_ENGINE_API_KEY")
    os.environ["SLIME_ENGINE_API_KEY"] = key  # the engine clients' key (restored at the end)
    tmp = Path(tempfile.mkdtemp(prefix="slime-lora-push-"))
    (tmp / "prompts.jsonl").write_text('{"input": "x"}\n')
    weights_dir = run_weights_dir(key)
    os.makedirs(weights_dir, mode=0o700, exist_ok=True)
    url, proc = _engine(model, key, weights_dir, threads, tmp / "engine.log")
    torch.set_num_threads(threads)
    rows = []
    try:
        for name, flags in CONFIGS.items():
            flags = [f for f in flags if f != "LORA"] + (["--lora-rank", str(rank)] if "LORA" in flags else [])
            args = parse_args(["--hf-checkpoint", model, "--prompt-data", str(tmp / "prompts.jsonl"),
                               "--num-rollout", "1", "--rollout-batch-size", "1", "--engine-api-key", key,
                               "--output-dir", str(tmp / "out"), *flags])
            actor = TrainActor(args, rank=0, world_size=1, master_port=free_port())
            actor.init()
            try:
                stats = [actor.update_weights([url], weight_version=v + 1) for v in range(pushes)]
            finally:
                actor.shutdown()
            rows.append({"config": name, "bytes": stats[-1]["bytes"], "payload_bytes": stats[-1].get("payload_bytes", 0),
                         "seconds": statistics.median(s["seconds"] for s in stats)})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if saved is None:
            os.environ.pop("SLIME_ENGINE_API_KEY", None)
        else:
            os.environ["SLIME_ENGINE_API_KEY"] = saved
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if a.model is None:
        from slime.utils.pretrained import smollm2_135m_instruct

        a.model = str(smollm2_135m_instruct())
    rows = run(a.model, a.rank, a.pushes, a.threads)
    print(f"one weight push to one native engine, {Path(a.model).name}, fp32, LoRA rank {a.rank} on every linear "
          f"layer; median of {a.pushes} pushes")
    print("| configuration | tensor bytes | bytes sent or written | seconds |")
    print("|---|---|---|---|")
    for r in rows:
        sent = f"{r['payload_bytes'] / 2**20:.2f} MiB" if r["payload_bytes"] else "-"
        print(f"| {r['config']} | {r['bytes'] / 2**20:.2f} MiB | {sent} | {r['seconds']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
