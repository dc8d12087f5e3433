#!/usr/bin/env python
"""Training checkpoint -> a Hugging Face directory that `transformers` loads.

    python tools/convert_to_hf.py --input-dir CKPT --output-dir OUT [--origin-hf-dir DIR] [--vocab-size N]

CKPT is a `--save` directory (its `latest` checkpoint is used) or one
`rollout_<id>` directory in it. The weights come from the checkpoint's training
state (`train_state/`, the torch DCP directory every rank wrote), so the
conversion does not depend on the HF copy written next to it. The config and
tokenizer come from `--origin-hf-dir`, default the checkpoint's own `hf/`.
`--vocab-size` trims embedding rows padded beyond the tokenizer's vocabulary.

A LoRA checkpoint (`--lora-rank`: `adapter/` in peft's format instead of `hf/`) is written as its base
model (`--origin-hf-dir`, default the base the adapter names) with the adapter merged in.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.utils.errors import SlimeError, run_main  # noqa: E402
from slime.utils.hf_export import save_hf_model  # noqa: E402

_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def resolve_checkpoint(path: Path) -> Path:
    from slime import checkpoint

    if (path / "meta.json").is_file():
        return path
    found = checkpoint.latest(path) if path.is_dir() else None
    if found is None:
        raise SlimeError(f"--input-dir {path}: not a checkpoint (no meta.json) and no {checkpoint.LATEST} file in it")
    return found


def load_model_state(train_state: Path) -> dict:
    """The model part of a DCP directory as full tensors, read in this process (no process group)."""
    from slime.utils.checkpoint_data import dcp_to_dict

    if not train_state.is_dir():
        raise SlimeError(f"{train_state} does not exist (was the checkpoint written by slime --save?)")
    return dcp_to_dict(train_state)["model"]


def convert(input_dir: str | Path, output_dir: str | Path, origin_hf_dir: str | Path | None = None,
            vocab_size: int | None = None) -> Path:
    import torch
    from transformers import AutoConfig

    ckpt = resolve_checkpoint(Path(input_dir))
    if (ckpt / "adapter").is_dir():
        return convert_lora(ckpt, output_dir, origin_hf_dir)
    origin = Path(origin_hf_dir) if origin_hf_dir else ckpt / "hf"
    if not (origin / "config.json").is_file():
        raise SlimeError(f"--origin-hf-dir {origin}: no config.json")
    state = load_model_state(ckpt / "train_state")
    config = AutoConfig.from_pretrained(origin)
    if vocab_size is not None:
        rows = state["model.embed_tokens.weight"].shape[0]
        if vocab_size > rows:
            raise SlimeError(f"--vocab-size {vocab_size} is larger than the checkpoint's {rows} embedding rows")
        for name in _VOCAB_ROWS:
            if name in state:
                state[name] = state[name][:vocab_size].clone()
        config.vocab_size = vocab_size
    return save_hf_model(state, config, origin, output_dir, source=str(ckpt), dtype=torch.float32)


def convert_lora(ckpt: Path, output_dir: str | Path, origin_hf_dir: str | Path | None = None) -> Path:
    """A LoRA checkpoint (`adapter/`, peft's format) merged into its base model: `--origin-hf-dir`, default
    the base the adapter names (`base_model_name_or_path`, the run's --hf-checkpoint)."""
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    adapter = ckpt / "adapter"
    base = origin_hf_dir or json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise SlimeError(f"{adapter} is a LoRA adapter whose base model {base!r} is not a local Hugging Face "
                         f"directory; give it with --origin-hf-dir")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    state = {k: v for k, v in merged.state_dict().items()}
    return save_hf_model(state, AutoConfig.from_pretrained(base), Path(base), output_dir, source=str(ckpt),
                         dtype=torch.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-dir", required=True, help="a --save directory or one rollout_<id> checkpoint in it")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--origin-hf-dir", default=None, help="config + tokenizer source (default: the checkpoint's hf/)")
    p.add_argument("--vocab-size", type=int, default=None, help="trim padded embedding rows to this vocabulary size")
    args = p.parse_args()
    print(convert(args.input_dir, args.output_dir, args.origin_hf_dir, args.vocab_size))


if __name__ == "__main__":
    run_main(main)
