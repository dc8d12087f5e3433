"""Where a batched decode step's time goes: the native engine, Hugging Face, and the GEMMs alone.

    python benchmarks/decode_step.py --json decode_step.json          # SmolLM2-135M, batch 32
    python benchmarks/decode_step.py --model tiny --batch 8 --rounds 2 # smoke run

`benchmarks/rollout.py` compares whole generations; this one explains them. The same
prompts (32 tokens, `--batch` of them) are prefilled into

- the native engine (one scheduler step: decode + sampling, as in serving), and
- the Hugging Face model with its own `DynamicCache` (one forward + sampling, the step
  `generate` runs),

and then, round by round so the machine's drifting speed hits every variant alike:

- `native`: `--steps` engine steps;
- `hf`: `--steps` Hugging Face decode steps;
- `gemm`: every linear layer of one decode step (each attention/MLP projection of every
  layer, and the LM head) on a random `[batch, in]` input, nothing else: `F.linear`, and
  the same GEMMs with oneDNN-prepacked weights (`gemm_prepacked`);
- `native_<dtype>` for each `--dtypes` entry: a second engine serving the model in that dtype.

Per variant the JSON holds every round's milliseconds per step and their median. The
figures that answer "how far can the engine go": `gemm_floor_ms` (the faster GEMM variant's
median: a step that runs these GEMMs cannot be shorter), `native_vs_hf` (median of the
per-round ratios hf / native) and `max_vs_hf` (hf / gemm_floor: the lead over Hugging Face
a step made of nothing but its GEMMs would have). `gemm_gflops` is the step's GEMM FLOPs
over `gemm_floor_ms`; `peak_gemm_gflops` the best rate of the LM-head GEMM at batch 128
(compute-bound) on this machine, for scale. `--profile` adds an operator breakdown of the
native step (torch profiler, self CPU ms per step, top operators).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _model_dir(name: str) -> str:
    if name == "tiny":
        from slime.utils.tiny_model import build_tiny_model

        return str(build_tiny_model(os.path.join(tempfile.mkdtemp(prefix="slime-bench-"), "tiny")))
    if name == "smollm2":
        from slime.utils.pretrained import smollm2_135m_instruct

        return str(smollm2_135m_instruct())
    raise SystemExit(f"--model must be smollm2 or tiny, got {name!r}")


class NativeSteps:
    """A native engine holding `batch` running requests; `run(n)` takes n scheduler steps."""

    def __init__(self, model_dir, prompts, dtype, threads, room):
        from slime.engines.native.engine import NativeEngine
        from slime.engines.protocol import GenerateInput, parse_sampling_params

        self.engine = NativeEngine(model_dir, dtype=dtype, num_threads=threads,
                                   max_running_requests=max(128, len(prompts)))
        for i, p in enumerate(prompts):
            sp = parse_sampling_params({"temperature": 1.0, "max_new_tokens": room, "ignore_eos": True, "seed": i})
            self.engine.submit(GenerateInput(rid=f"r{i}", sampling_params=sp, input_ids=p), lambda res, err: None)
        self.run(1)  # prefill + first decode step

    def run(self, n: int) -> None:
        import torch

        with torch.inference_mode():
            for _ in range(n):
                self.engine._step()
        assert len(self.engine._running) > 0, "requests finished; raise the room"

    @property
    def context(self) -> int:
        return self.engine._kv.length


class HFSteps:
    """The Hugging Face model decoding the same batch with a DynamicCache: `generate`'s step
    (forward of the last tokens with the attention mask and cache, softmax, multinomial)."""

    def __init__(self, model, prompts, pad):
        import torch
        from transformers import DynamicCache

        from rollout import left_pad

        self.model = model
        ids, mask = left_pad(prompts, pad)
        self.cache = DynamicCache()
        self.mask = mask
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next = self._sample(out.logits[:, -1])
        self.run(1)  # first decode step, as the engine's first step

    @staticmethod
    def _sample(logits):
        import torch

        return torch.multinomial(torch.softmax(logits.float(), -1), 1)

    def run(self, n: int) -> None:
        import torch

        with torch.inference_mode():
            for _ in range(n):
                self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], 1)
                pos = self.mask.sum(-1, keepdim=True) - 1
                out = self.model(input_ids=self.next, attention_mask=self.mask, position_ids=pos,
                                 past_key_values=self.cache, use_cache=True)
                self.next = self._sample(out.logits[:, -1])

    @property
    def context(self) -> int:
        return self.mask.shape[1]


class GemmSteps:
    """The linear layers of one decode step, alone, plain and with oneDNN-prepacked weights."""

    def __init__(self, model, batch):
        import torch

        self.weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.inputs = [torch.randn(batch, w.shape[1], dtype=w.dtype) for w in self.weights]
        self.flops = sum(2 * batch * w.shape[0] * w.shape[1] for w in self.weights)
        self.packed = [torch.ops.mkldnn._reorder_linear_weight(w, batch) for w in self.weights]

    def run(self, n: int) -> None:
        import torch.nn.functional as F

        for _ in range(n):
            for x, w in zip(self.inputs, self.weights):
                F.linear(x, w)

    def run_prepacked(self, n: int) -> None:
        import torch

        for _ in range(n):
            for x, w in zip(self.inputs, self.packed):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def peak_gemm_gflops(model, reps: int = 10) -> float:
    """Best rate of the LM head's GEMM at batch 128 (compute-bound) on this machine."""
    import torch
    import torch.nn.functional as F

    w = model.get_output_embeddings().weight.detach()
    x = torch.randn(128, w.shape[1], dtype=w.dtype)
    F.linear(x, w)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return 2 * 128 * w.shape[0] * w.shape[1] / best / 1e9


