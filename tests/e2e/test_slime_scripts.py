"""A slime launch script's shape on the tiny model: a preset-shaped MODEL_ARGS (the tiny model's own
architecture in Megatron's flags) plus the Megatron-LM flags slime's scripts carry starts on CPU and trains
exactly like the same run without them (they agree with the checkpoint, so they change nothing)."""

import pytest

from tests.helpers.e2e import REFERENCE_FLAGS, comparable, records, run, shape_cmd

pytestmark = pytest.mark.e2e

# scripts/models/*.sh in the tiny model's shape (slime.utils.tiny_model: Llama, 2 layers, 2 heads over 1 kv head)
TINY_MODEL_ARGS = ["--swiglu", "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256",
                   "--num-attention-heads", "2", "--group-query-attention", "--num-query-groups", "1",
                   "--kv-channels", "64", "--use-rotary-position-embeddings", "--disable-bias-linear",
                   "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "10000"]
# the MISC_ARGS / PERF_ARGS / OPTIMIZER_ARGS of slime's run-qwen3-4B.sh that hold on CPU
SCRIPT_ARGS = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
               "--attention-softmax-in-fp32", "--optimizer", "adam", "--expert-model-parallel-size", "1",
               "--expert-tensor-parallel-size", "1", "--calculate-per-token-loss", "--no-rope-fusion",
               "--sglang-cuda-graph-bs", "1", "2", "4"]


def test_a_preset_shaped_run_trains_like_the_plain_run(task, reference_run, tmp_path):
    out = tmp_path / "out"
    proc = run(shape_cmd(task, out, *REFERENCE_FLAGS, *TINY_MODEL_ARGS, *SCRIPT_ARGS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "--accumulate-allreduce-grads-in-fp32: gradients are accumulated and reduced in fp32" in said
    got, expected = comparable(records(out)), comparable(records(reference_run["out"]))
    assert sorted(got) == [0, 1, 2, 3] and got == expected
    assert any(r["train/grad_norm"] > 0 for r in got.values())
