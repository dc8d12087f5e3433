"""Training benchmark: trainer overhead, packed vs padded micro-batches, weight-sync bandwidth.

    python benchmarks/train.py --json out.jsonl            # tiny model + SmolLM2-135M (if cached)
    python benchmarks/train.py --quick --json out.jsonl    # tiny model only, fewer steps

Per model:
  (a) overhead: tokens/s of one `TrainActor.train` step (GRPO loss, the default fsdp backend on
      one rank, which trains the plain module there: FSDP2 shards from two ranks on; packed
      micro-batches) against a bare Hugging Face forward + backward + grad clip + AdamW over the
      same micro-batches in the same (packed) layout and the same form of loss, the token mean of
      -advantage * log-prob (slime's PPO ratio is 1 on policy; the bare loop takes the rewards as
      advantages). What slime does beyond that counts as overhead: group-normalized advantages,
      log-probs in chunks of positions (bounded memory), per-token entropy (no grad) and the
      logged metrics (pg_loss, clipfrac, ppo_kl, the train/rollout log-prob gap), the
      non-finite-norm check. All variants of (a) and (b) take turns step by step so a shared
      machine's noise hits all; the fastest step counts (other jobs only add time). Goal:
      overhead under 15%.
  (b) layout: slime trainer tokens/s with packed micro-batches (default), padded ones
      (--disable-sequence-packing), and token-budget micro-batches (--use-dynamic-batch-size), on
      a batch whose lengths follow a long tail.
  (c) weight sync: bytes/s of each of slime's pushes (`--update-weights-mode`: tensor =
      bucketing + safetensors serialization + HTTP POST; distributed = HTTP-announced buckets
      broadcast over a gloo group the engine joins, the default without --colocate; disk =
      safetensors buckets in /dev/shm loaded by path) into a native engine process, which loads
      every tensor into its model, against a raw `torch.distributed.broadcast` over gloo of
      the same tensors between two local processes. Goal: within 2x of the raw broadcast.
Tokens/s counts every token of the batch (prompt + response). One JSON record per measurement
goes to --json (JSON lines); a table is printed. On a GPU the tensor work runs there (the
trainer picks CUDA itself) and the records add MFU (6 * params * tokens/s over the peak given
by --peak-tflops).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.types import RolloutBatch  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def long_tail_batch(n: int, vocab: int, max_len: int, seed: int = 0) -> RolloutBatch:
    """n samples: prompt 8-64 tokens, responses mostly short with a few near max_len."""
    g = torch.Generator().manual_seed(seed)
    tokens, lengths, masks = [], [], []
    for _ in range(n):
        p = int(torch.randint(8, 64, (1,), generator=g))
        u = float(torch.rand((), generator=g))
        r = max(4, min(max_len - p, int(8 / (1.0 - u) ** (1 / 1.1))))
        tokens.append(torch.randint(5, vocab, (p + r,), generator=g).tolist())
        lengths.append(r)
        masks.append([1] * r)
    rewards = torch.randn(n, generator=g).tolist()
    return RolloutBatch(tokens=tokens, response_lengths=lengths, loss_masks=masks, rewards=rewards,
                        raw_rewards=list(rewards), rollout_log_probs=[[0.0] * r for r in lengths],
                        group_indices=[i // 2 for i in range(n)])


def slime_args(model_dir: str, tmp: Path, n: int, mbs: int, *extra):
    from slime.arguments import parse_args

    prompts = tmp / "prompts.jsonl"
    prompts.write_text('{"input": "x"}\n')
    return parse_args([
        "--hf-checkpoint", model_dir, "--prompt-data", str(prompts), "--num-rollout", "1",
        "--rollout-batch-size", str(n // 2), "--n-samples-per-prompt", "2", "--micro-batch-size", str(mbs),
        "--rollout-temperature", "1.0", "--lr", "1e-6", "--output-dir", str(tmp / "out"), *map(str, extra),
    ])


THREADS = [1]  # torch threads for the trainer and the bare baseline (--threads)


def slime_actor(args):
    from slime.training.actor import TrainActor

    actor = TrainActor(args, rank=0, world_size=1, master_port=free_port())
    actor.init()
    torch.set_num_threads(THREADS[0])  # the actor picks its own count; both sides get the same
    return actor


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BareTrainer:
    """Plain HF model + AdamW: forward, a token-mean -reward * log-prob loss, backward, clip, step."""

    def __init__(self, model_dir: str, device: torch.device, lr: float = 1e-6):
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="sdpa").to(device).eval()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-8)

    def step(self, batch: RolloutBatch, micro_batches: list[list[int]]) -> None:
        total = sum(sum(m) for m in batch.loss_masks)
        for idx in micro_batches:
            lens = [len(batch.tokens[i]) for i in idx]
            ids = torch.as_tensor([t for i in idx for t in batch.tokens[i]], device=self.device)[None]
            pos = torch.cat([torch.arange(n) for n in lens])[None].to(self.device)
            score, adv, off = [], [], 0
            for i, n in zip(idx, lens):
                r = batch.response_lengths[i]
                score.append(torch.arange(off + n - r - 1, off + n - 1))
                adv.append(torch.full((r,), float(batch.rewards[i])) * torch.tensor(batch.loss_masks[i]))
                off += n
            score = torch.cat(score).to(self.device)
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=score).logits[0]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, score + 1, None]).squeeze(-1)
            (-(torch.cat(adv).to(self.device) * lp).sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_training(model_dir, tmp, batch, mbs, budget, steps, n_params, peak) -> list[dict]:
    """(a) and (b) in one loop: the slime variants and the bare loop take turns step by step, so
    every measurement sees the same machine state; the fastest step of each counts."""
    variants = [("packed", []), ("padded", ["--disable-sequence-packing"]),
                ("dynamic_packed", ["--use-dynamic-batch-size", "--max-tokens-per-gpu", budget])]
    actors = {}
    try:
        for name, extra in variants:
            actors[name] = slime_actor(slime_args(model_dir, tmp, len(batch), mbs, *extra))
        dev = actors["packed"].backend.device
        bare = BareTrainer(model_dir, dev)
        everything = list(range(len(batch)))
        n_mbs = {name: len(a._micro_batches(batch, everything)) for name, a in actors.items()}
        bare_mbs = actors["packed"]._micro_batches(batch, everything)
        runs = {name: (lambda a=a, s=[0]: (s.__setitem__(0, s[0] + 1), a.train(s[0], batch), _sync(dev)))
                for name, a in actors.items()}
        runs["bare_hf"] = lambda: (bare.step(batch, bare_mbs), _sync(dev))
        for fn in runs.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(steps):
            for name, fn in runs.items():
                times[name].append(timed(fn))
    finally:
        for a in actors.values():
            a.shutdown()
    tokens = sum(len(t) for t in batch.tokens)
    best = {name: min(ts) for name, ts in times.items()}
    out = [_record("overhead", "slime", tokens, best["packed"], times["packed"], n_params, peak,
                   micro_batch_size=mbs, overhead_pct=100.0 * (best["packed"] / best["bare_hf"] - 1.0)),
           _record("overhead", "bare_hf", tokens, best["bare_hf"], times["bare_hf"], n_params, peak,
                   micro_batch_size=mbs)]
    padded_tokens = sum(len(idx) * max(len(batch.tokens[i]) for i in idx)
                        for idx in [everything[i : i + mbs] for i in range(0, len(batch), mbs)])
    for name, _ in variants:
        r = _record("layout", name, tokens, best[name], times[name], n_params, peak, micro_batches=n_mbs[name],
                    speedup_vs_padded=best["padded"] / best[name])
        if name == "packed":
            r["gain_pct"] = 100.0 * (best["padded"] / best["packed"] - 1.0)
        if name == "padded":
            r["padding_fraction"] = 1.0 - tokens / padded_tokens
        out.append(r)
    return out


def _record(bench, variant, tokens, sec, ts, n_params, peak, **extra) -> dict:
    """sec: the fastest step (`seconds`); the median is kept too."""
    rec = {"bench": bench, "variant": variant, "tokens": tokens, "seconds": sec,
           "median_seconds": statistics.median(ts),
           "tokens_per_s": tokens / sec, "step_seconds": [round(t, 4) for t in ts], **extra}
    if peak:
        rec["mfu"] = 6.0 * n_params * tokens / sec / (peak * 1e12)
    return rec


# ---------------------------------------------------------------- weight sync


def _named_weights(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, p.detach().contiguous()) for n, p in model.named_parameters()]  # tied weights once


def _gloo_worker(rank: int, port: int, model_dir: str, repeats: int, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    tensors = [t for _, t in _named_weights(model_dir)]
    if rank == 1:
        tensors = [torch.empty_like(t) for t in tensors]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for t in tensors:
                dist.broadcast(t, src=0)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            q.put(times)
    finally:
        dist.destroy_process_group()


def bench_gloo(model_dir: str, repeats: int) -> list[float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, model_dir, repeats, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=1200)
    finally:
        for p in procs:
            p.join(timeout=60)


def start_native_engine(model_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "slime.engines.native", "--model-path", model_dir,
                             "--port", str(port), "--num-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(Path(__file__).resolve().parents[1]))
    deadline = time.time() + 600
    for line in proc.stdout:
        if "ready on" in line:
            return proc, f"http://127.0.0.1:{port}"
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"native engine did not start (exit {proc.poll()})")


def _push_modes(named, url, buffer):
    """slime's three transports (--update-weights-mode) as (name, push(version) -> stats, close)."""
    from slime.training.weight_sync import DiskTransport, DistributedTransport, TensorTransport

    modes = [("slime_tensor_http", TensorTransport(buffer, rank=0)),
             ("slime_distributed_gloo", DistributedTransport(buffer, rank=0, num_engines=1)),
             ("slime_disk_shm", DiskTransport(buffer, rank=0, num_engines=1))]
    for _, transport in modes:
        transport.connect([url])
    return [(name, lambda v, t=transport: t.push(named, v), transport.close) for name, transport in modes]


