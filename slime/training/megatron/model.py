"""megatron-core GPTModel built from a Hugging Face config (Llama, Qwen2 with q/k/v bias, Qwen3).

The layer spec is megatron's local (non-Transformer-Engine) one: ColumnParallelLinear /
RowParallelLinear / VocabParallelEmbedding from `megatron.core.tensor_parallel`, megatron's
DotProductAttention and its RMSNorm. The HF -> TransformerConfig translation (RMSNorm eps,
SwiGLU, grouped-query heads, head_dim, RoPE base, biases, qk-norm) is the one the conversion
tools use (`slime.training.megatron.convert.transformer_config`), so the trainer and the
torch_dist checkpoints describe the same model.

Needs `megatron.core.parallel_state` to be initialized (see backend.py). Imports megatron-core at
the top, like backend.py (the only module that imports this one).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from slime.training.megatron import convert as mc
from slime.training.megatron import moe
from slime.utils.pipeline_layout import PipelineLayout
from slime.utils.errors import SlimeConfigError


def padded_vocab(config, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: the vocabulary padded to a multiple of divisible_by x TP size."""
    return mc.padded_vocab_size(config.vocab_size, divisible_by * tp)


def check_parallel_config(config, tp: int) -> None:
    """Refuse HF configs whose heads cannot be split over `tp` ranks, naming the numbers."""
    mc.check_config(config)
    nq, ng = config.num_attention_heads, mc.num_kv_heads(config)
    for what, n in (("num_attention_heads", nq), ("num_key_value_heads", ng),
                    ("intermediate_size", config.intermediate_size)):
        if n % tp:
            raise SlimeConfigError(f"--tensor-model-parallel-size {tp} must divide the model's {what} ({n})")


def build_model(config, *, tp: int = 1, sequence_parallel: bool = False, dtype=torch.float32,
                vocab_divisible_by: int = 128,
                recompute: tuple[str | None, str | None, int | None] = (None, None, None),
                layout: PipelineLayout = PipelineLayout(), vp_stage: int | None = None, ep: int = 1,
                etp: int = 1, load_dtype: torch.dtype | None = None, mrope_section: list[int] | None = None):
    """A GPTModel for one tensor-parallel rank and one pipeline model chunk (`vp_stage` of this
    rank's pipeline stage; the whole model with PP 1). Embedding on the first stage, output
    layer on the last (megatron's parallel_state must be initialized with the same layout).
    `recompute`: megatron's (recompute_granularity, recompute_method, recompute_num_layers);
    `vocab_divisible_by`: --make-vocab-size-divisible-by (the vocabulary is padded to a multiple of it x TP).

    The output layer gathers the vocabulary-parallel logits (`parallel_output=False`, a
    differentiable all-gather), so every TP rank of the last stage sees full [b, s, V_padded] logits.
    A mixture-of-experts config gets megatron's MoE layers (moe.py; `ep` / `etp`: the expert-parallel and
    expert-tensor-parallel sizes; `etp` is 1 or `tp`).
    `dtype`: what the model computes in (megatron's config: bf16 attention softmax in fp32, bf16
    activations between stages); `load_dtype`: the parameters' dtype on return, where the
    checkpoint is loaded (default `dtype`; --bf16 loads fp32 for the main copies, precision.py).
    `mrope_section`: a vision-language model's multimodal rope (position ids [3, b, s]; vision.py).
    """
    is_moe = moe.is_moe(config)
    check_parallel_config(moe.dense_twin(config) if is_moe else config, tp)
    layout.check(config.num_hidden_layers)
    theta, _ = mc._rope(config)
    granularity, method, num_layers = recompute
    base = moe.transformer_config(config, dtype, ep, etp) if is_moe else mc.transformer_config(config, dtype)
    tconf = dataclasses.replace(base, tensor_model_parallel_size=tp,
                                sequence_parallel=sequence_parallel, recompute_granularity=granularity,
                                recompute_method=method if granularity == "full" else None,
                                recompute_num_layers=num_layers if granularity == "full" else None,
                                mrope_section=mrope_section, **layout.config_fields(dtype))
    spec = get_gpt_layer_local_spec(normalization="RMSNorm",
                                    qk_layernorm=mc.has_qk_norm(moe.dense_twin(config) if is_moe else config),
                                    num_experts=moe.num_experts(config) if is_moe else None, moe_grouped_gemm=False)
    vp = vp_stage if layout.vp > 1 else None
    if sequence_parallel:
        spec = _sequence_parallel_block(spec, tconf, vp)
    model = GPTModel(
        config=tconf,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(config, tp, vocab_divisible_by),
        max_sequence_length=config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
        parallel_output=False,
        share_embeddings_and_output_weights=bool(getattr(config, "tie_word_embeddings", False)),
        position_embedding_type="mrope" if mrope_section else "rope",
        rotary_base=theta,
        vp_stage=vp,
    )
    _mark_tensor_parallel(model, split_experts=etp > 1)
    _pad_row_without_lookup_gradient(model, getattr(config, "pad_token_id", None), config.vocab_size)
    model.to(load_dtype or dtype)
    # dropout is 0 anyway; eval keeps it that way for any future layer. megatron recomputes only in
    # training mode, so a model built to recompute is left in it (the same numbers: no dropout)
    model.train(granularity is not None)
    return model


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for a decoder layer under sequence parallelism (megatron's local spec wraps
    torch norms but refuses them there, expecting Transformer Engine's or apex's). Each TP rank
    normalizes its own shard of the sequence, so the weight's gradient is partial: it is marked
    `sequence_parallel`, and the backend sums such gradients over the TP group (megatron's
    finalize_model_grads does the same for its own norms)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = True


class HeadRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for the per-head q/k norms, which sequence parallelism does not split."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)


def _sequence_parallel_block(spec, tconf, vp_stage):
    """The local layer spec with the norms above, as the block spec of this pipeline chunk's layers."""
    spec = copy.deepcopy(spec)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    attention = spec.submodules.self_attention.submodules
    if attention.q_layernorm not in (None, IdentityOp):  # q/k norms (Qwen3); megatron's no-op otherwise
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(tconf, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelRMSNorm)


def _pad_row_without_lookup_gradient(model, pad_id: int | None, vocab_size: int) -> None:
    """The Hugging Face models build their embedding as `nn.Embedding(..., padding_idx=pad_token_id)`:
    a position holding the pad token adds no gradient to the pad token's row (a tied output layer
    still trains it), and the FSDP backend trains them so. megatron's VocabParallelEmbedding has no
    padding_idx, so its output at those positions is detached here (the same values). The output is
    [b, s, h], or under sequence parallelism [s / tp, b, h]: this TP rank's part of the sequence."""
    emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    if emb is None or pad_id is None or not 0 <= int(pad_id) < vocab_size:
        return

    def detach_pad_positions(module, args, out):
        pad = args[0] == int(pad_id)  # [b, s]
        if module.reduce_scatter_embeddings:
            n, rank = out.shape[0], ps.get_tensor_model_parallel_rank()
            pad = pad.t()[rank * n: (rank + 1) * n]
        return torch.where(pad.unsqueeze(-1).to(out.device), out.detach(), out)

    emb.register_forward_hook(detach_pad_positions)


def _mark_tensor_parallel(model, split_experts: bool) -> None:
    """Give the TP-split weights megatron's `tensor_model_parallel` / `partition_dim` attributes.

    megatron-core sets them while it initializes a weight; with `use_cpu_initialization` and
    `perform_initialization=False` (every weight comes from the HF checkpoint) it skips that, so
    the attributes that gradient-norm bookkeeping (`param_is_not_tensor_parallel_duplicate`) and
    our sharding (weights.py) read would be missing. Same values megatron would set. An MoE expert's
    linear layers are split over the expert-TP group, which slime builds as the TP group
    (`split_experts`: expert tensor parallelism = TP) or of size 1 (every TP rank holds each of its
    experts whole: marked not TP-split)."""
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(m, RowParallelLinear):
            dim = 1
        else:
            continue
        w = getattr(m, "weight", None)
        if w is not None and not hasattr(w, "tensor_model_parallel"):
            whole = getattr(m, "is_expert", False) and not split_experts
            set_tensor_model_parallel_attributes(w, not whole, dim if not whole else -1, 1)