def profile_native(native: NativeSteps, steps: int, top: int = 12) -> list[dict]:
    import torch

    with torch.profiler.profile() as prof:
        native.run(steps)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "self_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 2),
             "calls_per_step": round(e.count / steps, 1)} for e in rows]


def _steal() -> tuple[int, int]:
    """(steal jiffies, all jiffies) from /proc/stat: how much the hypervisor took."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[7], sum(v)
    except (OSError, IndexError, ValueError):
        return 0, 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 or tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per variant per round")
    ap.add_argument("--warmup-steps", type=int, default=32, help="decode steps before timing (context grows)")
    ap.add_argument("--dtypes", default="", help="comma list of extra native dtypes, e.g. bfloat16,float16")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable CPUs)")
    ap.add_argument("--profile", action="store_true", help="add the native step's operator breakdown")
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout import make_prompts

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    model_dir = _model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tok, args.batch)
    room = args.warmup_steps + args.rounds * args.steps + 8

    variants: dict[str, object] = {}
    native = NativeSteps(model_dir, prompts, "float32", threads, room)
    variants["native"] = native.run
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    hf = HFSteps(hf_model, prompts, pad)
    variants["hf"] = hf.run
    gemm = GemmSteps(hf_model, args.batch)
    variants["gemm"] = gemm.run
    variants["gemm_prepacked"] = gemm.run_prepacked
    others = {}
    for dt in [d for d in args.dtypes.split(",") if d]:
        others[dt] = NativeSteps(model_dir, prompts, dt, threads, room)
        variants[f"native_{dt}"] = others[dt].run
    for steps in [native, hf, *others.values()]:
        steps.run(args.warmup_steps)
    context_start = native.context

    ms: dict[str, list[float]] = {k: [] for k in variants}
    steal0 = _steal()
    for r in range(args.rounds):
        for name, run in variants.items():
            t = time.perf_counter()
            run(args.steps)
            ms[name].append(round((time.perf_counter() - t) / args.steps * 1000, 2))
        print(f"round {r}: " + "  ".join(f"{k} {v[-1]:.1f}" for k, v in ms.items()) + " ms/step", flush=True)
    steal1 = _steal()

    med = {k: round(statistics.median(v), 2) for k, v in ms.items()}
    floor = min(med["gemm"], med["gemm_prepacked"])
    rec = {
        "model": args.model, "batch": args.batch, "threads": threads, "steps_per_round": args.steps,
        "rounds": args.rounds, "context": [context_start, native.context], "hf_context": hf.context,
        "ms_per_step": med, "ms_per_step_rounds": ms,
        "native_vs_hf": round(statistics.median(h / n for h, n in zip(ms["hf"], ms["native"])), 2),
        "gemm_floor_ms": floor,
        "max_vs_hf": round(med["hf"] / floor, 2),
        "gemm_gflops": round(gemm.flops / floor / 1e6, 1),
        "peak_gemm_gflops": round(peak_gemm_gflops(hf_model), 1),
        "steal_pct": round(100 * (steal1[0] - steal0[0]) / max(1, steal1[1] - steal0[1]), 1),
    }
    if args.profile:
        rec["native_profile"] = profile_native(native, args.steps)
    print(json.dumps({k: v for k, v in rec.items() if k not in ("ms_per_step_rounds", "native_profile")}))
    for row in rec.get("native_profile", []):
        print(f"  {row['op']:<55} {row['self_ms_per_step']:8.2f} ms/step {row['calls_per_step']:7.1f} calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