def bench_weight_sync(model_dir: str, repeats: int, buffer: int) -> list[dict]:
    """Each of slime's push modes into one native engine process vs a raw gloo broadcast."""
    from slime.training.weight_sync import iter_buckets, serialize_bucket

    named = _named_weights(model_dir)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    gloo = bench_gloo(model_dir, repeats + 1)[1:]
    g_sec = statistics.median(gloo)
    out = [{"bench": "weight_sync", "variant": "raw_gloo_broadcast", "bytes": nbytes, "seconds": g_sec,
            "bytes_per_s": nbytes / g_sec, "runs": [round(t, 4) for t in gloo]}]
    proc, url = start_native_engine(model_dir)
    version = 0
    try:
        for name, push, close in _push_modes(named, url, buffer):
            try:
                runs = []
                for _ in range(repeats + 1):  # the first is a warm-up (and builds the distributed group)
                    version += 1
                    runs.append(push(version))
                runs = runs[1:]
            except Exception as e:  # noqa: BLE001 - report the mode as failed, measure the others
                out.append({"bench": "weight_sync", "variant": name, "bytes": nbytes, "error": repr(e)[:300]})
                continue
            finally:
                close()
            sec = statistics.median(r["seconds"] for r in runs)
            out.append({"bench": "weight_sync", "variant": name, "bytes": nbytes, "seconds": sec,
                        "bytes_per_s": nbytes / sec, "buckets": runs[0]["buckets"], "buffer_bytes": buffer,
                        "runs": [round(r["seconds"], 4) for r in runs], "slowdown_vs_gloo": sec / g_sec})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    ser = [timed(lambda: [serialize_bucket(b) for b in iter_buckets(named, buffer)]) for _ in range(repeats)]
    for r in out:
        if r["variant"] == "slime_tensor_http":
            r["serialize_seconds"] = statistics.median(ser)
    return out


