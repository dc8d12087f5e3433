#!/usr/bin/env python
"""Megatron "torch_dist" checkpoint -> a Hugging Face directory that `transformers` loads.

    python tools/convert_torch_dist_to_hf.py --input-dir CKPT --output-dir OUT --origin-hf-dir HF_DIR [--vocab-size N]

CKPT is a Megatron save directory (its `latest_checkpointed_iteration.txt` names
the iteration) or one `iter_XXXXXXX` / `release` directory in it, written by
megatron.core.dist_checkpointing for a GPTModel with TP/PP of any size (the
loader reshards; an MoE model's experts at any expert-parallel size too). For Llama /
Qwen2 / Qwen3 (dense) and Qwen3-MoE / Qwen2-MoE / Mixtral models. The architecture,
config and tokenizer come from `--origin-hf-dir`. Embedding rows padded beyond the
vocabulary are trimmed to `--vocab-size`, default the origin config's vocab_size.
Needs megatron-core (`pip install megatron-core`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.utils.errors import SlimeError, run_main  # noqa: E402
from slime.utils.hf_export import save_hf_model  # noqa: E402

_EMBEDDING_KEY = "embedding.word_embeddings.weight"


def convert(input_dir: str | Path, output_dir: str | Path, origin_hf_dir: str | Path,
            vocab_size: int | None = None) -> Path:
    from slime.training.megatron import convert as mc

    mc.require_megatron()
    from transformers import AutoConfig

    origin = Path(origin_hf_dir)
    if not (origin / "config.json").is_file():
        raise SlimeError(f"--origin-hf-dir {origin}: no config.json")
    config = AutoConfig.from_pretrained(origin)
    from slime.training.megatron import moe  # after the check: it imports megatron-core

    moe.check_convertible(config)
    family = moe if moe.is_moe(config) else mc
    ckpt = mc.resolve_checkpoint_dir(input_dir)
    shapes = mc.checkpoint_tensor_shapes(ckpt)
    if _EMBEDDING_KEY not in shapes:
        raise SlimeError(f"{ckpt}: no {_EMBEDDING_KEY} in the checkpoint (not a GPTModel checkpoint?)")
    (vocab_rows, hidden), dtype = shapes[_EMBEDDING_KEY]
    if hidden != config.hidden_size:
        raise SlimeError(f"{ckpt}: hidden size {hidden} does not match --origin-hf-dir's {config.hidden_size}")
    if vocab_size is None:
        vocab_size = min(config.vocab_size, vocab_rows)
    with mc.single_process_parallel_state():
        model = family.build_gpt_model(config, vocab_rows, dtype)
        mc.load_torch_dist(model, ckpt)
        mcore_state = {k: v.detach() for k, v in model.state_dict().items() if hasattr(v, "detach")}
    state = family.mcore_to_hf(mcore_state, config, vocab_size=vocab_size)
    del model, mcore_state
    config.vocab_size = vocab_size
    return save_hf_model(state, config, origin, output_dir, source=str(ckpt), dtype=dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-dir", required=True, help="a Megatron save directory or one iter_XXXXXXX dir in it")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--origin-hf-dir", required=True, help="HF directory with the model's config and tokenizer")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="trim padded embedding rows to this size (default: the origin config's vocab_size)")
    args = p.parse_args()
    print(convert(args.input_dir, args.output_dir, args.origin_hf_dir, args.vocab_size))


if __name__ == "__main__":
    run_main(main)
