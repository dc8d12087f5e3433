"""Megatron-LM's model-architecture flags (slime's `scripts/models/*.sh` presets), checked against the
Hugging Face config of `--hf-checkpoint`.

slime's launch scripts describe the model twice: `MODEL_ARGS` (Megatron's names: `--num-layers`,
`--hidden-size`, `--num-query-groups`, ...) and the checkpoint's `config.json`. Here the checkpoint is
the model; every architecture flag given is compared with what the config says, and a difference is
one line naming the flag, its value and the config's value (`architecture_mismatches`). A flag whose
counterpart this module cannot read from the config (a model family it does not know) is refused the
same way: it is never taken on trust. Flags left out are not checked (the config decides).

`architecture_of(config)` is the translation, in Megatron's vocabulary; the megatron backend builds
its model from the same values (see `slime.training.megatron.model`), so flags, config and model
describe one architecture.
"""

from __future__ import annotations

import argparse
import ast
import math

# every flag here defaults to None: "not given, not checked"
_INT = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "vocab_size", "max_position_embeddings", "seq_length", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
        "qk_pos_emb_head_dim", "v_head_dim", "num_experts", "moe_ffn_hidden_size", "moe_router_topk",
        "moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk", "mtp_num_layers")
_FLOAT = ("norm_epsilon", "rotary_base", "rotary_percent", "rotary_scaling_factor", "mscale", "mscale_all_dim",
          "moe_router_topk_scaling_factor")
_SWITCH = ("group_query_attention", "swiglu", "disable_bias_linear", "add_qkv_bias",
           "untie_embeddings_and_output_weights", "qk_layernorm", "use_rotary_position_embeddings",
           "no_position_embedding", "rotary_interleaved", "use_rope_scaling", "apply_layernorm_1p",
           "post_self_attn_layernorm", "post_mlp_layernorm", "attention_output_gate", "use_gated_attention",
           "multi_latent_attention", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
           "moe_shared_expert_gate")
_CHOICE = {"normalization": ("RMSNorm", "LayerNorm"), "position_embedding_type": ("rope", "learned_absolute", "none"),
           "moe_router_score_function": ("softmax", "sigmoid")}
ARCHITECTURE_DESTS = (*_INT, *_FLOAT, *_SWITCH, *_CHOICE, "moe_layer_freq", "spec", "model_name")

ANY = object()  # the flag does not apply to this config: any value agrees

# the Megatron layer spec of slime's plugins -> the Hugging Face model types it builds
SPEC_MODEL_TYPES = {
    "slime_plugins.models.glm4": ("glm4",),
    "slime_plugins.models.glm5.glm5": ("glm_moe_dsa", "glm5"),
    "slime_plugins.models.qwen3_next": ("qwen3_next",),
    "slime_plugins.models.qwen3_5": ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"),
    "slime_plugins.models.minimax_m2": ("minimax_m2",),
}
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo2", "gemma3", "gemma3_text")
_ONE_PLUS_NORM_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma", "gemma2", "gemma3", "gemma3_text")
_GATED_ATTENTION_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
_SANDWICH_NORM_TYPES = ("glm4", "gemma2", "gemma3", "gemma3_text")


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "model architecture (Megatron-LM names, as in slime's scripts/models/*.sh; checked against "
        "--hf-checkpoint's config.json, docs/coming_from_slime.md)")
    for dest in _INT:
        g.add_argument(flag_name(dest), type=int, default=None)
    for dest in _FLOAT:
        g.add_argument(flag_name(dest), type=float, default=None)
    for dest in _SWITCH:
        g.add_argument(flag_name(dest), action="store_const", const=True, default=None)
    for dest, choices in _CHOICE.items():
        g.add_argument(flag_name(dest), choices=choices, default=None)
    g.add_argument("--moe-layer-freq", default=None,
                   help="MoE layers: N (every N-th layer) or a Python list expression such as [0]*3+[1]*58")
    g.add_argument("--spec", nargs="+", default=None, metavar=("MODULE", "FUNCTION"),
                   help="the Megatron layer spec of slime's plugins; checked against the checkpoint's model type")
    g.add_argument("--model-name", default=None,
                   help="slime's model name for weight conversion; checked against the checkpoint's model type")


def given(args) -> dict[str, object]:
    """The architecture flags the user gave (dest -> value)."""
    return {d: getattr(args, d) for d in ARCHITECTURE_DESTS if getattr(args, d, None) is not None}


# ------------------------------------------------------------------------------------------------
# config.json in Megatron's vocabulary
# ------------------------------------------------------------------------------------------------

