"""The megatron backend against the FSDP backend, and the pipeline bubble.

    python benchmarks/megatron_train.py [--steps 3] [--layers 8] [--samples 32] [--json out.jsonl]

One GRPO optimizer step (`TrainActor.train`: advantages, log-probs, loss, backward, AdamW) of the
same batch on the same machine, for each layout:

- fsdp, 1 rank; megatron, 1 rank: the same model and micro-batches (the table's "vs 1st" column is
  each layout's tokens/s over the first layout's, fsdp's by default); each again with `--bf16`
  (FSDP2's mixed precision; megatron's bf16 parameters with fp32 main copies);
- megatron PP 2 (1F1B) and PP 2 with 2 virtual stages (interleaved), 2 ranks: each rank keeps
  half the samples, so one pipeline micro-batch holds both ranks' `--micro-batch-size` samples.

Every layout uses the whole machine: 1 rank with all cores as torch threads, 2 ranks with half each.
Tokens/s counts every token of the batch (prompt + response) over the median step time after a
warm-up step.

The pipeline bubble: the share of a stage's schedule time it spends not computing. Each rank
times megatron's `forward_step` and `backward_step` (the model chunk's forward with the loss, and
its backward) inside each schedule run, against the run's wall time; the rest is waiting for the
other stage (and the P2P copies). slime's pipeline step runs the schedule twice (pipeline.py): a
forward-only pass for the log-probs, then the forward-backward pass; both are reported, with the
micro-batch count and the ideal bubble of equal stages, (p - 1) / (m + p - 1) for 1F1B and
(p - 1) / (v m + p - 1) for the interleaved schedule (v virtual stages per rank).

The model is a random Llama with the tiny tokenizer (`--layers` decoder layers of `--hidden` size),
built once under a temporary directory; the batch has `--samples` samples of 48-160 tokens.
`--layouts` picks some of the layouts by name.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slime.types import RolloutBatch  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(out: Path, layers: int, hidden: int) -> str:
    """A random Llama (`hidden` wide, heads of 64 with two per KV head, FFN 3 x hidden, tied embedding)
    with the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slime.utils.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    heads = max(2, hidden // 64)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                      head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def make_batch(n: int, vocab: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    tokens, lengths = [], []
    for _ in range(n):
        p, r = int(torch.randint(16, 64, (1,), generator=g)), int(torch.randint(32, 97, (1,), generator=g))
        tokens.append(torch.randint(5, vocab, (p + r,), generator=g).tolist())
        lengths.append(r)
    rewards = torch.randn(n, generator=g).tolist()
    return RolloutBatch(tokens=tokens, response_lengths=lengths, loss_masks=[[1] * r for r in lengths],
                        rewards=rewards, raw_rewards=list(rewards),
                        rollout_log_probs=[[0.0] * r for r in lengths], group_indices=[i // 2 for i in range(n)])


class ScheduleTimer:
    """Busy time (megatron's forward_step and backward_step) and wall time of each schedule run."""

    def __init__(self):
        from megatron.core.pipeline_parallel import schedules

        from slime.training.megatron import pipeline

        self.runs: list[dict] = []  # {"forward_only", "microbatches", "wall", "busy"}
        self._busy = 0.0
        for name in ("forward_step", "backward_step"):
            setattr(schedules, name, self._timed(getattr(schedules, name)))
        run = pipeline.Pipeline._run

        def timed_run(pipe, chunks, batches, on_logits, forward_only):
            self._busy = 0.0
            t0 = time.perf_counter()
            run(pipe, chunks, batches, on_logits, forward_only)
            self.runs.append(dict(forward_only=forward_only, microbatches=len(batches),
                                  wall=time.perf_counter() - t0, busy=self._busy))

        pipeline.Pipeline._run = timed_run

    def _timed(self, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._busy += time.perf_counter() - t0
        return wrapped


def _rank(rank: int, world: int, port: int, flags: list[str], threads: int, batch, steps: int, q) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging

    from slime.arguments import parse_args
    from slime.training.actor import TrainActor

    hf_logging.disable_progress_bar()
    args = parse_args(flags)
    timer = ScheduleTimer() if args.train_backend == "megatron" and args.pipeline_model_parallel_size > 1 else None
    actor = TrainActor(args, rank=rank, world_size=world, master_port=port)
    actor.init()
    torch.set_num_threads(threads)
    part = batch.split_for_ranks(args.dp_size, args.global_batch_size)[rank]
    times, bubbles = [], []
    try:
        for step in range(steps + 1):  # the first is a warm-up
            if timer:
                timer.runs.clear()
            t0 = time.perf_counter()
            actor.train(step, part)
            if step:
                times.append(time.perf_counter() - t0)
                if timer:
                    bubbles.append([dict(r) for r in timer.runs])
    finally:
        actor.shutdown()
    q.put((rank, times, bubbles))


def run_layout(flags: list[str], world: int, batch, steps: int) -> tuple[list[float], dict[int, list]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    threads = max(1, (os.cpu_count() or 2) // world)
    procs = [ctx.Process(target=_rank, args=(r, world, port, flags, threads, batch, steps, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=3600) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=120)
    times = [max(t) for t in zip(*[r[1] for r in results])]  # a step ends when its slowest rank does
    return times, {r[0]: r[2] for r in results}


def ideal_bubble(p: int, m: int, v: int) -> float:
    return (p - 1) / (v * m + p - 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--layouts", default=None, help="comma-separated layout names (default: all)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="slime_megatron_bench_"))
    model_dir = build_model(tmp / "model", a.layers, a.hidden)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    batch = make_batch(a.samples, vocab)
    tokens = sum(len(t) for t in batch.tokens)
    (tmp / "prompts.jsonl").write_text('{"input": "x"}\n')
    common = ["--hf-checkpoint", model_dir, "--prompt-data", str(tmp / "prompts.jsonl"), "--num-rollout", "1",
              "--rollout-batch-size", str(a.samples // 2), "--n-samples-per-prompt", "2",
              "--global-batch-size", str(a.samples), "--rollout-temperature", "1.0", "--lr", "1e-6",
              "--output-dir", str(tmp / "out")]
    half = a.layers // 4  # layers per virtual stage with PP 2 x 2 virtual stages
    layouts = {  # name: (ranks, flags)
        "fsdp": (1, ["--train-backend", "fsdp", "--micro-batch-size", str(2 * a.micro_batch_size)]),
        "megatron": (1, ["--train-backend", "megatron", "--micro-batch-size", str(2 * a.micro_batch_size)]),
        "fsdp --bf16": (1, ["--train-backend", "fsdp", "--bf16", "--micro-batch-size", str(2 * a.micro_batch_size)]),
        "megatron --bf16": (1, ["--train-backend", "megatron", "--bf16", "--micro-batch-size",
                                str(2 * a.micro_batch_size)]),
        "megatron PP 2": (2, ["--train-backend", "megatron", "--pipeline-model-parallel-size", "2",
                              "--micro-batch-size", str(a.micro_batch_size)]),
        "megatron PP 2 x VP 2": (2, ["--train-backend", "megatron", "--pipeline-model-parallel-size", "2",
                                     "--num-layers-per-virtual-pipeline-stage", str(half),
                                     "--micro-batch-size", str(a.micro_batch_size)]),
    }
    if a.layouts:
        unknown = set(a.layouts.split(",")) - set(layouts)
        if unknown:
            ap.error(f"--layouts: unknown {sorted(unknown)}; the layouts are {list(layouts)}")
        layouts = {k: v for k, v in layouts.items() if k in a.layouts.split(",")}
    print(f"model: Llama, {a.layers} layers of hidden {a.hidden}; batch: {a.samples} samples, {tokens} tokens; "
          f"{a.steps} steps after a warm-up; {os.cpu_count()} cores")
    print(f"{'layout':<22} {'ranks':>5} {'step s':>8} {'tokens/s':>9} {'vs 1st':>8}  bubble (pass: micro-batches, "
          "per-stage measured / ideal)")
    records, base = [], None
    for name, (world, flags) in layouts.items():
        flags = [*common, "--actor-num-gpus-per-node", str(world), *flags]
        times, bubbles = run_layout(flags, world, batch, a.steps)
        step = statistics.median(times)
        base = base or tokens / step
        rec = dict(bench="megatron_train", layout=name, ranks=world, tokens=tokens, steps_s=times,
                   step_s=step, tokens_per_s=tokens / step, vs_first=tokens / step / base)
        text = ""
        if any(bubbles.values()):
            vp = 2 if "VP" in name else 1
            passes = []
            # the train step's two schedule runs are a step's last (the actor may run others before)
            for i, kind in ((-2, "log-probs"), (-1, "train")):
                per_stage = []
                for rank in sorted(bubbles):
                    runs = [step_runs[i] for step_runs in bubbles[rank]]
                    assert all(r["forward_only"] == (kind == "log-probs") for r in runs), runs
                    per_stage.append(statistics.median(1 - r["busy"] / r["wall"] for r in runs))
                m = bubbles[0][0][i]["microbatches"]
                ideal = ideal_bubble(2, m, vp)
                passes.append(dict(kind=kind, microbatches=m, bubble_per_stage=per_stage, ideal=ideal))
                text += f"{kind}: m={m}, " + "/".join(f"{b:.2f}" for b in per_stage) + f" / {ideal:.2f}; "
            rec["bubble"] = passes
        records.append(rec)
        print(f"{name:<22} {world:>5} {step:>8.2f} {tokens / step:>9.0f} {tokens / step / base:>8.2f}  {text}")
    if a.json:
        with open(a.json, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return records


if __name__ == "__main__":
    main()
    sys.exit(0)
