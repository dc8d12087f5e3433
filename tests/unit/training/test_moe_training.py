"""Mixture-of-experts training on the FSDP backend with a tiny random Qwen3-MoE: the trainer's
log-probs under rollout routing replay (R3) are those of a plain Hugging Face forward forced to the
same experts, the training forwards use exactly the given experts, routing replay (R2) replays the
old-policy forward's routing, the load-balancing loss reaches the routers, expert usage is logged,
and every MoE flag error is one line."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.training.backend import MicroBatch
from slime.utils.errors import SlimeConfigError
from slime.utils.moe_routing import RoutingHook
from tests.helpers.training import COMMON, TEMPERATURE, local_actor, make_args, synthetic_batch


def _hf_routing(model_dir, batch):
    """Each sample's experts in a plain HF forward ([T_i - 1, L * K], as the engine returns them)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hook = RoutingHook(model)
    out = []
    for toks in batch.tokens:
        with hook.recording() as rec:
            model(torch.tensor([toks]), use_cache=False)
        out.append(rec.indices()[:-1].reshape(len(toks) - 1, -1))
    return out


def _hf_forced_log_probs(model_dir, tokens, n_resp, routed):
    """Log-probs of the response tokens from a plain HF fp32 forward forced to `routed` ([T - 1, L*K])."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hook = RoutingHook(model)
    rows = torch.cat([routed, torch.full((1, routed.shape[1]), -1, dtype=torch.int32)]).reshape(
        len(tokens), hook.num_layers, hook.top_k)
    with torch.no_grad(), hook.replaying(rows):
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0].float() / TEMPERATURE
    p = len(tokens) - n_resp
    return torch.log_softmax(logits, -1)[p - 1: p - 1 + n_resp].gather(-1, torch.tensor(tokens[p:])[:, None])[:, 0]


@pytest.mark.parametrize("packed", [True, False])
def test_rollout_routing_replay_forces_the_engines_experts(tiny_moe_model_dir, tmp_path, packed):
    flags = [*COMMON, "--use-rollout-routing-replay", *([] if packed else ["--disable-sequence-packing"])]
    args = make_args(tiny_moe_model_dir, tmp_path, *flags)
    batch = synthetic_batch(tiny_moe_model_dir, 8)
    own = _hf_routing(tiny_moe_model_dir, batch)
    # the "engine" routed every token to other experts than the trainer would pick: (e + 1) mod E
    batch.routed_experts = [(r + 1) % 4 for r in own]
    actor = local_actor(args)
    try:
        be = actor.backend
        idx = [0, 1, 2]
        mb = actor._mb(batch, idx)
        assert mb.routed_experts is not None and len(mb.routed_experts) == 3
        lp, _ = be.forward_logprobs(mb)
        # the forward used exactly the engine's experts for every token that has them
        used = be.routing.recorded_per_sample(be.last_routing, *be.routing_layout(mb))
        for i, u in zip(idx, used):
            assert torch.equal(u.reshape(u.shape[0], -1), batch.routed_experts[i])
        expect = torch.cat([_hf_forced_log_probs(tiny_moe_model_dir, batch.tokens[i], batch.response_lengths[i],
                                                 batch.routed_experts[i]) for i in idx])
        assert torch.allclose(lp.cpu(), expect, atol=1e-5)
        # without replay the log-probs are the model's own, and they differ
        plain, _ = be.forward_logprobs(MicroBatch(mb.tokens, mb.response_lengths))
        assert (plain.cpu() - expect).abs().max() > 1e-3
        metrics = actor.train(0, batch)
    finally:
        actor.shutdown()
    for layer in range(2):
        assert 1.0 <= metrics[f"train/moe/layer_{layer}/max_load"] <= 4.0
        assert metrics[f"train/moe/layer_{layer}/experts_used"] == 4.0


def test_routing_replay_replays_the_old_policys_routing(tiny_moe_model_dir, tmp_path):
    args = make_args(tiny_moe_model_dir, tmp_path, *COMMON, "--use-routing-replay")
    batch = synthetic_batch(tiny_moe_model_dir, 8)
    actor = local_actor(args)
    try:
        seen = []
        be = actor.backend
        forward = be.forward_logprobs

        def spy(mb, **kw):
            seen.append((kw.get("grad", False), mb.routed_experts))
            return forward(mb, **kw)

        be.forward_logprobs = spy
        actor.train(0, batch)
    finally:
        actor.shutdown()
    own = _hf_routing(tiny_moe_model_dir, batch)
    recorded = actor._recorded_routing
    # the old-policy pass (no replay) recorded the initial model's experts of every sample ...
    assert all(torch.equal(r.reshape(r.shape[0], -1), o) for r, o in zip(recorded, own))
    assert any(not grad and routed is None for grad, routed in seen)
    # ... and every training forward (two optimizer steps) replayed them
    train_calls = [routed for grad, routed in seen if grad]
    assert train_calls and all(routed is not None for routed in train_calls)


def test_load_balancing_loss_reaches_the_routers(tiny_moe_model_dir, tmp_path):
    batch = synthetic_batch(tiny_moe_model_dir, 8)
    grads = {}
    for coef in (0.0, 1.0):
        (tmp_path / str(coef)).mkdir()
        actor = local_actor(make_args(tiny_moe_model_dir, tmp_path / str(coef), *COMMON, "--moe-aux-loss-coeff", coef))
        try:
            be = actor.backend
            mbs = [actor._mb(batch, [0, 1, 2, 3])]
            def step(*a, _coef=coef, **k):  # keep the weights: only the gradients are compared
                grads[_coef] = {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None}

            be.optimizer.step = step
            be.train_step(mbs, lambda k, lp, ent: 0.0 * lp.sum())
        finally:
            actor.shutdown()
    router = [n for n in grads[1.0] if n.endswith("mlp.gate.weight")]
    assert len(router) == 2 and all(grads[1.0][n].abs().sum() > 0 for n in router)
    assert all(grads[0.0][n].abs().sum() == 0 for n in router)  # a zero policy loss: only the aux loss moves them


@pytest.mark.parametrize("flags, message", [
    (["--use-routing-replay", "--use-rollout-routing-replay"], "both decide the trainer's experts; give one"),
    (["--use-rollout-routing-replay", "--rollout-backend", "vllm"], "--rollout-backend vllm does not return the "
                                                                    "routed experts; use native or sglang"),
    (["--use-routing-replay", "--recompute-granularity", "full"], "routing replay under activation recompute is "
                                                                  "not built"),
    (["--moe-aux-loss-coeff", -1], "--moe-aux-loss-coeff must be >= 0"),
    (["--moe-aux-loss-coeff", 0.01, "--recompute-granularity", "full", "--train-backend", "megatron"],
     "--moe-aux-loss-coeff 0.01 with --recompute-granularity full on --train-backend megatron: megatron's "
     "recompute records the router logits without gradients"),
])
def test_moe_flag_errors(tiny_moe_model_dir, tmp_path, flags, message, monkeypatch):
    venv = tmp_path / "vllm_venv"  # parsing --rollout-backend vllm looks for vLLM's venv first
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv("SLIME_VLLM_VENV", str(venv))
    with pytest.raises(SlimeConfigError, match=message):
        make_args(tiny_moe_model_dir, tmp_path, *flags)


def test_moe_flags_need_a_moe_model(tiny_model_dir, tmp_path):
    with pytest.raises(SlimeConfigError, match=r"^--use-rollout-routing-replay needs a mixture-of-experts model; "
                                               r"--hf-checkpoint .* declares no experts"):
        make_args(tiny_model_dir, tmp_path, "--use-rollout-routing-replay")


def test_rollout_routing_replay_on_two_data_parallel_ranks(tiny_moe_model_dir, tmp_path, ray_session):
    """R3 on two FSDP ranks (gloo), the samples dealt by --balance-data (not contiguous): every rank's
    forwards use its own samples' engine experts. The rollout log-probs are a HF forward forced to
    those experts, so the trainer's pre-update log-probs (over both ranks' tokens) equal them."""
    import ray

    from slime.ray.actor_group import TrainGroup

    args = make_args(tiny_moe_model_dir, tmp_path, *COMMON, "--use-rollout-routing-replay", "--balance-data",
                     "--actor-num-gpus-per-node", 2, "--micro-batch-size", 2)
    batch = synthetic_batch(tiny_moe_model_dir, 8, seed=9)
    batch.routed_experts = [(r + 1) % 4 for r in _hf_routing(tiny_moe_model_dir, batch)]  # not the trainer's own
    forced = [_hf_forced_log_probs(tiny_moe_model_dir, t, n, r)
              for t, n, r in zip(batch.tokens, batch.response_lengths, batch.routed_experts)]
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir, dtype=torch.float32)
    with torch.no_grad():  # the model's own routing scores these tokens differently
        own = [torch.log_softmax(model(torch.tensor([t])).logits[0] / TEMPERATURE, -1)[len(t) - n - 1:-1]
               .gather(-1, torch.tensor(t[len(t) - n:])[:, None])[:, 0] for t, n in zip(batch.tokens,
                                                                                       batch.response_lengths)]
    assert torch.cat(own).sub(torch.cat(forced)).abs().mean() > 1e-3
    batch.rollout_log_probs = [lp.tolist() for lp in forced]
    parts = batch.split_for_ranks(args.dp_size, args.global_batch_size, balance=True)
    assert sorted(i for idx in batch.rank_indices(2, args.global_batch_size, True) for i in idx) == list(range(8))
    assert batch.rank_indices(2, args.global_batch_size, True)[0] != [0, 1, 4, 5]  # dealt, not sliced
    group = TrainGroup(args)
    try:
        group.init()
        metrics = group.train(0, [ray.put(p) for p in parts])
    finally:
        group.shutdown()
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
    for layer in range(2):
        assert metrics[f"train/moe/layer_{layer}/experts_used"] == 4.0