def _get(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def _rope(config) -> tuple[float | None, dict]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    info = {**params, **scaling}
    info.setdefault("rope_type", info.get("type", "default"))
    return (None if theta is None else float(theta)), info


def moe_layers(spec: str | int, num_layers: int) -> list[int]:
    """Megatron's --moe-layer-freq: an int N (layer i is MoE when i % N == 0) or a list expression of 0/1."""
    if isinstance(spec, int) or str(spec).strip().isdigit():
        n = int(spec)
        if n < 1:
            raise ValueError(f"--moe-layer-freq {spec}: must be >= 1")
        return [1 if i % n == 0 else 0 for i in range(num_layers)]
    try:
        value = _eval_list(ast.parse(str(spec), mode="eval").body)
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"--moe-layer-freq {spec!r}: not an int or a list of 0/1 ({e})") from None
    if any(v not in (0, 1) for v in value):
        raise ValueError(f"--moe-layer-freq {spec!r}: entries must be 0 or 1")
    return value


def _eval_list(node) -> list[int]:  # lists of ints, list + list, list * int: nothing else runs
    if isinstance(node, ast.List):
        out = []
        for e in node.elts:
            if not (isinstance(e, ast.Constant) and isinstance(e.value, int)):
                raise ValueError("list entries must be integers")
            out.append(e.value)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _eval_list(node.left) + _eval_list(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if isinstance(node.right, ast.Constant) and isinstance(node.right.value, int):
            return _eval_list(node.left) * node.right.value
        if isinstance(node.left, ast.Constant) and isinstance(node.left.value, int):
            return node.left.value * _eval_list(node.right)
    raise ValueError("only [..], + and * are allowed")


def _config_moe_layers(config, num_layers: int) -> list[int] | None:
    mt = config.model_type
    if _get(config, "num_experts", "n_routed_experts", "num_local_experts") is None:
        return None
    if _get(config, "first_k_dense_replace") is not None:  # deepseek, glm4_moe, kimi
        k, freq = config.first_k_dense_replace, _get(config, "moe_layer_freq", default=1)
        return [1 if i >= k and i % freq == 0 else 0 for i in range(num_layers)]
    if mt in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        step, dense = _get(config, "decoder_sparse_step", default=1), set(_get(config, "mlp_only_layers", default=[]))
        return [1 if i not in dense and (i + 1) % step == 0 else 0 for i in range(num_layers)]
    if mt in ("mixtral", "minimax_m2"):
        return [1] * num_layers
    return None


def architecture_of(config) -> dict[str, object]:
    """What each architecture flag should be for this config; a flag missing here cannot be checked."""
    mt = getattr(config, "model_type", "")
    heads, hidden = config.num_attention_heads, config.hidden_size
    kv = _get(config, "num_key_value_heads", default=heads)
    theta, rope = _rope(config)
    mla = _get(config, "kv_lora_rank") is not None
    attention_bias = bool(_get(config, "attention_bias", default=False))
    qkv_bias_only = mt in ("qwen2", "qwen2_moe", "glm4", "glm4_moe")  # biases on q/k/v, none on o_proj
    a: dict[str, object] = {
        "num_layers": config.num_hidden_layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_query_groups": kv, "group_query_attention": kv < heads,
        "kv_channels": _get(config, "v_head_dim") if mla else _get(config, "head_dim", default=hidden // heads),
        "vocab_size": config.vocab_size,
        "untie_embeddings_and_output_weights": not getattr(config, "tie_word_embeddings", True),
        "add_qkv_bias": True if mt in ("qwen2", "qwen2_moe") else attention_bias,
        "disable_bias_linear": (not _get(config, "mlp_bias", default=False)
                                and (qkv_bias_only or not attention_bias)),
        "qk_layernorm": mla or bool(_get(config, "use_qk_norm", default=mt in _QK_NORM_TYPES)),
        "apply_layernorm_1p": mt in _ONE_PLUS_NORM_TYPES,
        "post_self_attn_layernorm": mt in _SANDWICH_NORM_TYPES, "post_mlp_layernorm": mt in _SANDWICH_NORM_TYPES,
        "attention_output_gate": mt in _GATED_ATTENTION_TYPES, "use_gated_attention": mt in _GATED_ATTENTION_TYPES,
        "multi_latent_attention": mla,
        "rotary_interleaved": bool(_get(config, "rope_interleave", default=mt in ("glm4", "glm"))),
    }
    if _get(config, "intermediate_size") is not None:
        a["ffn_hidden_size"] = config.intermediate_size
    act = _get(config, "hidden_act", "hidden_activation", "activation_function")
    if act is not None:
        a["swiglu"] = act in ("silu", "swish")
    eps = _get(config, "rms_norm_eps", "layer_norm_eps", "layernorm_epsilon", "norm_epsilon")
    if eps is not None:
        a["norm_epsilon"] = float(eps)
        a["normalization"] = "RMSNorm" if _get(config, "rms_norm_eps") is not None or mt.startswith("glm") else "LayerNorm"
    if theta is not None:
        a.update(rotary_base=theta, position_embedding_type="rope", use_rotary_position_embeddings=True,
                 no_position_embedding=True,
                 rotary_percent=float(_get(config, "partial_rotary_factor", default=rope.get("partial_rotary_factor", 1.0))),
                 use_rope_scaling=rope["rope_type"] == "llama3",
                 rotary_scaling_factor=float(rope.get("factor", 1.0)),
                 mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 1.0)))
    if _get(config, "max_position_embeddings") is not None:
        a["max_position_embeddings"] = config.max_position_embeddings
    if mla:
        a.update(q_lora_rank=_get(config, "q_lora_rank"), kv_lora_rank=config.kv_lora_rank,
                 qk_head_dim=_get(config, "qk_nope_head_dim"), qk_pos_emb_head_dim=_get(config, "qk_rope_head_dim"),
                 v_head_dim=_get(config, "v_head_dim"))
    experts = _get(config, "num_experts", "n_routed_experts", "num_local_experts")
    if experts:
        score = _get(config, "scoring_func", default="softmax")
        a.update(num_experts=experts, moe_ffn_hidden_size=_get(config, "moe_intermediate_size", "intermediate_size"),
                 moe_router_topk=_get(config, "num_experts_per_tok"), moe_router_score_function=score,
                 moe_router_topk_scaling_factor=float(_get(config, "routed_scaling_factor", default=1.0)),
                 moe_router_enable_expert_bias=(_get(config, "topk_method") == "noaux_tc"
                                                or mt in ("glm4_moe", "minimax_m2")),
                 moe_shared_expert_gate=mt in ("qwen2_moe", "qwen3_next", "qwen3_5_moe"))
        if score == "softmax":  # topk of a softmax then renormalised == softmax of the top-k logits (Megatron's default)
            a["moe_router_pre_softmax"] = not bool(_get(config, "norm_topk_prob", default=True))
        else:  # Megatron reads --moe-router-pre-softmax only for softmax routers
            a["moe_router_pre_softmax"] = ANY
        shared = _get(config, "shared_expert_intermediate_size")
        if shared is None and _get(config, "n_shared_experts") is not None:
            shared = config.n_shared_experts * config.moe_intermediate_size
        if shared is not None:
            a["moe_shared_expert_intermediate_size"] = shared
        if _get(config, "n_group") is not None:
            a.update(moe_router_num_groups=config.n_group, moe_router_group_topk=_get(config, "topk_group"))
        layers = _config_moe_layers(config, config.num_hidden_layers)
        if layers is not None:
            a["moe_layer_freq"] = layers
    else:
        a["num_experts"] = 0
    nextn = _get(config, "num_nextn_predict_layers", "mtp_num_layers")
    a["mtp_num_layers"] = int(nextn or 0)
    return a


