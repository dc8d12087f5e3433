"""slime's own launch scripts parse as typed (their argument lists: tests/helpers/slime_scripts.py), and
each flag means what it means in slime."""

import pytest

from slime.arguments import parse_flags
from slime.model_flags import moe_layers
from tests.helpers.slime_scripts import SCRIPTS


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_slime_script_parses(name):
    args = parse_flags(SCRIPTS[name])
    assert args.hf_checkpoint.startswith("/root/")
    assert args.train_backend == "fsdp"  # one rule: fsdp unless --train-backend says otherwise


def test_what_the_scripts_flags_mean():
    a = parse_flags(SCRIPTS["qwen3_4b"])
    assert (a.num_layers, a.hidden_size, a.num_query_groups, a.kv_channels, a.qk_layernorm) == (36, 2560, 8, 128, True)
    assert (a.tensor_model_parallel_size, a.sequence_parallel, a.recompute_granularity) == (2, True, "full")
    assert (a.rm_type, a.ref_load, a.kl_loss_type, a.eps_clip_high) == ("deepscaler", "/root/Qwen3-4B_torch_dist",
                                                                       "low_var_kl", 0.28)
    assert a.sglang_args == {"mem_fraction_static": "0.7"} and a.attention_backend == "flash"
    a = parse_flags(SCRIPTS["qwen3_30b_a3b_moe"])
    assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_router_score_function) == (
        128, 8, 768, "softmax")
    assert moe_layers(a.moe_layer_freq, a.num_layers) == [1] * 48 and a.moe_grouped_gemm and a.optimizer_cpu_offload
    a = parse_flags(SCRIPTS["glm4_9b"])
    assert a.spec == ["slime_plugins.models.glm4", "get_glm_spec"] and a.rotary_percent == 0.5
    assert a.post_self_attn_layernorm and a.post_mlp_layernorm and a.add_qkv_bias
    a = parse_flags(SCRIPTS["qwen3_4b_base_sft"])
    assert a.loss_type == "sft_loss" and a.compute_advantages_and_returns is False
    a = parse_flags(SCRIPTS["qwen3_8b_opd"])
    assert a.use_opd and a.opd_type == "sglang"
    a = parse_flags(SCRIPTS["multi_task_eval"])
    assert a.eval_config.endswith("multi_task.yaml")
