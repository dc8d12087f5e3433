"""How close the trainer is to the machine: the quickstart's train step in model FLOP/s over the
dense matmul rate torch reaches on the same machine, in the same process.

    python benchmarks/train_mfu.py [--steps 3] [--threads 2] [--profile] [-- extra train flags]

The step is the quickstart's (examples/quickstart.py, SmolLM2-135M-Instruct): one GRPO rollout of
64 samples (8 prompts x 8) of the quickstart task's chat-templated prompts with responses of
8-48 tokens (mean about 24, as the quickstart's rollouts), `--micro-batch-size 8`, KL loss on
(a reference forward), one optimizer step, on one rank with the trainer's defaults. Extra flags
after `--` go to the trainer (for example `-- --bf16`).

- model FLOPs of a step: 6 x parameters x tokens (forward + backward) plus 2 x parameters x
  tokens for the reference forward (every token of the batch, prompt and response);
- machine rate: the best of several 2048 x 2048 x 2048 matmuls (8192 on a GPU) in the training dtype (fp32,
  or bf16 with `--bf16`), measured with the same threads before every timed step and after the
  last, the best of all these;
- ratio = (model FLOPs / median step time) / machine rate.

A shared machine's speed drifts within a run (on the 2-core development VM the 2048^3 rate moved
between 147 and 193 GFLOP/s in one run), so the record also pairs each step with the matmul rate
measured just before it: `paired_ratio` is the median of the steps' (model FLOP/s / that rate).

On a GPU the same command measures the CUDA device (the matmul is 8192^3 there, in the training
dtype; every timer synchronizes the device) and also prints the step's CUDA peak memory.

A breakdown of the median step is printed beside it (reference forward, training forward +
backward, optimizer, the rest), and the rate the model's own GEMMs reach at the step's shapes
(the linear layers of one micro-batch, timed alone), which bounds what the step can reach on this
machine. `--profile` adds torch.profiler's top operators of one step by self CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

SAMPLES, PER_PROMPT = 64, 8
QUICKSTART_FLAGS = ["--micro-batch-size", "8", "--use-kl-loss", "--kl-loss-coef", "0.001", "--lr", "2e-5",
                    "--rollout-temperature", "1.0", "--apply-chat-template", "--input-key", "prompt"]


def quickstart_batch(model: str, seed: int = 0):
    """64 samples shaped like a quickstart rollout: the task's chat-templated prompts (8 distinct,
    8 samples each), random response tokens of 8-48 tokens, random rewards."""
    from tasks import quickstart_problems
    from transformers import AutoTokenizer

    from slime.types import RolloutBatch

    tok = AutoTokenizer.from_pretrained(model)
    g = torch.Generator().manual_seed(seed)
    problems = quickstart_problems()
    toks, lengths = [], []
    for p in range(SAMPLES // PER_PROMPT):
        question = problems[int(torch.randint(len(problems), (1,), generator=g))][0]
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True) if tok.chat_template else question
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        for _ in range(PER_PROMPT):
            r = int(torch.randint(8, 49, (1,), generator=g))
            toks.append(prompt + torch.randint(5, tok.vocab_size, (r,), generator=g).tolist())
            lengths.append(r)
    rewards = torch.randint(0, 2, (SAMPLES,), generator=g).float().tolist()
    return RolloutBatch(tokens=toks, response_lengths=lengths, loss_masks=[[1] * r for r in lengths],
                        rewards=rewards, raw_rewards=list(rewards), rollout_log_probs=[[0.0] * r for r in lengths],
                        group_indices=[i // PER_PROMPT for i in range(SAMPLES)])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_rate(dtype: torch.dtype, n: int | None = None, reps: int = 5) -> float:
    """Best FLOP/s of an n x n x n matmul in `dtype` on the training device (n: 2048 on a CPU,
    8192 on a GPU, where smaller products do not fill the device)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = n or (8192 if device == "cuda" else 2048)
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    _sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def model_gemm_rate(model: torch.nn.Module, tokens: int, dtype: torch.dtype, reps: int = 3) -> float:
    """FLOP/s of the model's linear layers (each weight once, the output layer included) on a
    [tokens, in] input: forward only, best of `reps` passes, in `dtype`, on the training device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight
            w = w.full_tensor() if hasattr(w, "full_tensor") else w
            shapes.setdefault(tuple(w.shape), 0)
            shapes[tuple(w.shape)] += 1
    flops, best = 0, float("inf")
    xs = {s: (torch.randn(tokens, s[1], device=device).to(dtype), torch.randn(s, device=device).to(dtype))
          for s in shapes}
    for s, (x, w) in xs.items():
        flops += 2 * tokens * s[0] * s[1] * shapes[s]
    for _ in range(reps + 1):  # the first pass warms up (kernel selection on a GPU)
        _sync()
        t0 = time.perf_counter()
        for s, (x, w) in xs.items():
            for _ in range(shapes[s]):
                torch.nn.functional.linear(x, w)
        _sync()
        best = min(best, time.perf_counter() - t0)
    return flops / best


class Timers:
    """Seconds spent in the reference forward and the optimizer step of the backend's train step."""

    def __init__(self, backend):
        self.ref = self.opt = 0.0
        forward, step = backend.forward_logprobs, backend.optimizer.step

        def timed_forward(*a, **k):
            t0 = time.perf_counter()
            try:
                return forward(*a, **k)
            finally:
                if k.get("ref"):
                    _sync()
                    self.ref += time.perf_counter() - t0

        def timed_step(*a, **k):
            _sync()
            t0 = time.perf_counter()
            try:
                return step(*a, **k)
            finally:
                _sync()
                self.opt += time.perf_counter() - t0

        backend.forward_logprobs = timed_forward
        backend.optimizer.step = timed_step

    def reset(self) -> None:
        self.ref = self.opt = 0.0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top operators of one step")
    p.add_argument("--json", default=None, help="also append the record here (JSON lines)")
    p.add_argument("train_flags", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    extra = a.train_flags[1:] if a.train_flags[:1] == ["--"] else a.train_flags
    torch.set_num_threads(a.threads)
    if a.model is None:
        from slime.utils.pretrained import smollm2_135m_instruct

        a.model = str(smollm2_135m_instruct())

    from slime.arguments import parse_args
    from slime.training.actor import TrainActor
    from slime.utils.net import free_port

    tmp = Path(tempfile.mkdtemp(prefix="slime-mfu-"))
    (tmp / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    args = parse_args(["--hf-checkpoint", a.model, "--prompt-data", str(tmp / "prompts.jsonl"), "--num-rollout", "1",
                       "--rollout-batch-size", str(SAMPLES // PER_PROMPT), "--n-samples-per-prompt", str(PER_PROMPT),
                       "--global-batch-size", str(SAMPLES), "--output-dir", str(tmp / "out"),
                       *QUICKSTART_FLAGS, *extra])
    actor = TrainActor(args, rank=0, world_size=1, master_port=free_port())
    actor.init()
    torch.set_num_threads(a.threads)
    backend = actor.backend
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    batch = quickstart_batch(a.model)
    n_tokens = sum(len(t) for t in batch.tokens)
    n_params = sum((p.full_tensor() if hasattr(p, "full_tensor") else p).numel() for p in backend.model.parameters())
    flops = (6 + (2 if args.use_kl_loss else 0)) * n_params * n_tokens

    timers = Timers(backend)
    actor.train(0, batch)  # warm-up: first-call costs (allocator, lazy initialization)
    steps = []
    for i in range(a.steps):
        rate = matmul_rate(dtype)  # the machine just before this step (a shared machine drifts)
        timers.reset()
        t0 = time.perf_counter()
        m = actor.train(i + 1, batch)
        total = time.perf_counter() - t0
        steps.append({"total": total, "ref": timers.ref, "optimizer": timers.opt, "matmul": rate,
                      "logged_tflops": m["perf/train_model_tflops"],
                      "cuda_peak_mb": m.get("memory/train_cuda_peak_mb")})
    prof = None
    if a.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
    with prof if prof is not None else contextlib.nullcontext():
        if prof is not None:
            actor.train(a.steps + 1, batch)
    rate_after = matmul_rate(dtype)
    rates = [s_["matmul"] for s_ in steps] + [rate_after]
    machine = max(rates)
    mb_tokens = n_tokens // (SAMPLES // args.micro_batch_size)
    gemm = model_gemm_rate(backend.model, mb_tokens, dtype)
    actor.shutdown()

    med = sorted(steps, key=lambda s: s["total"])[len(steps) // 2]
    paired = [flops / s_["total"] / s_["matmul"] for s_ in steps]  # each step against the matmul just before it
    achieved = flops / med["total"]
    rec = {"model": Path(a.model).name, "flags": extra, "threads": a.threads, "params": n_params, "tokens": n_tokens,
           "model_tflop": flops / 1e12, "step_s": med["total"], "steps_s": [s["total"] for s in steps],
           "ref_forward_s": med["ref"], "optimizer_s": med["optimizer"],
           "train_fwd_bwd_and_rest_s": med["total"] - med["ref"] - med["optimizer"],
           "achieved_gflops": achieved / 1e9, "matmul_gflops": machine / 1e9,
           "matmul_gflops_measured": [r / 1e9 for r in rates],
           "model_gemm_gflops": gemm / 1e9, "ratio": achieved / machine,
           "paired_ratios": paired, "paired_ratio": statistics.median(paired),
           "median_of": len(steps), "spread_s": statistics.pstdev(s["total"] for s in steps),
           "logged_train_model_tflops": med["logged_tflops"], "cuda_peak_mb": med["cuda_peak_mb"],
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print(f"quickstart train step: {Path(a.model).name} ({n_params / 1e6:.1f}M params), {SAMPLES} samples, "
          f"{n_tokens} tokens, micro-batches of {args.micro_batch_size}, {rec['device']}, {a.threads} threads, "
          f"{dtype}, flags {' '.join(extra) or '(defaults)'}")
    print("| measure | value |")
    print("|---|---|")
    print(f"| step time (median of {len(steps)}) | {med['total']:.2f} s (steps: "
          f"{', '.join(f'{s_:.2f}' for s_ in rec['steps_s'])}) |")
    print(f"| reference forward | {med['ref']:.2f} s |")
    print(f"| optimizer step | {med['optimizer']:.2f} s |")
    print(f"| training forward + backward and the rest | {rec['train_fwd_bwd_and_rest_s']:.2f} s |")
    print(f"| model FLOPs per step (8 x params x tokens) | {flops / 1e12:.3f} TFLOP |")
    print(f"| achieved | {achieved / 1e9:.1f} GFLOP/s |")
    n = 2048 if rec["device"] == "cpu" else 8192
    print(f"| dense matmul ({n}^3), best (before each step / after) | {machine / 1e9:.1f} GFLOP/s "
          f"({' / '.join(f'{r / 1e9:.1f}' for r in rates)}) |")
    print(f"| the model's GEMMs at one micro-batch ({mb_tokens} tokens) | {gemm / 1e9:.1f} GFLOP/s |")
    print(f"| **ratio (achieved / matmul)** | **{achieved / machine:.2f}** |")
    print(f"| each step against the matmul just before it (median; steps) | {rec['paired_ratio']:.2f} "
          f"({', '.join(f'{r:.2f}' for r in rec['paired_ratios'])}) |")
    print(f"| perf/train_model_tflops the trainer logged | {med['logged_tflops'] * 1e3:.1f} GFLOP/s |")
    if med["cuda_peak_mb"] is not None:
        print(f"| memory/train_cuda_peak_mb | {med['cuda_peak_mb']:.0f} MiB |")
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return rec


if __name__ == "__main__":
    main()
