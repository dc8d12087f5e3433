"""The trainer's weights as the engines serve them: in the engines' dtype (`--bf16` or their
`--*-dtype`: a bf16 engine gets half the bytes of an fp32 trainer's push) and under the names they
load (`EngineKind.loads_checkpoint_names`: SGLang and vLLM load a checkpoint's names, so a
mixture-of-experts model's fused `mlp.experts.gate_up_proj` / `down_proj` go as per-expert
`mlp.experts.{e}.gate_proj.weight`, ...; the native engine takes transformers' in-memory names).
Every transport and `--check-weight-update-equal` see these pairs."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import Tensor

from slime.engines.kinds import engine_kind


def served_weights(args, hf_config, named_weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """`named_weights` (HF in-memory names, full tensors) cast to the engines' dtype, under the
    engines' names (`hf_config`: the trained model's config; None: the names as they are, e.g. a
    LoRA adapter's peft names)."""
    kind = engine_kind(args)
    dtype = getattr(torch, kind.serve_dtype(args) or ("bfloat16" if args.bf16 else "float32"))
    cast = ((key, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t) for key, t in named_weights)
    if kind.loads_checkpoint_names and hf_config is not None:
        from slime.utils.hf_export import checkpoint_named_weights  # here: it imports transformers (the driver imports this module)

        return checkpoint_named_weights(hf_config, cast)
    return cast
