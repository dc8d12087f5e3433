"""LoRA on the FSDP trainer (slime.training.lora): only the adapter trains, the KL reference is the
base with the adapter switched off, merged weights equal peft's merge, checkpoints are peft adapters
that resume exactly (on one and on two sharded ranks), and bad LoRA flags get one clear line."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from slime.training.backend import MicroBatch
from slime.utils.errors import SlimeConfigError
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.training import (
    COMMON, assert_states_close, deterministic, flatten_optim, local_actor, make_args, synthetic_batch,
)

ROOT = Path(__file__).resolve().parents[3]
LORA = ["--lora-rank", 4, "--lora-alpha", 8]
TOKENS = [[5, 9, 11, 3, 7, 2], [4, 8, 15, 16, 23, 42, 1]]
LENGTHS = [3, 4]


def _hf_log_probs(model, temperature):
    out = []
    for toks, r in zip(TOKENS, LENGTHS):
        ids = torch.tensor(toks)[None]
        with torch.no_grad():
            logits = model(ids).logits[0].float() / temperature
        p = len(toks) - r
        out.append(torch.log_softmax(logits, -1)[p - 1 : p - 1 + r].gather(-1, ids[0, p:, None]).squeeze(-1))
    return torch.cat(out)


def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, *COMMON, *LORA)
    actor = local_actor(args)
    try:
        be = actor.backend
        assert be.ref_model is None  # no second copy of the base
        trainable = [n for n, p in be.model.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
        assert sum(len(g["params"]) for g in be.optimizer.param_groups) == len(trainable)
        base_before = dict(be.base_weights())
        assert_states_close(dict(be.named_weights()), base_before, atol=0)  # B = 0 at the start

        metrics = actor.train(0, synthetic_batch(tiny_model_dir, 8, seed=1))
        assert metrics["train/grad_norm"] > 0
        assert_states_close(dict(be.base_weights()), base_before, atol=0)  # frozen

        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        want = _hf_log_probs(base, args.rollout_temperature)
        ref, _ = be.forward_logprobs(MicroBatch(TOKENS, LENGTHS), ref=True)
        policy, _ = be.forward_logprobs(MicroBatch(TOKENS, LENGTHS))
        torch.testing.assert_close(ref, want, atol=1e-6, rtol=0)  # the adapter switched off = the base
        assert (policy - want).abs().max() > 1e-4  # the trained adapter changed the policy

        # the merged weights are peft's merge of the same adapter, by Hugging Face name
        merged = dict(be.named_weights())
        expect = copy.deepcopy(be.model).merge_and_unload().state_dict()
        assert set(merged) == {n for n, _ in base.named_parameters()}
        assert_states_close(merged, {k: expect[k] for k in merged}, atol=1e-6)
        assert any((merged[k] - base_before[k]).abs().max() > 0 for k in merged)
    finally:
        actor.shutdown()


def test_adapter_checkpoint_loads_with_peft_and_resumes_exactly(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, *COMMON, *LORA, "--micro-batch-size", 2)
    batch = synthetic_batch(tiny_model_dir, 8, seed=2)
    a, b = local_actor(args), local_actor(args)
    ckpt = tmp_path / "ckpt"
    try:
        a.train(0, batch)
        a.save(str(ckpt))
        assert not (ckpt / "hf").exists()  # the base is --hf-checkpoint; the checkpoint holds the adapter
        config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"

        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                                    dtype=torch.float32),
                                               str(ckpt / "adapter"))
        ours, _ = a.backend.forward_logprobs(MicroBatch(TOKENS, LENGTHS))
        torch.testing.assert_close(_hf_log_probs(peft_model, args.rollout_temperature), ours, atol=1e-6, rtol=0)

        # tools/convert_to_hf.py writes the base with the adapter merged in
        out = tmp_path / "merged_hf"
        (ckpt / "meta.json").write_text('{"rollout_id": 0}')  # what slime.checkpoint.save adds
        subprocess.run([sys.executable, str(ROOT / "tools" / "convert_to_hf.py"), "--input-dir", str(tmp_path / "ckpt"),
                        "--output-dir", str(out)], check=True, capture_output=True)
        merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        torch.testing.assert_close(_hf_log_probs(merged, args.rollout_temperature), ours, atol=1e-5, rtol=0)

        b.load(str(ckpt))
        sa, oa = a.full_state()
        sb, ob = b.full_state()
        assert_states_close(sb, sa, atol=0)
        assert_states_close(flatten_optim(ob), flatten_optim(oa), atol=0)
        assert deterministic(a.train(1, batch)) == deterministic(b.train(1, batch))  # exact resume
        assert_states_close(dict(b.backend.adapter_weights()), dict(a.backend.adapter_weights()), atol=0)
    finally:
        a.shutdown()
        b.shutdown()


def test_two_sharded_ranks_train_the_adapter_like_one(tiny_model_dir, tmp_path, ray_session):
    """FSDP2 over base and adapter: two ranks give the single rank's adapter after a step, and a
    checkpoint of one loads into the other."""
    import ray

    from slime.ray.actor_group import TrainGroup

    extra = [*COMMON, *LORA, "--micro-batch-size", 2]
    batch = synthetic_batch(tiny_model_dir, 8, seed=5)
    one = local_actor(make_args(tiny_model_dir, tmp_path, *extra))
    args2 = make_args(tiny_model_dir, tmp_path, *extra, "--actor-num-gpus-per-node", 2)
    two = TrainGroup(args2)
    try:
        two.init()
        m1 = one.train(0, batch)
        m2 = two.train(0, [ray.put(x) for x in batch.split_for_ranks(2, args2.global_batch_size)])
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=1e-5)
        one.save(str(tmp_path / "from_one"))
        two.load(str(tmp_path / "from_one"))
        s1, _ = one.full_state(optimizer=False)
        s2, _ = two.full_state(optimizer=False)
        assert_states_close(s2, s1, atol=0)
    finally:
        one.shutdown()
        two.shutdown()


def _flags(tiny_model_dir, tmp_path, *extra):
    return make_args(tiny_model_dir, tmp_path, *extra)


def test_bad_lora_flags_get_one_line_each(tiny_model_dir, tmp_path):
    with pytest.raises(SlimeConfigError, match=r"--lora-rank must be >= 1 .*got 0"):
        _flags(tiny_model_dir, tmp_path, "--lora-rank", 0)
    with pytest.raises(SlimeConfigError, match=r"--target-modules qkv_proj: no linear layer .* its linear layers "
                                               r"are down_proj gate_proj k_proj o_proj q_proj up_proj v_proj"):
        _flags(tiny_model_dir, tmp_path, "--lora-rank", 4, "--target-modules", "q_proj", "qkv_proj")
    with pytest.raises(SlimeConfigError, match=r"--lora-alpha needs --lora-rank"):
        _flags(tiny_model_dir, tmp_path, "--lora-alpha", 16)
    with pytest.raises(SlimeConfigError, match=r"--lora-rank: LoRA is built on the fsdp backend"):
        _flags(tiny_model_dir, tmp_path, "--lora-rank", 4, "--train-backend", "megatron")
    with pytest.raises(SlimeConfigError, match=r"--ref-load .* the base with the adapter switched off"):
        _flags(tiny_model_dir, tmp_path, "--lora-rank", 4, "--use-kl-loss", "--ref-load", tiny_model_dir)


def test_an_adapter_of_another_base_model_is_refused(tiny_model_dir, tmp_path):
    other_dir = build_tiny_model(tmp_path / "other", seed=0, hidden_size=48)
    other = get_peft_model(AutoModelForCausalLM.from_pretrained(other_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    other.save_pretrained(tmp_path / "adapter")
    with pytest.raises(SlimeConfigError, match=r"--lora-adapter-path .*q_proj.lora_A.weight has shape \[4, 48\], "
                                               r"but --hf-checkpoint .* needs \[4, \d+\] \(the adapter was trained "
                                               r"on .*other"):
        _flags(tiny_model_dir, tmp_path, "--lora-adapter-path", tmp_path / "adapter")
    with pytest.raises(SlimeConfigError, match=r"--lora-rank 8 differs from the adapter's 4"):
        _flags(tiny_model_dir, tmp_path, "--lora-adapter-path", tmp_path / "adapter", "--lora-rank", 8)
    with pytest.raises(SlimeConfigError, match=r"--lora-adapter-path .*: no adapter_config.json"):
        _flags(tiny_model_dir, tmp_path, "--lora-adapter-path", tmp_path)


def test_training_starts_from_a_given_adapter(tiny_model_dir, tmp_path):
    start = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in start.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    start.save_pretrained(tmp_path / "adapter")
    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--lora-adapter-path", tmp_path / "adapter")
    assert (args.lora_rank, args.lora_alpha, args.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    actor = local_actor(args)
    try:
        ours, _ = actor.backend.forward_logprobs(MicroBatch(TOKENS, LENGTHS))
        torch.testing.assert_close(ours, _hf_log_probs(start, args.rollout_temperature), atol=1e-6, rtol=0)
        assert all(p.requires_grad == (".lora_" in n) for n, p in actor.backend.model.named_parameters())
    finally:
        actor.shutdown()


def test_lora_dropout_acts_in_the_training_forward_only(tiny_model_dir, tmp_path):
    from peft.tuners.lora import LoraLayer

    args = make_args(tiny_model_dir, tmp_path, *COMMON, *LORA, "--lora-dropout", 0.5)
    actor = local_actor(args)
    try:
        drops = [d for m in actor.backend.model.modules() if isinstance(m, LoraLayer) for d in m.lora_dropout.values()]
        assert drops and all(d.p == 0.5 for d in drops)
        seen = []
        hook = drops[0].register_forward_hook(lambda mod, inp, out: seen.append(mod.training))
        actor.train(0, synthetic_batch(tiny_model_dir, 8, seed=1))
        hook.remove()
        assert seen and all(seen)  # on in the training forward (the reference forward skips the adapter)
        assert not any(d.training for d in drops)  # and off again afterwards
        a, _ = actor.backend.forward_logprobs(MicroBatch(TOKENS, LENGTHS))
        b, _ = actor.backend.forward_logprobs(MicroBatch(TOKENS, LENGTHS))
        assert torch.equal(a, b)
    finally:
        actor.shutdown()


def test_bf16_keeps_the_frozen_base_in_bf16_and_trains_fp32_adapters(tiny_model_dir, tmp_path):
    batch = synthetic_batch(tiny_model_dir, 8, seed=1)
    runs = {}
    for name, extra in (("fp32", ()), ("bf16", ("--bf16",))):
        actor = local_actor(make_args(tiny_model_dir, tmp_path, *COMMON, *LORA, *extra))
        try:
            dtypes = {n: p.dtype for n, p in actor.backend.model.named_parameters()}
            runs[name] = (dtypes, actor.train(0, batch), dict(actor.backend.adapter_weights()))
        finally:
            actor.shutdown()
    dtypes, metrics, adapter = runs["bf16"]
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    assert set(runs["fp32"][0].values()) == {torch.float32}
    assert metrics["train/loss"] == pytest.approx(runs["fp32"][1]["train/loss"], abs=2e-2)
    for k, v in adapter.items():  # the same step, within bf16 rounding of the forward
        assert v.dtype == torch.float32
        torch.testing.assert_close(v, runs["fp32"][2][k], atol=5e-3, rtol=0)
