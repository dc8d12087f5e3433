"""What `torch.compile` would give the trainer: decoder layers of SmolLM2-135M-Instruct, forward and
backward on one quickstart micro-batch, eager against compiled (inductor), in one process.

    python benchmarks/compile_layers.py [--layers 4] [--batch 8] [--tokens 74] [--repeats 15] [--threads 2]

The layers are built from the model's config with random weights (time does not depend on the
values); the batch is `--batch` samples of `--tokens` tokens (8 x 74 is the quickstart's
micro-batch of 8 samples, about 592 tokens). It prints the first compile's time, then eager and
compiled steps alternated `--repeats` times: each one's median, and the median, min and max of the
compiled/eager ratio pair by pair (so a drift of the machine's speed cancels). slime does not
compile its models; docs/training.md quotes this benchmark for the MFU goal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=74)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from slime.utils.pretrained import smollm2_135m_instruct

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(str(smollm2_135m_instruct()))
    config._attn_implementation = "sdpa"
    layers = [LlamaDecoderLayer(config, i) for i in range(a.layers)]
    compiled = [torch.compile(layer) for layer in layers]
    rotary = LlamaRotaryEmbedding(config)
    x0 = torch.randn(a.batch, a.tokens, config.hidden_size)
    pos = torch.arange(a.tokens)[None].expand(a.batch, a.tokens)

    def step(stack) -> float:
        t = time.perf_counter()
        x = x0.clone().requires_grad_(True)
        h, rope = x, rotary(x, pos)
        for layer in stack:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope, is_causal=True)
            h = h[0] if isinstance(h, tuple) else h
        h.pow(2).mean().backward()
        return time.perf_counter() - t

    print(f"first compiled step (compiles): {step(compiled):.1f} s")
    step(layers)  # warm-up
    eager, comp = [], []
    for _ in range(a.repeats):
        eager.append(step(layers))
        comp.append(step(compiled))
    ratios = [c / e for c, e in zip(comp, eager)]
    print(f"{a.layers} layers, {a.batch} x {a.tokens} tokens, {a.threads} threads, {a.repeats} pairs:")
    print(f"  eager median {statistics.median(eager):.3f} s, compiled median {statistics.median(comp):.3f} s")
    print(f"  compiled/eager: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
