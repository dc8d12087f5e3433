"""slime's launch-script flags: Megatron architecture flags checked against the checkpoint, the other
Megatron-LM / slime flags routed, checked or refused at start-up, pass-through lists, suggestions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slime.arguments import build_parser, parse_flags
from slime.engines.passthrough import PassThrough, RaisingParser, option_table
from slime.model_flags import moe_layers
from slime.utils.errors import SlimeConfigError
from slime.utils.flag_parsing import known_flags, similar_flag
from tests.helpers.args import make_args

# the tiny test model (slime.utils.tiny_model) in a preset's shape: Llama, 2 layers, 128 wide, 2 heads over 1
# key/value head of 64, SwiGLU 256, RMSNorm 1e-6, RoPE 10000, tied embeddings
TINY_PRESET = ["--swiglu", "--num-layers", 2, "--hidden-size", 128, "--ffn-hidden-size", 256,
               "--num-attention-heads", 2, "--group-query-attention", "--num-query-groups", 1, "--kv-channels", 64,
               "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
               "--norm-epsilon", 1e-6, "--rotary-base", 10000, "--position-embedding-type", "rope"]


def _vocab(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def test_a_preset_shaped_argument_list_matching_the_checkpoint_validates(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, *TINY_PRESET, "--vocab-size", _vocab(tiny_model_dir))
    assert (args.num_layers, args.kv_channels, args.swiglu, args.attn_implementation) == (2, 64, True, "sdpa")


@pytest.mark.parametrize("flags, message", [
    (["--num-layers", 3], r"^--num-layers 3 does not match the checkpoint's config.json \(model_type 'llama'\): it has 2$"),
    (["--rotary-base", 1e6], "--rotary-base 1000000.0 does not match .* it has 10000.0"),
    (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights .set. does not match"),
    (["--qk-layernorm"], "--qk-layernorm"),
    (["--add-qkv-bias"], "--add-qkv-bias"),
    (["--num-experts", 8], "--num-experts 8 does not match .* it has 0"),
    (["--spec", "slime_plugins.models.glm4", "get_glm_spec"], "--spec slime_plugins.models.glm4 builds glm4 models, "
                                                             "but .* is 'llama'"),
    (["--spec", "my.spec"], "--spec my.spec: unknown layer spec"),
    (["--multi-latent-attention", "--kv-lora-rank", 512], "--multi-latent-attention .set. does not match"),
    (["--q-lora-rank", 64], "--q-lora-rank 64: slime cannot read this from .* so it cannot be checked"),
    (["--model-name", "qwen3"], "--model-name qwen3: .* is a 'llama' model"),
])
def test_an_architecture_flag_the_checkpoint_contradicts_is_one_line_naming_it(tiny_model_dir, tmp_path, flags,
                                                                                 message):
    with pytest.raises(SlimeConfigError, match=message) as e:
        make_args(tiny_model_dir, tmp_path, *TINY_PRESET, *flags)
    assert "\n" not in str(e.value)


def test_several_mismatches_are_one_line_that_names_them_all(tiny_model_dir, tmp_path):
    with pytest.raises(SlimeConfigError, match=r"--num-layers 3 .* \(and 1 more: --hidden-size 64 .*it has 128\)"):
        make_args(tiny_model_dir, tmp_path, *TINY_PRESET, "--num-layers", 3, "--hidden-size", 64)


def test_moe_layer_freq_is_an_int_or_a_safe_list_expression():
    assert moe_layers(1, 3) == [1, 1, 1]
    assert moe_layers("2", 4) == [1, 0, 1, 0]
    assert moe_layers("[0]*1+[1]*3", 4) == [0, 1, 1, 1]
    assert moe_layers("[0,1, 1]", 3) == [0, 1, 1]
    with pytest.raises(ValueError, match="only"):
        moe_layers("__import__('os').system('true')", 3)
    with pytest.raises(ValueError, match="0 or 1"):
        moe_layers("[2]*3", 3)


@pytest.mark.parametrize("flags, message", [
    (["--attention-dropout", 0.1], r"^--attention-dropout 0.1: slime trains without dropout"),
    (["--use-opd", "--opd-type", "sglang"], "--opd-teacher-model teacher: --opd-type sglang needs a frozen served model"),
    (["--fp8-format", "e4m3"], "--fp8-format e4m3: fp8 training needs Transformer Engine"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine: Transformer Engine is not"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm: applies to mixture-of-experts models only"),
    (["--expert-model-parallel-size", 2], "--expert-model-parallel-size 2: expert parallelism needs a mixture"),
    (["--calculate-per-token-loss", "--loss-agg-mode", "seq-mean-token-mean"], "--calculate-per-token-loss: is "
                                                                               "--loss-agg-mode token-mean"),
    (["--optimizer", "sgd"], "--optimizer sgd: only adam"),
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer: megatron's precision-aware optimizer"),
    (["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d: needs --optimizer-cpu-offload"),
    (["--deterministic-mode", "--train-backend", "megatron"], "--deterministic-mode: deterministic trainer "
                                                              "reductions are built for --train-backend fsdp"),
    (["--eval-config", "multi_task.yaml"], "--eval-config: file multi_task.yaml does not exist"),
    (["--disable-compute-advantages-and-returns"], "--disable-compute-advantages-and-returns: is for --loss-type sft"),
    (["--update-weight-mode", "delta"], "--update-weight-mode delta: delta weight updates"),
    (["--decoder-last-pipeline-num-layers", 1], "needs --pipeline-model-parallel-size > 1"),
    (["--rollout-max-context-len", 100000], "--rollout-max-context-len 100000 is above the model's "
                                            "max_position_embeddings 512"),
])
def test_script_flags_this_build_cannot_honour_are_refused_at_start_up_naming_the_flag(tiny_model_dir, tmp_path,
                                                                                       flags, message):
    parse_flags(["--hf-checkpoint", "x", "--rollout-batch-size", "1", *map(str, flags)])  # parsing accepts them
    with pytest.raises(SlimeConfigError, match=message):
        make_args(tiny_model_dir, tmp_path, *flags)


def test_script_flags_that_hold_or_take_effect(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
                     "--attention-dropout", 0.0, "--hidden-dropout", 0.0, "--attention-backend", "unfused",
                     "--no-rope-fusion", "--calculate-per-token-loss", "--optimizer", "adam",
                     "--use-distributed-optimizer", "--rollout-max-context-len", 256, "--wandb-team", "t")
    assert args.attn_implementation == "eager" and args.rollout_max_context_len == 256
    said = "\n".join(args.start_up_notes)
    assert "--accumulate-allreduce-grads-in-fp32: gradients are accumulated and reduced in fp32" in said
    assert "--no-rope-fusion: neither backend fuses RoPE" in said
    assert "--use-distributed-optimizer: with fsdp the optimizer state is sharded" in said
    with pytest.raises(SlimeConfigError, match="--attention-backend flash: flash needs a CUDA device"):
        make_args(tiny_model_dir, tmp_path, "--attention-backend", "flash")
    args = make_args(tiny_model_dir, tmp_path, "--train-backend", "megatron", "--use-distributed-optimizer")
    assert args.use_distributed_optimizer
    assert any("with megatron each data-parallel rank keeps" in note for note in args.start_up_notes)


def test_megatron_layout_on_fsdp_passes_when_it_splits_the_model(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 2}))
    args = make_args(model, tmp_path, "--tensor-model-parallel-size", 2, "--sequence-parallel",
                     "--actor-num-gpus-per-node", 2, "--rollout-batch-size", 2)
    assert args.train_backend == "fsdp" and args.tensor_model_parallel_size == 2
    assert "FSDP shards every parameter, gradient and optimizer state over all 2 train ranks" in args.start_up_notes[0]


def test_pass_through_flags_take_lists_where_the_server_flag_does():
    args = parse_flags(["--hf-checkpoint", "x", "--rollout-batch-size", "1", "--sglang-cuda-graph-bs", "1", "2", "4",
                        "8", "--sglang-mem-fraction-static", "0.7", "--sglang-enable-metrics"])
    assert args.sglang_args == {"cuda_graph_bs": ["1", "2", "4", "8"], "mem_fraction_static": "0.7",
                                "enable_metrics": True}
    server = RaisingParser()
    server.add_argument("--cuda-graph-bs", type=int, nargs="+")
    server.add_argument("--mem-fraction-static", type=float)
    server.add_argument("--enable-metrics", action="store_true")
    rule = PassThrough("--sglang-", "SGLang", options=option_table(server))
    argv, _ = rule.forward(args.sglang_args)
    assert argv == ["--cuda-graph-bs", "1", "2", "4", "8", "--mem-fraction-static", "0.7", "--enable-metrics"]
    with pytest.raises(SlimeConfigError, match=r"^--sglang-mem-fraction-static takes one value, got 2: 0.7 0.8$"):
        rule.forward({"mem_fraction_static": ["0.7", "0.8"]})


def test_every_parse_error_names_its_flag():
    base = ["--hf-checkpoint", "x", "--rollout-batch-size", "1"]
    with pytest.raises(SlimeConfigError, match=r"^--num-rollout: unexpected extra value '9'$"):
        parse_flags([*base, "--num-rollout", "8", "9"])
    with pytest.raises(SlimeConfigError, match=r"^--num-rollout: unexpected extra value '9'$"):  # not --seed's 9
        parse_flags([*base, "--seed", "9", "--num-rollout", "8", "9"])
    with pytest.raises(SlimeConfigError, match="--num-layers: invalid int value"):
        parse_flags([*base, "--num-layers", "many"])


@pytest.mark.parametrize("typo, suggestion", [
    ("--rollout-batchsize", "--rollout-batch-size"),
    ("--num-layer", "--num-layers"),
    ("--lr-warmup-iter", "--lr-warmup-iters"),
    ("--tensor-parallel-size", "--tensor-model-parallel-size"),
    ("--spek", None),  # not --seed: a suggestion must mean something similar
    ("--rollout-thing", None),
])
def test_suggestions_only_for_flags_of_similar_meaning(typo, suggestion):
    assert similar_flag(typo, known_flags(build_parser())) == suggestion
    with pytest.raises(SlimeConfigError, match=f"unknown flag {typo}" + (f" \\(did you mean {suggestion}\\?\\)$"
                                                                      if suggestion else "$")):
        parse_flags(["--hf-checkpoint", "x", "--rollout-batch-size", "1", typo])


def test_an_argparse_error_names_the_flag():
    # argparse's own messages ("argument --x: ...") keep the flag name
    with pytest.raises(SlimeConfigError, match="argument --normalization: invalid choice"):
        parse_flags(["--hf-checkpoint", "x", "--rollout-batch-size", "1", "--normalization", "BatchNorm"])


def test_slimes_sft_rollout_path_needs_the_sft_loss_at_start_up(tiny_model_dir, tmp_path):
    with pytest.raises(SlimeConfigError, match="^--rollout-function-path slime.rollout.sft_rollout.generate_rollout: "
                                               "SFT here is --loss-type sft_loss; add it$"):
        make_args(tiny_model_dir, tmp_path, "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout")
