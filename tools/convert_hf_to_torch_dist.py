#!/usr/bin/env python
"""Hugging Face directory -> Megatron "torch_dist" checkpoint (megatron.core.dist_checkpointing).

    python tools/convert_hf_to_torch_dist.py --hf-checkpoint HF_DIR --save OUT [--make-vocab-size-divisible-by 128]

For Llama / Qwen2 / Qwen3 (dense) and Qwen3-MoE / Qwen2-MoE / Mixtral (every layer MoE)
models. A megatron-core GPTModel is built on CPU from the HF config, filled with the HF
weights (q/k/v fused per query group into linear_qkv, gate/up into linear_fc1; the router
and each expert into megatron's MoE layer, `mlp.experts.local_experts.<i>`, with global
expert ids, and Qwen2-MoE's shared expert and its gate) and saved with megatron's own
sharded_state_dict + dist_checkpointing, in Megatron-LM's layout:
`OUT/iter_0000000/` and `OUT/latest_checkpointed_iteration.txt`. The embedding
(and an untied output layer) is padded with zero rows the way Megatron-LM pads
its vocabulary (`--make-vocab-size-divisible-by`, times the tensor-parallel size
you will load with); `tools/convert_torch_dist_to_hf.py` trims them back.
The checkpoint holds the model only (no optimizer, RNG or args): load it in
Megatron-LM with `--finetune` (or `--no-load-optim --no-load-rng`).
Needs megatron-core (`pip install megatron-core`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.utils.errors import SlimeError, run_main  # noqa: E402


def convert(hf_checkpoint: str | Path, save: str | Path, make_vocab_size_divisible_by: int = 128) -> Path:
    from slime.training.megatron import convert as mc

    mc.require_megatron()
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime.training.megatron import moe  # after the check: it imports megatron-core

    hf = Path(hf_checkpoint)
    if not (hf / "config.json").is_file():
        raise SlimeError(f"--hf-checkpoint {hf}: no config.json")
    config = AutoConfig.from_pretrained(hf)
    moe.check_convertible(config)
    hf_model = AutoModelForCausalLM.from_pretrained(hf, dtype="auto")
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    dtype = state["model.embed_tokens.weight"].dtype
    vocab_rows = mc.padded_vocab_size(state["model.embed_tokens.weight"].shape[0], make_vocab_size_divisible_by)
    family = moe if moe.is_moe(config) else mc
    mcore_state = family.hf_to_mcore(state, config, vocab_rows=vocab_rows)
    del hf_model, state
    with mc.single_process_parallel_state():
        model = family.build_gpt_model(config, vocab_rows, dtype)
        mc.load_mcore_state(model, mcore_state)
        return mc.save_torch_dist(model, save)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-checkpoint", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--save", required=True, help="Megatron save directory to create (iter_0000000/ goes in it)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad embedding rows to a multiple of this (Megatron-LM's flag; multiply by your TP size)")
    args = p.parse_args()
    print(convert(args.hf_checkpoint, args.save, args.make_vocab_size_divisible_by))


if __name__ == "__main__":
    run_main(main)