# ---------------------------------------------------------------- driver


def run_model(label, model_dir, quick, peak, tmp) -> list[dict]:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    n_params = sum(t.numel() for _, t in _named_weights(model_dir))
    max_len = min(int(getattr(cfg, "max_position_embeddings", 512)), 512 if label == "tiny" else 256)
    n, mbs = (16, 4) if label == "tiny" else (8, 4)
    steps = (5 if quick else 10) if label == "tiny" else 3
    batch = long_tail_batch(n, cfg.vocab_size, max_len, seed=1)
    budget = max(max(len(t) for t in batch.tokens), sum(len(t) for t in batch.tokens) // max(1, n // mbs))
    records = []
    for fn in (lambda: bench_training(model_dir, tmp, batch, mbs, budget, steps, n_params, peak),
               lambda: bench_weight_sync(model_dir, 2 if quick else 3, 512 * 10**6)):
        for r in fn():
            r.update(model=label, params=n_params, device="cuda" if torch.cuda.is_available() else "cpu",
                     threads=torch.get_num_threads(), batch_samples=n)
            print(json.dumps(r), file=sys.stderr, flush=True)  # progress
            records.append(r)
    return records


def table(records: list[dict]) -> str:
    rows = ["| model | bench | variant | tokens/s or MB/s | seconds | note |", "|---|---|---|---|---|---|"]
    for r in records:
        if r["bench"] == "weight_sync" and "error" in r:
            rows.append(f"| {r['model']} | weight_sync | {r['variant']} | failed | | {r['error'][:80]} |")
            continue
        if r["bench"] == "weight_sync":
            rate = f"{r['bytes_per_s'] / 1e6:.1f} MB/s"
            note = f"{r['slowdown_vs_gloo']:.2f}x gloo time" if "slowdown_vs_gloo" in r else ""
        else:
            rate = f"{r['tokens_per_s']:.0f} tok/s"
            note = ", ".join(f"{k} {r[k]:.1f}" for k in ("overhead_pct", "gain_pct") if k in r)
            if "micro_batches" in r:
                note = ", ".join(x for x in (note, f"{r['micro_batches']} micro-batches") if x)
            if "padding_fraction" in r:
                note += f", {100 * r['padding_fraction']:.0f}% padding"
            if "mfu" in r:
                note += f", MFU {100 * r['mfu']:.2f}%"
        rows.append(f"| {r['model']} | {r['bench']} | {r['variant']} | {rate} | {r['seconds']:.3f} | {note} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="write one JSON record per measurement (JSON lines)")
    ap.add_argument("--quick", action="store_true", help="tiny model only, fewer steps")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="device peak TFLOP/s for MFU (default: 989 on an H100/H200 (bf16 dense), none on CPU)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared machine more threads than free cores "
                         "make every step wait on the slowest thread, 10-20x slower)")
    a = ap.parse_args(argv)
    THREADS[0] = a.threads
    torch.set_num_threads(a.threads)
    peak = a.peak_tflops
    if peak is None and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        peak = 989.0 if ("H100" in name or "H200" in name) else None
    from slime.utils.tiny_model import build_tiny_model

    records: list[dict] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = [("tiny", str(build_tiny_model(tmp / "tiny", seed=0)))]
        if not a.quick:
            from slime.utils import pretrained

            cached = pretrained.default_cache_dir() / pretrained.MODEL_NAME
            if (cached / pretrained._DONE_MARKER).is_file():
                models.append(("SmolLM2-135M", str(cached)))
            else:
                notes.append(f"SmolLM2-135M-Instruct skipped: not cached at {cached} "
                             "(python -m slime.utils.pretrained builds it)")
        for label, model_dir in models:
            records += run_model(label, model_dir, a.quick, peak, tmp)
    with open(a.json, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(table(records))
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