def _same(flag_value, config_value) -> bool:
    if config_value is ANY:
        return True
    if isinstance(flag_value, float) or isinstance(config_value, float):
        return math.isclose(float(flag_value), float(config_value), rel_tol=1e-9, abs_tol=0.0)
    return flag_value == config_value


def _describe(config) -> str:
    return f"the checkpoint's config.json (model_type {getattr(config, 'model_type', '?')!r})"


def architecture_mismatches(args, config) -> list[str]:
    """One line per architecture flag given that the checkpoint's config contradicts or cannot confirm."""
    expected = architecture_of(config)
    where = _describe(config)
    mt = getattr(config, "model_type", "")
    out = []
    for dest, value in given(args).items():
        flag = flag_name(dest)
        if dest == "spec":
            types = SPEC_MODEL_TYPES.get(value[0])
            if types is None:
                out.append(f"{flag} {' '.join(value)}: unknown layer spec (known: {', '.join(SPEC_MODEL_TYPES)})")
            elif mt not in types:
                out.append(f"{flag} {value[0]} builds {'/'.join(types)} models, but {where} is {mt!r}")
            continue
        if dest == "model_name":  # slime's default is the config class's name, lower-cased
            names = {mt, type(config).__name__.lower(), *(a.lower() for a in getattr(config, "architectures", None) or [])}
            if _squash(value) not in {_squash(n) for n in names}:
                out.append(f"{flag} {value}: {where} is a {mt!r} model")
            continue
        if dest == "seq_length":
            limit = expected.get("max_position_embeddings")
            if limit is not None and value > limit:
                out.append(f"{flag} {value} is longer than max_position_embeddings {limit} in {where}")
            continue
        if dest == "moe_layer_freq":
            try:
                value = moe_layers(value, config.num_hidden_layers)
            except ValueError as e:
                out.append(str(e))
                continue
            if len(value) != config.num_hidden_layers:
                out.append(f"{flag} lists {len(value)} layers; {where} has {config.num_hidden_layers}")
                continue
        if dest not in expected:
            out.append(f"{flag} {_show(value)}: slime cannot read this from {where}, so it cannot be checked; "
                       f"remove the flag (the checkpoint decides)")
        elif not _same(value, expected[dest]):
            out.append(f"{flag} {_show(value)} does not match {where}: it has {_show(expected[dest])}")
    return out


def _squash(name: str) -> str:
    return str(name).lower().replace("_", "").replace("-", "").replace(".", "")


def _show(value) -> str:
    if value is True:
        return "(set)"
    if value is False:
        return "(not set)"
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(str, value[:8]))}, ... ({len(value)} layers)]"
    return str(value)
