"""One conformance suite over both train backends (`--train-backend fsdp | megatron`, the
registry `slime.training.actor.BACKENDS`): each implements the `TrainBackend` contract
(slime/training/backend.py); on the same tiny batch each gives the Hugging Face model's log-probs and
entropy (policy and reference), serves exactly the Hugging Face weights; and a training step of any
other backend equals the FSDP backend's (the reference): gradients at every step, metrics and the
updated weights. megatron-core is a test dependency (skipped where it is missing)."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slime.training.actor import BACKENDS
from slime.training.backend import MicroBatch, TrainBackend
from slime.training.fsdp.backend import FSDPBackend
from slime.training.lr_schedule import LRSchedule
from slime.utils.errors import SlimeConfigError
from tests.helpers.training import (
    COMMON, TEMPERATURE, assert_states_close, deterministic, grads_after_train, local_actor, make_args,
    synthetic_batch,
)

BATCH = ["--rollout-batch-size", 4, "--n-samples-per-prompt", 2]
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
needs_megatron = pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed")
KINDS = ["fsdp", pytest.param("megatron", marks=needs_megatron)]


def backend_class(name: str):
    if name == "fsdp":
        return FSDPBackend
    from slime.training.megatron.backend import MegatronBackend  # optional dependency: only when installed

    return MegatronBackend


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_the_registry_names_every_backend():
    assert set(BACKENDS) == {"fsdp", "megatron"}


@pytest.mark.parametrize("name", KINDS)
def test_backend_implements_the_contract(name):
    cls = backend_class(name)
    for method, spec in inspect.getmembers(TrainBackend, inspect.isfunction):
        if method.startswith("_"):
            continue
        impl = getattr(cls, method, None)
        assert callable(impl), f"{cls.__name__} has no {method}"
        want = list(inspect.signature(spec).parameters)
        have = list(inspect.signature(impl).parameters)
        assert have == want, f"{cls.__name__}.{method}{have} is not the contract's {want}"
    assert isinstance(inspect.getattr_static(cls, "lr"), property)


@pytest.mark.parametrize("name", KINDS)
def test_log_probs_entropy_and_weights_match_hugging_face(name, tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, *BATCH, "--train-backend", name, "--use-kl-loss",
                     "--kl-loss-coef", 0.1)
    batch = synthetic_batch(tiny_model_dir, 6, seed=11)
    actor = local_actor(args)
    try:
        be = actor.backend
        assert name != "fsdp" or be.hidden_head  # FSDP: log-probs from the hidden states, chunked head
        expected = torch.tensor([x for lp in batch.rollout_log_probs for x in lp])  # plain HF forward
        mb = MicroBatch(batch.tokens, batch.response_lengths)
        lp, ent = be.forward_logprobs(mb, with_entropy=True)
        ref_lp, _ = be.forward_logprobs(mb, ref=True)
        assert lp.shape == expected.shape
        assert (lp - expected).abs().max().item() < 1e-5
        assert torch.equal(ref_lp, lp)  # the reference model starts from the same weights
        # entropy of the HF logits at the same positions
        hf = hf_model(tiny_model_dir)
        ents = []
        for toks, r in zip(batch.tokens, batch.response_lengths):
            with torch.no_grad():
                logits = hf(torch.tensor([toks])).logits[0] / TEMPERATURE
            p = len(toks) - r
            ents.append(torch.distributions.Categorical(logits=logits[p - 1 : p - 1 + r]).entropy())
        assert (ent - torch.cat(ents)).abs().max().item() < 1e-5
        # one sample at a time gives the same log-probs as the whole micro-batch
        one = torch.cat([be.forward_logprobs(MicroBatch([t], [r]))[0]
                         for t, r in zip(batch.tokens, batch.response_lengths)])
        assert (one - lp).abs().max().item() < 1e-6

        # weights: exactly the HF parameter names and shapes, bit-exact (megatron: after HF -> megatron -> HF)
        weights = dict(be.named_weights())
        params = dict(hf.named_parameters())
        assert sorted(weights) == sorted(params)  # the engines' names, the tied head once (as the embedding)
        for pname, p in params.items():
            assert weights[pname].shape == p.shape and torch.equal(weights[pname], p.detach()), pname
        if name == "megatron":
            megatron_names = {n for n, _ in be.model.named_parameters()}
            assert "decoder.layers.0.self_attention.linear_qkv.weight" in megatron_names
            assert "decoder.layers.0.mlp.linear_fc1.weight" in megatron_names
    finally:
        actor.shutdown()


def _train_capturing(args, batch, rollouts=1):
    """Train `rollouts` times on `batch`; returns (grads per optimizer step with HF names, metrics
    without timings and memory, final HF state)."""
    actor = local_actor(args)
    be = actor.backend
    steps = []
    orig = be.optimizer.step

    def step(*a, **k):
        if args.train_backend == "fsdp":
            from torch.distributed.tensor import DTensor

            steps.append({n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                          for n, p in be.model.named_parameters()})
        else:
            from slime.training.megatron.weights import to_hf  # optional dependency

            grads = {n: p.grad.detach().clone() for n, p in be.model.named_parameters()}
            steps.append(to_hf(grads, be.hf_config))
        return orig(*a, **k)

    be.optimizer.step = step
    try:
        metrics = [deterministic(actor.train(i, batch)) for i in range(rollouts)]
        state = actor.full_state(optimizer=False)[0]
    finally:
        actor.shutdown()
    return steps, metrics, state


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("megatron", marks=needs_megatron)])
def test_training_steps_match_the_reference_backend(name, tiny_model_dir, tmp_path):
    """Same batch, loss (PPO clip + k3 KL + entropy), AdamW settings and micro-batches, two rollouts of
    two optimizer steps each: the backend's gradients at every step, its metrics and its updated
    weights are the FSDP backend's. Two samples hold the pad token, whose embedding row the HF models
    train only through a tied output layer (megatron's embedding would train it from those positions)."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=12, pad_tokens=True)
    runs = {}
    for backend in ("fsdp", name):
        args = make_args(tiny_model_dir, tmp_path, *COMMON, "--micro-batch-size", 3, "--clip-grad", 0.5,
                         "--train-backend", backend)
        assert args.num_steps_per_rollout == 2
        runs[backend] = _train_capturing(args, batch, rollouts=2)
    (gf, mf, sf), (gm, mm, sm) = runs["fsdp"], runs[name]
    assert len(gf) == len(gm) == 4
    for a, b in zip(gm, gf):
        assert set(a) == set(b)
        assert_states_close(a, b, atol=1e-6, rtol=1e-4)  # observed ~1e-8
    for a, b in zip(mm, mf):
        assert set(a) == set(b)
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    assert mm[0]["train/grad_norm"] > 0.5  # clipping was active
    assert mm[0]["train/ppo_kl"] != 0 and mm[1]["train/kl_loss"] > 0
    initial = dict(hf_model(tiny_model_dir).state_dict())
    assert set(sm) == set(initial) == set(sf)
    assert min((sm[k] - initial[k]).abs().max().item() for k in initial) > 1e-4  # every weight moved
    assert_states_close(sm, sf, atol=1e-5)


@pytest.mark.parametrize("name", KINDS)
def test_every_step_trains_at_the_scheduled_lr_and_a_resume_continues_it(name, tiny_model_dir, tmp_path):
    """--lr-decay-style cosine with a warm-up: each optimizer step's learning rate is the schedule's
    (train/lr logs the last step's), and a rank restored from a checkpoint continues the schedule."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=13)
    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--train-backend", name, "--num-rollout", 3,
                     "--lr-decay-style", "cosine", "--lr-warmup-iters", 2, "--min-lr", 1e-4)
    assert args.num_steps_per_rollout == 2
    schedule = LRSchedule(lr=1e-3, min_lr=1e-4, style="cosine", warmup_iters=2, decay_iters=6)

    def capture(actor, used):
        orig = actor.backend.optimizer.step

        def step(*a, **k):
            used.append(actor.backend.optimizer.param_groups[0]["lr"])
            return orig(*a, **k)

        actor.backend.optimizer.step = step

    used, logged = [], []
    actor = local_actor(args)
    try:
        capture(actor, used)
        for rollout in range(2):
            logged.append(actor.train(rollout, batch)["train/lr"])
        actor.save(str(tmp_path / "ckpt"))
    finally:
        actor.shutdown()
    assert used == pytest.approx([schedule.at(s) for s in range(4)]) and used[0] == 0.0  # warm-up from 0
    assert logged == pytest.approx([used[1], used[3]])

    resumed = local_actor(args)
    try:
        resumed.load(str(tmp_path / "ckpt"))
        capture(resumed, used)
        logged.append(resumed.train(2, batch)["train/lr"])
    finally:
        resumed.shutdown()
    assert used[4:] == pytest.approx([schedule.at(4), schedule.at(5)])  # where it stopped, not from 0
    assert schedule.at(5) < schedule.at(4) < schedule.at(2) == 1e-3


@pytest.mark.parametrize("name", KINDS)
def test_recompute_gives_the_same_gradients(name, tiny_model_dir, tmp_path, monkeypatch):
    """--recompute-granularity full: every decoder layer runs again in backward (counted at the
    checkpoint function each backend uses), and the step's gradients and metrics are those
    without recompute within fp32 tolerance."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=14)
    if name == "megatron" and not torch.cuda.is_available():  # megatron-core's recompute keeps CUDA RNG states
        args = make_args(tiny_model_dir, tmp_path, *COMMON, "--train-backend", name, "--gradient-checkpointing")
        with pytest.raises(SlimeConfigError, match="--recompute-granularity full with --train-backend megatron "
                                                   "needs CUDA .*; on CPU use --train-backend fsdp"):
            local_actor(args)
        return
    plain = grads_after_train(make_args(tiny_model_dir, tmp_path, *COMMON, "--train-backend", name), batch)
    calls = []
    if name == "fsdp":
        import slime.training.fsdp.backend as module

        target = "checkpoint"
    else:
        from megatron.core import tensor_parallel as module  # optional dependency: only when installed

        target = "checkpoint"
    original = getattr(module, target)
    monkeypatch.setattr(module, target, lambda *a, **k: calls.append(1) or original(*a, **k))
    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--train-backend", name, "--gradient-checkpointing")
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "uniform", 1)
    recomputed = grads_after_train(args, batch)
    layers = AutoConfig.from_pretrained(tiny_model_dir).num_hidden_layers
    assert len(calls) >= 2 * layers and len(calls) % layers == 0  # every layer of every micro-batch
    assert_states_close(recomputed[0], plain[0], atol=1e-6, rtol=1e-5)
    for k, v in plain[1].items():
        assert recomputed[1][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("flags, message", [
    (["--recompute-granularity", "selective"], "--recompute-granularity selective (core attention only) needs "
                                               "--train-backend megatron"),
    (["--recompute-method", "block"], "--recompute-method and --recompute-num-layers need --recompute-granularity full"),
    (["--gradient-checkpointing", "--recompute-method", "block"], "--recompute-method block needs --recompute-num-layers N"),
    (["--gradient-checkpointing", "--recompute-num-layers", 2], "--recompute-method uniform with --recompute-num-layers > 1"),
])
def test_bad_recompute_flags_are_one_line(tiny_model_dir, tmp_path, flags, message):
    with pytest.raises(SlimeConfigError) as e:
        make_args(tiny_model_dir, tmp_path, *flags)
    assert message in str(e.value)


def test_fsdp_chunked_output_layer_trains_like_the_full_logits(tiny_model_dir, tmp_path):
    """--log-probs-chunk-size 8 (many chunks per micro-batch; each recomputed in backward) gives the
    gradients and metrics of --log-probs-chunk-size 0 (the model's full logits), entropy loss on."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=15)
    full = grads_after_train(make_args(tiny_model_dir, tmp_path, *COMMON, "--log-probs-chunk-size", 0), batch)
    chunked = grads_after_train(make_args(tiny_model_dir, tmp_path, *COMMON, "--log-probs-chunk-size", 8), batch)
    assert_states_close(chunked[0], full[0], atol=1e-6, rtol=1e-5)
    for k, v in full[1].items():
        assert chunked[1][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert full[1]["train/entropy_loss"] != 0


def test_fsdp_bf16_step_is_close_to_fp32_with_fp32_master_weights(tiny_model_dir, tmp_path):
    """--bf16: bf16 compute (FSDP2 MixedPrecisionPolicy, also on one rank), fp32 parameters,
    optimizer state and reduced gradients; one step's metrics within 2% of fp32 and its gradient
    direction the same."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=16)
    g32, m32 = grads_after_train(make_args(tiny_model_dir, tmp_path, *COMMON), batch)
    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--bf16")
    g16, m16 = grads_after_train(args, batch)
    assert {v.dtype for v in g16.values()} == {torch.float32}
    dot = sum((g16[k] * g32[k]).sum() for k in g32)
    norms = (sum((g16[k] ** 2).sum() for k in g32) * sum((g32[k] ** 2).sum() for k in g32)).sqrt()
    assert dot / norms > 0.999
    for k in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert m16[k] == pytest.approx(m32[k], rel=2e-2), k
    assert m16["train/train_rollout_logprob_abs_diff"] > 10 * m32["train/train_rollout_logprob_abs_diff"]  # bf16 vs fp32 rollout
    actor = local_actor(args)
    try:
        be = actor.backend
        assert be.sharded and {p.dtype for p in be.model.parameters()} == {torch.float32}
        lp, _ = be.forward_logprobs(MicroBatch(batch.tokens, batch.response_lengths))
        assert lp.dtype == torch.float32
    finally:
        actor.shutdown()


@pytest.mark.parametrize("flags, message", [
    (["--bf16", "--fp16"], "--bf16 and --fp16: give one"),
    (["--fp16"], "--fp16 needs loss scaling, which slime does not implement; use --bf16"),
])
def test_bad_precision_flags_are_one_line(tiny_model_dir, tmp_path, flags, message):
    with pytest.raises(SlimeConfigError) as e:
        make_args(tiny_model_dir, tmp_path, *flags)
    assert message in str(e.value)


@pytest.mark.parametrize("name", KINDS)
def test_optimizer_cpu_offload_is_a_stated_no_op_on_cpu(name, tiny_model_dir, tmp_path, caplog):
    """--optimizer-cpu-offload: on a GPU FSDP2 keeps master weights, gradients and AdamW state on
    the host (megatron refuses it there); on a CPU run nothing changes (the same step, bit for bit)
    and it says so."""
    if torch.cuda.is_available():
        pytest.skip("the CPU statement; the GPU path is FSDP2's CPUOffloadPolicy")
    batch = synthetic_batch(tiny_model_dir, 8, seed=17)
    flags = [*COMMON, "--train-backend", name]
    plain = grads_after_train(make_args(tiny_model_dir, tmp_path, *flags), batch)
    with caplog.at_level("INFO", logger=f"slime.training.{name}.backend"):
        offload = grads_after_train(make_args(tiny_model_dir, tmp_path, *flags, "--optimizer-cpu-offload"), batch)
    assert "--optimizer-cpu-offload: this run trains on the CPU" in caplog.text
    assert_states_close(offload[0], plain[0], atol=0)
    assert offload[1] == plain[1]
