"""FSDP2 trainer on CPU (gloo): DP equivalence, first-pass ratio, token-mean
aggregation, weight-sync bucketing (save/load and offload: test_fsdp_checkpoint.py)."""

import pytest
import torch

from slime.utils.net import free_port
from tests.helpers.training import (
    COMMON,
    TEMPERATURE,
    StubEngine,
    assert_states_close,
    deterministic,
    grads_after_train,
    initial_state,
    local_actor,
    make_args,
    synthetic_batch,
)


@pytest.fixture
def stub_engines():
    engines = [StubEngine(), StubEngine()]
    yield engines
    for e in engines:
        e.close()


# ---------------------------------------------------------------- (1) DP equivalence through TrainGroup


def test_two_ranks_match_one_rank(tiny_model_dir, tmp_path, ray_session, stub_engines):
    import ray

    from slime.ray.actor_group import TrainGroup

    batch = synthetic_batch(tiny_model_dir, 8)
    groups = {}  # started together so the workers' start-up overlaps
    try:
        for dp, mbs in ((2, 1), (1, 3)):
            # the two FSDP2-sharded ranks also recompute every layer in backward: the same numbers
            args = make_args(tiny_model_dir, tmp_path, *COMMON, "--actor-num-gpus-per-node", dp,
                             "--micro-batch-size", mbs, *(["--gradient-checkpointing"] if dp == 2 else []))
            groups[dp] = (args, TrainGroup(args))
        results = {}
        for dp, (args, group) in groups.items():
            group.init()
            refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
            metrics = group.train(0, refs)
            model_sd, _ = group.full_state(optimizer=False)
            if dp == 2:
                info = group.update_weights([e.url for e in stub_engines], weight_version=3)
            results[dp] = (metrics, model_sd)
    finally:
        for _, group in groups.values():
            group.shutdown()

    (m2, sd2), (m1, sd1) = results[2], results[1]
    assert set(m2) == set(m1)
    for k in deterministic(m1):  # timings and memory differ between layouts
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    assert m1["train/ppo_kl"] != 0  # step 2 ran on updated weights
    assert m1["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert m1["train/kl_loss"] > 0
    initial = initial_state(tiny_model_dir)
    moved = max((sd1[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3  # the two optimizer steps changed the weights
    assert_states_close(sd2, sd1, atol=1e-5)  # observed ~1e-6 after 2 AdamW steps at lr 1e-3

    # the 2-rank group pushed its (gathered) weights to both engines, each parameter once
    for engine in stub_engines:
        got = engine.received()
        assert set(got) == set(sd2) - {"lm_head.weight"}  # tied head travels as the embedding
        for k, v in got.items():
            assert torch.equal(v, sd2[k]), k
        assert [c[1]["flush_cache"] for c in engine.calls] == ["false"] * (len(engine.calls) - 1) + ["true"]
        assert all(c[1]["weight_version"] == "3" for c in engine.calls)
    assert info["buckets"] == len(stub_engines[0].calls)
    assert info["bytes"] == sum(v.numel() * v.element_size() for k, v in sd2.items() if k != "lm_head.weight")


# ---------------------------------------------------------------- (2) first pass has ratio 1


def test_single_step_first_pass_has_ratio_one(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 3, "--n-samples-per-prompt", 2,
                     "--micro-batch-size", 2, "--lr", 0.05, "--eps-clip", 0.01, "--eps-clip-high", 0.01)
    assert args.num_steps_per_rollout == 1
    actor = local_actor(args)
    try:
        batch = synthetic_batch(tiny_model_dir, 6, seed=1)
        m = actor.train(0, batch)
        assert m["train/pg_clipfrac"] == 0.0
        assert m["train/ppo_kl"] == 0.0
        assert m["train/train_rollout_logprob_abs_diff"] < 1e-3
        # the big lr moved the policy: a second pass on the same data now sees ratio != 1 ...
        # ... yet (one step per rollout) its old log-probs are again its own: still ratio 1
        m2 = actor.train(1, batch)
        assert m2["train/pg_clipfrac"] == 0.0 and m2["train/ppo_kl"] == 0.0
        assert m2["train/train_rollout_logprob_abs_diff"] > 1e-3
    finally:
        actor.shutdown()


# ---------------------------------------------------------------- (3) token-mean aggregation


def test_token_mean_is_independent_of_micro_batch_size(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    batch = synthetic_batch(tiny_model_dir, 6, seed=2)
    runs = {}
    for mbs in (1, 4, 6):
        args = make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 3, "--n-samples-per-prompt", 2,
                         "--micro-batch-size", mbs, "--clip-grad", 0)
        runs[mbs] = grads_after_train(args, batch)
    g1, m1 = runs[1]
    for mbs in (4, 6):
        g, m = runs[mbs]
        assert_states_close(g, g1, atol=1e-6, rtol=1e-5)
        assert m["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-5)
        assert m["train/pg_loss"] == pytest.approx(m1["train/pg_loss"], rel=1e-5, abs=1e-7)

    # and it is the token mean over the whole batch: grad of -sum(A * mask * logp) / sum(mask)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    total = sum(sum(m) for m in batch.loss_masks)
    loss = 0.0
    for toks, r, mask, a in zip(batch.tokens, batch.response_lengths, batch.loss_masks, batch.rewards):
        t = torch.tensor(toks)
        logits = model(t[None]).logits[0] / TEMPERATURE
        p = len(toks) - r
        lp = torch.log_softmax(logits, -1)[p - 1 : p - 1 + r].gather(-1, t[p:, None]).squeeze(-1)
        loss = loss + (-a * lp * torch.tensor(mask, dtype=torch.float32)).sum() / total
    loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    assert_states_close({k: g1[k] for k in ref}, ref, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------- (4) save / load


def test_rank_errors_name_the_rank(tiny_model_dir, tmp_path, ray_session):
    from slime.ray.actor_group import TrainGroup, TrainGroupError

    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--actor-num-gpus-per-node", 2)
    group = TrainGroup(args)
    try:
        with pytest.raises(TrainGroupError, match=r"actor rank \d: train failed"):
            group.train(0, [synthetic_batch(tiny_model_dir, 4)] * 2)  # init() not called
    finally:
        group.shutdown()


# ---------------------------------------------------------------- (5) weight-sync bucketing


@pytest.mark.parametrize("buffer", ["largest", "small"])
def test_weight_sync_buckets_send_every_parameter_once(tiny_model_dir, stub_engines, buffer):
    from safetensors.torch import load
    from transformers import AutoModelForCausalLM

    from slime.training.weight_sync import TensorTransport

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())  # deduplicated: the tied head is not listed
    assert "lm_head.weight" not in params
    sizes = {k: v.numel() * v.element_size() for k, v in params.items()}
    size = max(sizes.values()) if buffer == "largest" else 1000
    transport = TensorTransport(size, rank=0)
    transport.connect([e.url for e in stub_engines])
    info = transport.push(((k, v.detach()) for k, v in params.items()), 7)

    assert info["bytes"] == sum(sizes.values())
    for engine in stub_engines:
        got = engine.received()
        assert set(got) == set(params)
        for k, v in got.items():
            assert torch.equal(v, params[k].detach()), k
        assert len(engine.calls) == info["buckets"] > 1
        for i, (path, q, ctype, body) in enumerate(engine.calls):
            assert path == "/update_weights_from_tensor"
            assert ctype == "application/octet-stream"
            assert q == {"weight_version": "7", "flush_cache": "true" if i == len(engine.calls) - 1 else "false"}
            tensors = load(body)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            assert nbytes <= size or len(tensors) == 1
            if buffer == "largest":
                assert nbytes <= size
    if buffer == "small":  # every tensor is over the buffer: one bucket each
        assert info["buckets"] == len(params)
    else:  # buckets are packed: none could take the next tensor
        assert info["buckets"] < len(params)


def test_weight_sync_engine_failure_is_an_error(tiny_model_dir):
    from slime.engines.control import EngineError
    from slime.training.weight_sync import TensorTransport

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    transport = TensorTransport(1 << 20, rank=0, timeout=5)
    transport.connect([url])
    with pytest.raises(EngineError):
        transport.push([("w", torch.zeros(3))], 1)


# ---------------------------------------------------------------- (6) estimators and aggregation


def test_gspo_and_cispo_on_policy_equal_grpo_and_are_split_invariant(tiny_model_dir, tmp_path):
    """One step per rollout (ratio 1): GSPO's and CISPO's gradients are GRPO's, whatever the micro-batches;
    seq-mean-token-mean is also independent of the split."""
    batch = synthetic_batch(tiny_model_dir, 6, seed=5)
    common = ["--rollout-batch-size", 3, "--n-samples-per-prompt", 2, "--clip-grad", 0]
    runs = {}
    for est, mbs, agg in (("grpo", 6, "token-mean"), ("gspo", 1, "token-mean"), ("cispo", 4, "token-mean"),
                          ("gspo", 1, "seq-mean-token-mean"), ("gspo", 6, "seq-mean-token-mean")):
        args = make_args(tiny_model_dir, tmp_path, *common, "--advantage-estimator", est, "--micro-batch-size", mbs,
                         "--loss-agg-mode", agg)
        runs[est, mbs, agg] = grads_after_train(args, batch)
    ref, ref_m = runs["grpo", 6, "token-mean"]
    for key in (("gspo", 1, "token-mean"), ("cispo", 4, "token-mean")):
        g, m = runs[key]
        assert_states_close(g, ref, atol=1e-6, rtol=1e-5)
        assert m["train/grad_norm"] == pytest.approx(ref_m["train/grad_norm"], rel=1e-5)
    # GSPO's loss value is PPO's at ratio 1 (CISPO's is -A * log p: same gradient, other value)
    assert runs["gspo", 1, "token-mean"][1]["train/pg_loss"] == pytest.approx(ref_m["train/pg_loss"], rel=1e-5)
    a, _ = runs["gspo", 1, "seq-mean-token-mean"]
    b, _ = runs["gspo", 6, "seq-mean-token-mean"]
    assert_states_close(a, b, atol=1e-6, rtol=1e-5)
    assert max((a[k] - ref[k]).abs().max().item() for k in a) > 1e-6  # a different aggregation


NEW_CONFIGS = {
    "gspo_seq_mean_whiten": ["--advantage-estimator", "gspo", "--loss-agg-mode", "seq-mean-token-mean",
                             "--normalize-advantages"],
    "reinforce_pp_kl_reward": ["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", 0.05, "--gamma", 0.9,
                               "--normalize-advantages", "--eps-clip-c", 3.0],
}


@pytest.mark.parametrize("config", list(NEW_CONFIGS))
def test_new_estimators_two_ranks_match_one_rank(tiny_model_dir, tmp_path, ray_session, config):
    import ray

    from slime.ray.actor_group import TrainGroup

    batch = synthetic_batch(tiny_model_dir, 8, seed=6)
    groups = {}
    try:
        for dp, mbs in ((2, 1), (1, 3)):
            args = make_args(tiny_model_dir, tmp_path, *COMMON, *NEW_CONFIGS[config],
                             "--actor-num-gpus-per-node", dp, "--micro-batch-size", mbs)
            groups[dp] = (args, TrainGroup(args))
        results = {}
        for dp, (args, group) in groups.items():
            group.init()
            refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
            results[dp] = (group.train(0, refs), group.full_state(optimizer=False)[0])
    finally:
        for _, group in groups.values():
            group.shutdown()
    (m2, sd2), (m1, sd1) = results[2], results[1]
    assert set(m2) == set(m1)
    for k in deterministic(m1):  # timings and memory differ between layouts
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    assert m1["train/ppo_kl"] != 0
    assert_states_close(sd2, sd1, atol=1e-5)


# ---------------------------------------------------------------- (7) PPO critic


def test_critic_values_returns_and_value_loss(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 3, "--n-samples-per-prompt", 2,
                     "--micro-batch-size", 2, "--advantage-estimator", "ppo", "--lr", 1e-3, "--critic-lr", 1e-3,
                     "--gamma", 0.9, "--lambd", 0.8)
    assert args.use_critic
    batch = synthetic_batch(tiny_model_dir, 6, seed=7)
    critic = local_actor(args, role="critic")
    actor = local_actor(args)
    try:
        values = critic.compute_values(0, batch)
        assert [v.shape[0] for v in values] == batch.response_lengths
        # the value of response token t is the head's output at position t-1 (as for the log-probs)
        from transformers import AutoModelForTokenClassification

        head = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32)
        head.load_state_dict(critic.full_state(optimizer=False)[0])
        toks, r = batch.tokens[0], batch.response_lengths[0]
        with torch.no_grad():
            out = head(torch.tensor([toks])).logits[0, :, 0]
        torch.testing.assert_close(values[0], out[len(toks) - r - 1 : len(toks) - 1], atol=1e-5, rtol=1e-5)

        with pytest.raises(ValueError, match="needs critic values"):
            actor.train(0, batch)
        metrics = actor.train(0, batch, values)
        returns = actor.last_returns()
        from slime.algorithms.advantages import ppo

        adv = ppo(torch.tensor(batch.rewards), batch.response_lengths, values=values, gamma=0.9, lambd=0.8)
        for ret, a, v in zip(returns, adv, values):
            torch.testing.assert_close(ret, a + v)
        assert metrics["train/advantage_mean"] != 0

        losses = []
        for step in range(4):  # regress toward the same returns: the value loss falls
            critic.compute_values(step, batch)
            losses.append(critic.train_critic(step, batch, returns)["critic/value_loss"])
        assert losses[-1] < 0.5 * losses[0], losses
    finally:
        critic.shutdown()
        actor.shutdown()


def test_train_group_with_critic_trains_saves_and_loads_it(tiny_model_dir, tmp_path, ray_session):
    import ray

    from slime.ray.actor_group import TrainGroup

    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--advantage-estimator", "ppo", "--kl-coef", 0.01,
                     "--actor-num-gpus-per-node", 2, "--micro-batch-size", 2)
    batch = synthetic_batch(tiny_model_dir, 8, seed=8)
    refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
    group = TrainGroup(args, critic=TrainGroup(args, role="critic"))
    other = TrainGroup(args, critic=TrainGroup(args, role="critic"))
    try:
        group.init()
        other.init()
        metrics = group.train(0, refs)
        assert {"train/pg_loss", "critic/value_loss", "critic/value_clipfrac", "critic/grad_norm"} <= set(metrics)
        group.save(str(tmp_path / "ckpt"))
        assert (tmp_path / "ckpt" / "critic" / "hf" / "model.safetensors").is_file()
        other.load(str(tmp_path / "ckpt"))
        assert_states_close(other.critic.full_state(optimizer=False)[0], group.critic.full_state(optimizer=False)[0],
                            atol=0)
    finally:
        group.shutdown()
        other.shutdown()


def test_rng_states_round_trip():
    import random

    import numpy as np

    from slime.utils.checkpoint_data import rng_states, set_rng_states

    saved = rng_states()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_states(saved)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
