"""Peak memory of token log-probs (+ entropy) forward and backward: the model's full logits
against the chunked output layer (`slime.algorithms.losses.log_probs_from_hidden`, what the FSDP
backend does with `--log-probs-chunk-size`, default 1024), and the megatron backend's
(`slime.training.megatron.head.OutputHead`, one rank; skipped without megatron-core).

    python benchmarks/logprobs_memory.py [--tokens 8192] [--vocab 49152] [--hidden 576] [--chunk 1024]

Defaults: 8 x 1024 tokens, SmolLM2's vocabulary (49152) and hidden size (576), fp32 on the CPU.
Each variant runs in its own process; its peak RSS (ru_maxrss) minus the RSS after the inputs
exist is what the computation added. Both variants compute the same values (checked: the
log-probs and both gradients are compared here too, within 1e-4). Goal: at least 4x lower peak.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _megatron_head(vocab: int, chunk: int):
    """megatron's OutputHead on a one-rank process group (gloo, 127.0.0.1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from slime.training.megatron.head import OutputHead
    from slime.utils.net import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel()
    return OutputHead(vocab, 1.0, chunk)


def run(variant: str, tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
    from slime.algorithms.losses import compute_entropy, compute_log_probs, log_probs_from_hidden

    head = _megatron_head(vocab, chunk) if variant == "megatron" else None
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (0.05 * torch.randn(vocab, hidden)).requires_grad_()
    tgt = torch.randint(0, vocab, (tokens,))
    base = _rss_mb()
    t0 = time.perf_counter()
    if variant == "full":
        logits = F.linear(h, w)  # what a causal LM's forward hands back: [tokens, vocab]
        lp = compute_log_probs(logits, tgt)
        with torch.no_grad():
            ent = compute_entropy(logits.detach())
    elif variant == "chunked":
        lp, ent = log_probs_from_hidden(h, w, tgt, 1.0, chunk, with_entropy=True)
    else:  # megatron: the tokens as one sample's response (position t - 1 scores token t)
        rows = torch.cat([h, h.new_zeros(1, hidden)]).unsqueeze(0)
        ids = torch.cat([tgt.new_zeros(1), tgt]).unsqueeze(0)
        lps, ents = head.scores(rows, w, ids, [1], [tokens], with_entropy=True, entropy_grad=False)
        lp, ent = lps[0], ents[0]
    lp.sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "peak_added_mb": round(peak - base, 1), "seconds": round(seconds, 2),
            "lp_sum": float(lp.double().sum()), "ent_sum": float(ent.double().sum()),
            "grad_h_norm": float(h.grad.double().norm()), "grad_w_norm": float(w.grad.double().norm())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8 * 1024)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--variant", choices=("full", "chunked", "megatron"), default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:
        print(json.dumps(run(a.variant, a.tokens, a.vocab, a.hidden, a.chunk)))
        return
    rows = {}
    variants = ("full", "chunked") + (("megatron",) if importlib.util.find_spec("megatron") else ())
    for variant in variants:
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--tokens", str(a.tokens), "--vocab",
                              str(a.vocab), "--hidden", str(a.hidden), "--chunk", str(a.chunk)],
                             capture_output=True, text=True, check=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    full = rows["full"]
    for r in rows.values():
        for k in ("lp_sum", "ent_sum", "grad_h_norm", "grad_w_norm"):
            assert abs(full[k] - r[k]) <= 1e-4 * max(1.0, abs(full[k])), (r["variant"], k, full[k], r[k])
    print(f"log-probs + entropy, forward + backward: {a.tokens} tokens, vocabulary {a.vocab}, hidden {a.hidden}, "
          f"chunk {a.chunk} (fp32, CPU)")
    print("| path | peak memory added | time |")
    print("|---|---|---|")
    for r in rows.values():
        print(f"| {r['variant']} | {r['peak_added_mb']:.0f} MB | {r['seconds']:.1f} s |")
    lower = ", ".join(f"{r['variant']} {full['peak_added_mb'] / max(r['peak_added_mb'], 1.0):.1f}x"
                      for r in rows.values() if r is not full)
    print(f"peak memory lower than the full logits: {lower}; values and gradients equal within 1e-4")


if __name__ == "__main__":
    main()
