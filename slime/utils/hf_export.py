"""Write a Hugging Face model directory from a state dict with HF names: through the model class
(`save_hf_model`) or as the tensors are (`write_hf_dir`, sharded like `save_pretrained`); the
checkpoint's names of a model's in-memory weights (`checkpoint_names`, `hf_checkpoint_names`,
`checkpoint_named_weights`: transformers 5 fuses a MoE layer's experts, checkpoints name them per expert)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import revert_weight_conversion

from slime.utils.errors import SlimeError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
HF_MAX_SHARD_BYTES = 5 * 10**9


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
        raise SlimeError(f"{source}: weights do not match the config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(origin_dir).iterdir():  # tokenizer and other non-weight files
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_SUFFIXES) \
                and not f.name.endswith(".index.json") and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out


def write_hf_dir(out: Path, origin_dir: str | Path, config, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` (HF names, contiguous) as safetensors shards of at most HF_MAX_SHARD_BYTES in `out`
    (with the index file when there are several), `config`, and the non-weight files of `origin_dir`
    (tokenizer, generation config)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(origin_dir).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    config.save_pretrained(out)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > HF_MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def checkpoint_names(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` under the names a Hugging Face checkpoint of `model` uses. transformers 5 builds some
    modules from fused parameters (a MoE layer's experts as one `gate_up_proj`, for example) that its
    checkpoints store per expert; `save_pretrained` writes the checkpoint names, and so does this
    (other engines and tools read them). The identity for models without such conversions."""
    return dict(revert_weight_conversion(model, dict(tensors)))


def _meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def hf_checkpoint_names(config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`checkpoint_names` for a model given by its config (no weights are built)."""
    return checkpoint_names(_meta_model(config), tensors)


def checkpoint_named_weights(config, named_weights: Iterable[tuple[str, torch.Tensor]]
                             ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a model of `config` under its checkpoint's names, one pair at a time
    (each in-memory tensor converts alone: a fused `mlp.experts.gate_up_proj` [E, 2I, H] becomes the
    E `mlp.experts.{e}.gate_proj.weight` and `up_proj.weight` [I, H] views of it). What SGLang and
    vLLM load; the pairs as they are for models without such conversions."""
    if get_checkpoint_conversion_mapping(config.model_type) is None:
        yield from named_weights
        return
    model = _meta_model(config)
    for name, tensor in named_weights:
        yield from checkpoint_names(model, {name: tensor}).items()
