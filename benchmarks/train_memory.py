"""Peak memory and step time of one train rank with each memory feature of the trainer off and on.

    python benchmarks/train_memory.py [--samples 64] [--tokens 180] [--model DIR] [--threads 2]

One GRPO micro-batch of `--samples` samples of about `--tokens` tokens (prompt 60, response the
rest), KL loss on (so a reference model exists), one optimizer step of SmolLM2-135M-Instruct
(converted once into ~/.cache/slime, see slime/utils/pretrained.py; `--model` for another
directory) on the FSDP backend, one rank. Each configuration runs in its own process and takes two
steps (the first creates AdamW's state, at its end); the process's peak RSS (ru_maxrss: on a CPU
the host copy of everything counts), the peak RSS during the second step (the steady state:
model, optimizer state and the step's activations; Linux's /proc/self/clear_refs restarts the
count) and the second step's time (reference forward, then forward + backward + AdamW) are
printed as a table. Each process runs with glibc's mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_`,
LIVE_MEMORY_ENV below): otherwise freed activation memory stays in the heap and the RSS shows the
heap's high-water mark rather than what is live (LoRA and full fine-tuning then peak alike).

- base: fp32, full logits (`--log-probs-chunk-size 0`), no recompute;
- each feature alone: `--bf16`, `--gradient-checkpointing`, chunked log-probs
  (`--log-probs-chunk-size 1024`), `--optimizer-cpu-offload` (a no-op on a CPU);
- all of them on (the defaults of this build plus `--bf16 --gradient-checkpointing`);
- LoRA (`--lora-rank 16` on every linear layer; the KL reference is the base with the adapter off, so
  no reference copy; AdamW state for the adapter only; with `--bf16` the frozen base is kept in
  bf16), alone, in fp32 with recompute and chunked log-probs, and with the other features on.

The reference model is sharded like the policy; with one CPU rank that is one plain copy. What it
costs is the difference between "all on" and the same with the KL loss off (no reference model),
printed below the table. The learning-rate schedule changes no memory.

On a GPU the same command reports the CUDA peak (`torch.cuda.max_memory_allocated`, the whole
process and the second step alone, as the trainer logs it in `memory/train_cuda_peak_mb`) beside
the peak RSS, and the model TFLOP/s of the second step (`perf/train_model_tflops`); the reference
then lives in pinned host memory and comes to the device layer by layer for its forward only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# glibc raises its mmap threshold as large blocks are freed, after which freed activations stay in
# its heap and the process's RSS keeps the heap's high-water mark: a fixed threshold returns every
# large block to the system when it is freed, so the peak RSS is that of live memory
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}

# "all on" without the KL loss, hence without a reference model: what the reference adds is the
# difference between the two rows (printed below the table)
NO_REFERENCE = "all on, KL loss off (no reference model)"
CONFIGS = {
    "base (fp32, full logits)": ["--log-probs-chunk-size", "0"],
    "--bf16": ["--log-probs-chunk-size", "0", "--bf16"],
    "--gradient-checkpointing": ["--log-probs-chunk-size", "0", "--gradient-checkpointing"],
    "chunked log-probs (1024)": ["--log-probs-chunk-size", "1024"],
    "--optimizer-cpu-offload": ["--log-probs-chunk-size", "0", "--optimizer-cpu-offload"],
    "all on": ["--log-probs-chunk-size", "1024", "--bf16", "--gradient-checkpointing", "--optimizer-cpu-offload"],
    "fp32, recompute + chunked": ["--log-probs-chunk-size", "1024", "--gradient-checkpointing"],
    "--lora-rank 16": ["--log-probs-chunk-size", "0", "--lora-rank", "16"],
    "--lora-rank 16, fp32, recompute + chunked": ["--log-probs-chunk-size", "1024", "--gradient-checkpointing",
                                                  "--lora-rank", "16"],
    "--lora-rank 16 + all on": ["--log-probs-chunk-size", "1024", "--bf16", "--gradient-checkpointing", "--lora-rank",
                               "16"],
    NO_REFERENCE: ["--log-probs-chunk-size", "1024", "--bf16", "--gradient-checkpointing", "--optimizer-cpu-offload"],
}


def _batch(n: int, tokens: int, vocab: int):
    from slime.types import RolloutBatch

    g = torch.Generator().manual_seed(0)
    prompt = min(60, tokens // 3)
    toks, lengths = [], []
    for _ in range(n):
        r = tokens - prompt + int(torch.randint(-10, 11, (1,), generator=g))
        toks.append(torch.randint(5, vocab, (prompt + r,), generator=g).tolist())
        lengths.append(r)
    rewards = torch.randn(n, generator=g).tolist()
    return RolloutBatch(tokens=toks, response_lengths=lengths, loss_masks=[[1] * r for r in lengths], rewards=rewards,
                        raw_rewards=list(rewards), rollout_log_probs=[[0.0] * r for r in lengths],
                        group_indices=[i // 8 for i in range(n)])


def run_one(model: str, samples: int, tokens: int, threads: int, flags: list[str], kl: bool = True) -> dict:
    from transformers import AutoConfig

    from slime.arguments import parse_args
    from slime.training.actor import TrainActor
    from slime.utils.net import free_port

    tmp = Path(tempfile.mkdtemp(prefix="slime-mem-"))
    (tmp / "prompts.jsonl").write_text('{"input": "x"}\n')
    args = parse_args(["--hf-checkpoint", model, "--prompt-data", str(tmp / "prompts.jsonl"), "--num-rollout", "1",
                       "--rollout-batch-size", str(samples // 8), "--n-samples-per-prompt", "8",
                       "--global-batch-size", str(samples), "--micro-batch-size", str(samples),
                       *(["--use-kl-loss", "--kl-loss-coef", "0.01"] if kl else []), "--rollout-temperature", "1.0",
                       "--output-dir", str(tmp / "out"), *flags])
    actor = TrainActor(args, rank=0, world_size=1, master_port=free_port())
    actor.init()
    torch.set_num_threads(threads)
    batch = _batch(samples, tokens, AutoConfig.from_pretrained(model).vocab_size)
    t0 = time.perf_counter()
    actor.train(0, batch)  # the first step also creates the optimizer's state (after its activations are gone)
    first_seconds = time.perf_counter() - t0
    first_peak = _peak_rss_mb()
    cuda_first_peak = _cuda_peak_mb()
    _reset_peak_rss()  # from here on the peak is the second step's own: the steady state
    t0 = time.perf_counter()
    metrics = actor.train(1, batch)  # on CUDA the trainer's own meter restarts the device's peak count
    seconds = time.perf_counter() - t0
    step_peak = _peak_rss_mb()
    actor.shutdown()
    out = {"peak_rss_mb": max(first_peak, step_peak), "step_peak_rss_mb": step_peak, "seconds": seconds,
           "first_step_seconds": first_seconds, "loss": metrics["train/loss"],
           "model_tflops": metrics["perf/train_model_tflops"]}
    if torch.cuda.is_available():
        out["cuda_peak_mb"] = max(cuda_first_peak, metrics["memory/train_cuda_peak_mb"])
        out["step_cuda_peak_mb"] = metrics["memory/train_cuda_peak_mb"]
    return out


def _cuda_peak_mb() -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss() -> None:
    """Linux: restart the process's peak RSS count (VmHWM / ru_maxrss) at its current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--tokens", type=int, default=180)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write one JSON line per configuration here")
    p.add_argument("--configs", default=None, help="';'-separated names of CONFIGS to run (default: all)")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.only is not None:
        print(json.dumps(run_one(a.model, a.samples, a.tokens, a.threads, CONFIGS[a.only], kl=a.only != NO_REFERENCE)))
        return
    if a.model is None:
        from slime.utils.pretrained import smollm2_135m_instruct

        a.model = str(smollm2_135m_instruct())
    cuda = torch.cuda.is_available()
    where = torch.cuda.get_device_name() if cuda else f"{a.threads} threads"
    print(f"one GRPO step, {a.samples} samples x ~{a.tokens} tokens, KL loss on, {Path(a.model).name}, one rank, "
          f"{where}")
    if cuda:
        print("| configuration | CUDA peak | CUDA peak of the 2nd step | peak RSS | 2nd step time | model TFLOP/s |")
        print("|---|---|---|---|---|---|")
    else:
        print("| configuration | peak RSS | peak RSS of the 2nd step | 2nd step time |")
        print("|---|---|---|---|")
    results = {}
    for name in (a.configs.split(";") if a.configs else CONFIGS):
        out = subprocess.run([sys.executable, __file__, f"--only={name}", "--model", a.model, "--samples",
                              str(a.samples), "--tokens", str(a.tokens), "--threads", str(a.threads)],
                             capture_output=True, text=True, env=dict(os.environ, **LIVE_MEMORY_ENV))
        if out.returncode != 0:
            why = ("killed (out of memory)" if out.returncode == -9 else
                   f"failed (exit {out.returncode}): {(out.stderr.strip().splitlines() or [''])[-1][:100]}")
            print(f"| {name} | {why} | | |", flush=True)
            continue
        r = results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        if cuda:
            print(f"| {name} | {r['cuda_peak_mb'] / 1024:.2f} GiB | {r['step_cuda_peak_mb'] / 1024:.2f} GiB | "
                  f"{r['peak_rss_mb'] / 1024:.2f} GiB | {r['seconds']:.2f} s | {r['model_tflops']:.1f} |", flush=True)
        else:
            print(f"| {name} | {r['peak_rss_mb'] / 1024:.2f} GiB | {r['step_peak_rss_mb'] / 1024:.2f} GiB | "
                  f"{r['seconds']:.1f} s |", flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"config": name, "device": where, **r}) + "\n")
    if "all on" in results and NO_REFERENCE in results:
        key = "cuda_peak_mb" if cuda else "peak_rss_mb"
        with_ref, without = results["all on"][key], results[NO_REFERENCE][key]
        print(f"\nthe KL reference model adds {(with_ref - without) / 1024:.2f} GiB "
              f"({100 * (with_ref - without) / without:.1f}%) to the {'CUDA peak' if cuda else 'peak RSS'} "
              f"of 'all on'")

if __name__ == "__main__":
    main()
