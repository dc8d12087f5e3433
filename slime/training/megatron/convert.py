"""Hugging Face <-> megatron-core ("torch_dist") weights for Llama/Qwen-family models.

Shared by tools/convert_hf_to_torch_dist.py and tools/convert_torch_dist_to_hf.py.

The checkpoint itself is written and read by megatron-core: a real `GPTModel`
(local, non-Transformer-Engine layer spec) is built on CPU in a one-process gloo
group, and its own `sharded_state_dict()` goes through
`megatron.core.dist_checkpointing.save/load`. So the on-disk names and layout
are megatron's (layers stacked along a leading axis, `input_layernorm` stored as
`self_attention.linear_qkv.layer_norm_weight`, and so on), not ours.

This module only maps the tensors between HF names and the GPTModel's own
(local-spec) parameter names:

    model.embed_tokens.weight            embedding.word_embeddings.weight
    layers.N.input_layernorm             decoder.layers.N.input_layernorm.weight
    layers.N.self_attn.{q,k,v}_proj      decoder.layers.N.self_attention.linear_qkv.{weight,bias}
    layers.N.self_attn.{q,k}_norm        decoder.layers.N.self_attention.{q,k}_layernorm.weight
    layers.N.self_attn.o_proj            decoder.layers.N.self_attention.linear_proj.weight
    layers.N.post_attention_layernorm    decoder.layers.N.pre_mlp_layernorm.weight
    layers.N.mlp.{gate,up}_proj          decoder.layers.N.mlp.linear_fc1.weight   (gate rows, then up rows)
    layers.N.mlp.down_proj               decoder.layers.N.mlp.linear_fc2.weight
    model.norm.weight                    decoder.final_layernorm.weight
    lm_head.weight                       output_layer.weight                      (only when not tied)

linear_qkv is fused per query group, the order megatron's attention splits it in:
for each of the `num_key_value_heads` groups, that group's query heads, then its
key head, then its value head.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slime.training.megatron.shims import cpu_only_cuda_shims  # noqa: F401 (all megatron-core CPU shims live there)
from slime.utils.dist import gloo_at
from slime.utils.errors import SlimeError
from slime.utils.net import LOOPBACK

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker file name
CHECKPOINT_VERSION = 3.0  # what Megatron-LM writes; >= 2.0 means "no legacy QKV reordering"
INSTALL_HINT = "pip install megatron-core"


def require_megatron():
    """Import megatron.core or raise a one-line SlimeError that names the fix."""
    try:  # the optional extra (megatron-core), imported where it is used
        import megatron.core
        from megatron.core import dist_checkpointing  # noqa: F401
        from megatron.core.models.gpt import GPTModel  # noqa: F401
    except ImportError as e:
        raise SlimeError(f"megatron-core is required for the torch_dist format ({e}); install it with "
                         f"`{INSTALL_HINT}`") from None
    return megatron.core


# ---------------------------------------------------------------------------------------------
# The HF config and what megatron-core needs from it
# ---------------------------------------------------------------------------------------------

def _rope(config) -> tuple[float, str]:
    """(rope_theta, rope_type) for transformers 4 (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`)."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if theta is None:
        raise SlimeError("the HF config has no rope_theta")
    return float(theta), rope_type


def check_config(config) -> None:
    """Refuse the HF configs this converter cannot represent exactly."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise SlimeError(f"model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    _, rope_type = _rope(config)
    if rope_type != "default":
        raise SlimeError(f"rope scaling {rope_type!r} is not supported (only plain RoPE)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise SlimeError(f"hidden_act {config.hidden_act!r} is not supported (only silu / SwiGLU)")
    if getattr(config, "mlp_bias", False):
        raise SlimeError("mlp_bias=True is not supported")
    if mt == "llama" and getattr(config, "attention_bias", False):
        raise SlimeError("attention_bias=True is not supported for llama (o_proj bias has no megatron slot here)")
    if mt == "qwen3" and getattr(config, "attention_bias", False):
        raise SlimeError("attention_bias=True is not supported for qwen3")
    if getattr(config, "use_sliding_window", False):
        raise SlimeError("sliding-window attention is not supported")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def has_qkv_bias(config) -> bool:
    return config.model_type == "qwen2"  # Qwen2 always has q/k/v biases and no o_proj bias


def has_qk_norm(config) -> bool:
    return config.model_type == "qwen3"


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron-LM's rule: round the vocabulary up to a multiple of divisible_by (times TP size)."""
    if divisible_by < 1:
        raise SlimeError(f"--make-vocab-size-divisible-by must be >= 1, got {divisible_by}")
    return -(-vocab_size // divisible_by) * divisible_by


# ---------------------------------------------------------------------------------------------
# Tensor mapping (pure torch; no megatron needed)
# ---------------------------------------------------------------------------------------------

def _fuse_qkv(q, k, v, n_groups: int):
    """[nq*d, ...], [ng*d, ...], [ng*d, ...] -> [(nq + 2 ng)*d, ...], grouped per query group."""
    rest = q.shape[1:]
    q = q.reshape(n_groups, -1, *rest)
    k = k.reshape(n_groups, -1, *rest)
    v = v.reshape(n_groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def _split_qkv(qkv, n_heads: int, n_groups: int, d: int):
    rest = qkv.shape[1:]
    per_group = qkv.reshape(n_groups, (n_heads // n_groups + 2) * d, *rest)
    q_rows = n_heads // n_groups * d
    q = per_group[:, :q_rows].reshape(n_heads * d, *rest).contiguous()
    k = per_group[:, q_rows:q_rows + d].reshape(n_groups * d, *rest).contiguous()
    v = per_group[:, q_rows + d:].reshape(n_groups * d, *rest).contiguous()
    return q, k, v


def hf_to_mcore(state: dict, config, vocab_rows: int | None = None, mlp: bool = True) -> dict:
    """HF state dict -> megatron GPTModel (local spec) state dict. vocab_rows pads the embedding
    (and untied output layer) with zero rows up to that size; `mlp=False`: the MLPs are left out
    (mixture-of-experts layers, mapped by slime.training.megatron.moe)."""
    check_config(config)
    state = dict(state)
    ng = num_kv_heads(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))

    def take(name):
        try:
            return state.pop(name)
        except KeyError:
            raise SlimeError(f"HF checkpoint has no {name}") from None

    def pad(t):
        if vocab_rows is None or vocab_rows == t.shape[0]:
            return t
        if vocab_rows < t.shape[0]:
            raise SlimeError(f"padded vocabulary {vocab_rows} is smaller than the checkpoint's {t.shape[0]} rows")
        return torch.cat([t, t.new_zeros(vocab_rows - t.shape[0], *t.shape[1:])])

    out = {"embedding.word_embeddings.weight": pad(take("model.embed_tokens.weight"))}
    for i in range(config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = take(h + "input_layernorm.weight")
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            take(h + "self_attn.q_proj.weight"), take(h + "self_attn.k_proj.weight"),
            take(h + "self_attn.v_proj.weight"), ng)
        if has_qkv_bias(config):
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                take(h + "self_attn.q_proj.bias"), take(h + "self_attn.k_proj.bias"),
                take(h + "self_attn.v_proj.bias"), ng)
        if has_qk_norm(config):
            out[m + "self_attention.q_layernorm.weight"] = take(h + "self_attn.q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = take(h + "self_attn.k_norm.weight")
        out[m + "self_attention.linear_proj.weight"] = take(h + "self_attn.o_proj.weight")
        out[m + "pre_mlp_layernorm.weight"] = take(h + "post_attention_layernorm.weight")
        if not mlp:
            continue
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [take(h + "mlp.gate_proj.weight"), take(h + "mlp.up_proj.weight")]).contiguous()
        out[m + "mlp.linear_fc2.weight"] = take(h + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    lm_head = state.pop("lm_head.weight", None)
    if not tied:
        if lm_head is None:
            raise SlimeError("HF checkpoint has no lm_head.weight and tie_word_embeddings is false")
        out["output_layer.weight"] = pad(lm_head)
    leftover = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise SlimeError(f"HF tensors with no megatron counterpart: {leftover[:5]}")
    return out


def mcore_to_hf(state: dict, config, vocab_size: int | None = None, mlp: bool = True) -> dict:
    """megatron GPTModel (local spec) state dict -> HF state dict; vocab_size trims padded rows;
    `mlp=False`: the MLPs are left out (as in hf_to_mcore)."""
    check_config(config)
    state = {k: v for k, v in state.items() if not k.endswith("_extra_state") and v is not None}
    nq, ng, d = config.num_attention_heads, num_kv_heads(config), head_dim(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))

    def take(name):
        try:
            return state.pop(name)
        except KeyError:
            raise SlimeError(f"megatron checkpoint has no {name}") from None

    def trim(t):
        if vocab_size is None:
            return t
        if vocab_size > t.shape[0]:
            raise SlimeError(f"--vocab-size {vocab_size} is larger than the checkpoint's {t.shape[0]} embedding rows")
        return t[:vocab_size].clone()

    out = {"model.embed_tokens.weight": trim(take("embedding.word_embeddings.weight"))}
    for i in range(config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = take(m + "input_layernorm.weight")
        q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.weight"), nq, ng, d)
        out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"], out[h + "self_attn.v_proj.weight"] = q, k, v
        if has_qkv_bias(config):
            q, k, v = _split_qkv(take(m + "self_attention.linear_qkv.bias"), nq, ng, d)
            out[h + "self_attn.q_proj.bias"], out[h + "self_attn.k_proj.bias"], out[h + "self_attn.v_proj.bias"] = q, k, v
        if has_qk_norm(config):
            out[h + "self_attn.q_norm.weight"] = take(m + "self_attention.q_layernorm.weight")
            out[h + "self_attn.k_norm.weight"] = take(m + "self_attention.k_layernorm.weight")
        out[h + "self_attn.o_proj.weight"] = take(m + "self_attention.linear_proj.weight")
        out[h + "post_attention_layernorm.weight"] = take(m + "pre_mlp_layernorm.weight")
        if not mlp:
            continue
        gate, up = torch.chunk(take(m + "mlp.linear_fc1.weight"), 2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[h + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if not tied:
        out["lm_head.weight"] = trim(take("output_layer.weight"))
    if state:
        raise SlimeError(f"megatron tensors with no HF counterpart: {sorted(state)[:5]}")
    return out


# ---------------------------------------------------------------------------------------------
# megatron-core: process group, GPTModel, dist_checkpointing
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def single_process_parallel_state():
    """A one-process gloo group with TP = PP = 1, as megatron-core's model code expects;
    torn down on exit if this call set it up."""
    require_megatron()
    from megatron.core import parallel_state  # optional extra (megatron-core)

    own_group = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if own_group:
            store = dist.FileStore(os.path.join(tmp, "store"), 1)
            dist.init_process_group(gloo_at(LOOPBACK), store=store, rank=0, world_size=1)
        own_mp = not parallel_state.model_parallel_is_initialized()
        if own_mp:
            parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            if own_mp:
                parallel_state.destroy_model_parallel()
            if own_group:
                dist.destroy_process_group()


def transformer_config(config, dtype):
    from megatron.core.transformer import TransformerConfig  # optional extra (megatron-core)

    check_config(config)
    return TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=num_kv_heads(config),
        kv_channels=head_dim(config),
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(config),
        qk_layernorm=has_qk_norm(config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,  # every parameter is overwritten by the checkpoint
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_gpt_model(config, vocab_rows: int, dtype, moe_config=None, num_experts: int | None = None):
    """megatron-core GPTModel (local layer spec) matching the (dense) HF config; needs
    single_process_parallel_state(). An MoE model passes its dense twin as `config` with its own
    TransformerConfig (`moe_config`) and expert count (slime.training.megatron.moe.build_gpt_model)."""
    from megatron.core.models.gpt import GPTModel  # optional extra (megatron-core)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # optional extra (megatron-core)

    theta, _ = _rope(config)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=has_qk_norm(config),
                                    num_experts=num_experts, moe_grouped_gemm=False)
    model = GPTModel(
        config=moe_config or transformer_config(config, dtype),
        transformer_layer_spec=spec,
        vocab_size=vocab_rows,
        max_sequence_length=config.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=bool(getattr(config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=theta,
    )
    return model.to(dtype)


def load_mcore_state(model, state: dict) -> None:
    """Load a hf_to_mcore() state into the GPTModel; every parameter must be covered."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise SlimeError(f"weights do not match the megatron model (missing {missing[:5]}, unexpected {unexpected[:5]})")


def save_torch_dist(model, save_dir: str | Path, iteration: int = 0) -> Path:
    """Write `save_dir/iter_XXXXXXX/` with megatron's dist_checkpointing plus Megatron-LM's
    `latest_checkpointed_iteration.txt`. The common part holds what Megatron-LM's loader reads:
    `model` (the sharded state dict), `iteration`, `checkpoint_version`."""
    from megatron.core import dist_checkpointing  # optional extra (megatron-core)

    save_dir = Path(save_dir)
    ckpt = save_dir / f"iter_{iteration:07d}"
    if ckpt.exists() and any(ckpt.iterdir()):
        raise SlimeError(f"--save {save_dir}: {ckpt.name} already exists and is not empty")
    ckpt.mkdir(parents=True, exist_ok=True)
    state = {"model": model.sharded_state_dict(), "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION}
    with cpu_only_cuda_shims():
        dist_checkpointing.save(state, str(ckpt), content_metadata={})
    (save_dir / TRACKER_FILE).write_text(f"{iteration}\n")
    return ckpt


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A Megatron save directory (its tracker file names the iteration) or one iter_*/release dir in it."""
    from megatron.core import dist_checkpointing  # optional extra (megatron-core)

    path = Path(path)
    if dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        return path
    tracker = path / TRACKER_FILE
    if not tracker.is_file():
        raise SlimeError(f"--input-dir {path}: not a torch_dist checkpoint (no metadata.json) and no {TRACKER_FILE} in it")
    text = tracker.read_text().strip()
    if text == "release":
        ckpt = path / "release"
    else:
        try:
            ckpt = path / f"iter_{int(text):07d}"
        except ValueError:
            raise SlimeError(f"{tracker}: expected an iteration number or 'release', got {text!r}") from None
    if not dist_checkpointing.check_is_distributed_checkpoint(str(ckpt)):
        raise SlimeError(f"{ckpt}: named by {TRACKER_FILE} but not a torch_dist checkpoint (no metadata.json)")
    return ckpt


def checkpoint_tensor_shapes(ckpt: Path) -> dict:
    """{sharded key: (global shape, dtype)} from the checkpoint's metadata, without loading tensors."""
    from megatron.core import dist_checkpointing  # optional extra (megatron-core)

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
    return {k: (tuple(v.global_shape), v.dtype) for k, v in meta.items() if hasattr(v, "global_shape")}


def load_torch_dist(model, ckpt: Path) -> None:
    """Fill the GPTModel from a torch_dist checkpoint through megatron's own sharded loading."""
    from megatron.core import dist_checkpointing  # optional extra (megatron-core)

    with cpu_only_cuda_shims():
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    model_state = loaded.get("model")
    if model_state is None:
        raise SlimeError(f"{ckpt}: the checkpoint has no 'model' section")
    missing, unexpected = model.load_state_dict(model_state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise SlimeError(f"{ckpt}: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})")
