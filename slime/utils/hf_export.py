"""Write a Hugging Face model directory from a state dict with HF names."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from slime.utils.errors import SlimeError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def save_hf_model(state: dict[str, torch.Tensor], config, origin_dir: str | Path, output_dir: str | Path,
                  source: str, dtype: torch.dtype = torch.float32) -> Path:
    """Build the model class of `config` around `state`, save it as safetensors into `output_dir`
    and copy the tokenizer and other non-weight files of `origin_dir`. `source` names where the
    weights came from in errors. Returns `output_dir`."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
        model.tie_weights()
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise SlimeError(f"{source}: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(origin_dir).iterdir():  # tokenizer and other non-weight files
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_SUFFIXES) \
                and not f.name.endswith(".index.json") and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out
