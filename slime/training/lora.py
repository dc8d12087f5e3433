"""LoRA on the trainer: peft adapters on a frozen base (`--lora-rank`; flags in slime.lora_flags).

`add_adapters(model, args)` wraps a Hugging Face causal LM in peft's `PeftModel` with a LoRA adapter
on `--target-modules` (or loads `--lora-adapter-path` as trainable); only the adapter's parameters
require gradients. The rest of the backend sees the same model: its forward, its decoder layers
(one FSDP unit each) and its output layer.

What leaves the trainer, gathered from the shards (collective over the train ranks):
- `merged_weights(model)`: (Hugging Face name, W + (alpha / r) * B A) of every base parameter: the
  full model an engine without LoRA loads (`--lora-sync merged`);
- `adapter_weights(model)`: (peft name, tensor) of the adapter only, the names `PeftModel.save_pretrained`
  writes (`base_model.model.<module>.lora_A.weight`), for engines that serve adapters;
- `write_adapter(dir, tensors, config)`: that adapter as a peft directory (`adapter_config.json` +
  `adapter_model.safetensors`), loadable with `PeftModel.from_pretrained` and by SGLang and vLLM.

The reference model of the KL term is the same model with the adapter switched off
(`adapter_disabled(model)`): no second copy of the base exists.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.tensor import DTensor

from slime.lora_flags import ADAPTER_CONFIG, ADAPTER_WEIGHTS, ALL_LINEAR, PEFT_PREFIX

ADAPTER = "default"  # peft's name of the one adapter slime trains


def lora_config(args) -> LoraConfig:
    targets = ALL_LINEAR if args.target_modules == [ALL_LINEAR] else list(args.target_modules)
    return LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=targets, use_rslora=args.lora_use_rslora, bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=str(args.hf_checkpoint))


def add_adapters(model: torch.nn.Module, args) -> PeftModel:
    """The model with a trainable LoRA adapter (new, or `--lora-adapter-path`) in fp32; the base is
    frozen (in whatever dtype it was loaded). New adapters start as peft initializes them (B = 0:
    the model's outputs are unchanged)."""
    if args.lora_adapter_path is not None:
        peft_model = PeftModel.from_pretrained(model, args.lora_adapter_path, is_trainable=True)
    else:
        peft_model = get_peft_model(model, lora_config(args))
    for name, p in peft_model.named_parameters():
        p.requires_grad_(".lora_" in name)
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()  # adapters train in fp32 whatever the base's dtype
    return peft_model


@contextlib.contextmanager
def adapter_disabled(model: PeftModel):
    """The base model alone (the KL reference): peft's forward without the adapter."""
    with model.disable_adapter():
        yield


def set_dropout_training(model: torch.nn.Module, on: bool) -> None:
    """LoRA dropout is active only in the training forward (the model itself stays in eval mode)."""
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for drop in module.lora_dropout.values():
                drop.train(on)


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def hf_name(peft_name: str) -> str:
    """A base parameter's Hugging Face name from its name inside the peft model."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def merged_weights(model: PeftModel, merge: bool = True) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, full tensor) of every base parameter with the adapter merged in (or, with
    `merge` False, the frozen base alone), tied ones once. Collective: every rank gathers every shard
    in the same order."""
    lora_of = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            lora_of[name + ".base_layer.weight"] = module
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        w = _full(p.detach())
        layer = lora_of.get(name) if merge else None
        if layer is not None:
            a = _full(layer.lora_A[ADAPTER].weight.detach()).float()
            b = _full(layer.lora_B[ADAPTER].weight.detach()).float()
            w = (w.float() + layer.scaling[ADAPTER] * (b @ a)).to(w.dtype)
        yield hf_name(name), w.contiguous()


def adapter_weights(model: PeftModel) -> Iterator[tuple[str, Tensor]]:
    """(peft file name, full tensor) of every adapter tensor, in the names peft saves them under
    (`base_model.model.<module>.lora_A.weight`). Collective."""
    suffix = f".{ADAPTER}.weight"
    for name, p in model.named_parameters():
        if ".lora_" in name:
            yield name.replace(suffix, ".weight"), _full(p.detach()).contiguous()


def adapter_config(model: PeftModel) -> dict:
    """The adapter's `adapter_config.json` content (peft's LoraConfig as it saves it)."""
    config = model.peft_config[ADAPTER].to_dict()
    for key, value in config.items():
        if isinstance(value, set):
            config[key] = sorted(value)
    return json.loads(json.dumps(config, default=str))


def write_adapter(out: str | Path, tensors: dict[str, Tensor], config: dict) -> Path:
    """A peft adapter directory: `adapter_model.safetensors` + `adapter_config.json`, each fsynced."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = out / ADAPTER_WEIGHTS
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(weights),
              metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    for f in (weights, out / ADAPTER_CONFIG):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return out
