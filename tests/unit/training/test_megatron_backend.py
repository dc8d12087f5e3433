"""megatron-core training backend (`--train-backend megatron`) on CPU (gloo), against the HF model
and the FSDP backend. Skipped without megatron-core."""

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from slime.training.megatron.dist_checkpoint import is_train_state  # noqa: E402
from slime.utils.errors import SlimeConfigError  # noqa: E402
from torch import Tensor  # noqa: E402
from slime.training.backend import MicroBatch  # noqa: E402
from tests.helpers.training import (  # noqa: E402
    COMMON,
    assert_states_close,
    deterministic,
    grads_after_train,
    group_train,
    initial_state,
    local_actor,
    make_args,
    synthetic_batch,
)

BATCH = ["--rollout-batch-size", 4, "--n-samples-per-prompt", 2]


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _gqa_model(tiny_model_dir, out, kind):
    """The tiny model's shape with 4 query heads over 2 KV groups (so TP=2 can split them) and
    non-trivial norms and biases (Qwen3: q/k norms; Qwen2: q/k/v biases, untied head); the tiny
    model's tokenizer files."""
    from transformers import (
        AutoConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 32
    cls = LlamaForCausalLM
    common = {k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "architectures")}
    if kind == "qwen3":
        cfg, cls = Qwen3Config(**common), Qwen3ForCausalLM
    elif kind == "qwen2_untied":  # q/k/v biases; an untied output layer (vocabulary-parallel)
        cfg, cls = Qwen2Config(**{**common, "tie_word_embeddings": False}), Qwen2ForCausalLM
    return _save_variant(cls, cfg, 3, tiny_model_dir, out)


def _save_variant(cls, cfg, seed, tiny_model_dir, out):
    """A random model of `cls(cfg)` with non-trivial norms (and biases), saved with the tiny model's
    tokenizer files."""
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    for f in Path(tiny_model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy2(f, out / f.name)
    return str(out)


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("extra, message", [
    (["--pipeline-model-parallel-size", 2, "--actor-num-gpus-per-node", 2, "--decoder-first-pipeline-num-layers", 3],
     r"cannot split the model's 2 layers over --pipeline-model-parallel-size 2 \(first stage 3, last stage 0"),
    (["--pipeline-model-parallel-size", 2, "--actor-num-gpus-per-node", 2, "--virtual-pipeline-model-parallel-size", 2],
     r"cannot split the model's 2 layers over --pipeline-model-parallel-size 2 x 2 virtual stages: the layers of"),
    (["--pipeline-model-parallel-size", 2, "--actor-num-gpus-per-node", 2,
      "--num-layers-per-virtual-pipeline-stage", 3], "--num-layers-per-virtual-pipeline-stage 3 x"),
    (["--virtual-pipeline-model-parallel-size", 2], "--virtual-pipeline-model-parallel-size 2: needs --pipeline-model"),
    (["--context-parallel-size", 2, "--actor-num-gpus-per-node", 2], "--context-parallel-size > 1 needs Transformer"),
    (["--tensor-model-parallel-size", 2], r"\(2 x 1 x 1 = 2\) must divide the 1 train ranks"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
])
def test_megatron_flags_are_validated(tiny_model_dir, tmp_path, extra, message):
    with pytest.raises(SlimeConfigError, match=message):
        make_args(tiny_model_dir, tmp_path, *BATCH, "--train-backend", "megatron", *extra)


def test_megatron_layout_on_fsdp_is_checked_like_megatron(tiny_model_dir, tmp_path):
    # fsdp (the default backend) checks megatron's sizes as megatron would, then shards everything
    with pytest.raises(SlimeConfigError, match=r"--tensor-model-parallel-size 2 must divide the model's 2 attention "
                                               r"heads and 1 key/value heads"):
        make_args(tiny_model_dir, tmp_path, *BATCH, "--tensor-model-parallel-size", 2, "--actor-num-gpus-per-node", 2)
    with pytest.raises(SlimeConfigError, match=r"\(1 x 2 x 1\) must divide the 1 train ranks"):
        make_args(tiny_model_dir, tmp_path, *BATCH, "--pipeline-model-parallel-size", 2)
    args = make_args(tiny_model_dir, tmp_path, *BATCH, "--train-backend", "megatron", "--tensor-model-parallel-size", 2,
                     "--actor-num-gpus-per-node", 4)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size) == (2, 1, 1)


# ---------------------------------------------------------------- forward and weights


def _assert_next_rollout_alike(a, b, batch):
    """The next rollout trains both local actors alike: the same metrics and weights, bit for bit."""
    ma, mb = a.train(1, batch), b.train(1, batch)
    assert deterministic(ma) == deterministic(mb) and "train/loss" in deterministic(ma)
    assert_states_close(b.full_state(optimizer=False)[0], a.full_state(optimizer=False)[0], atol=0)


@pytest.mark.slow
def test_save_then_load_restores_model_and_optimizer(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--micro-batch-size", 2, "--train-backend", "megatron")
    batch = synthetic_batch(tiny_model_dir, 8, seed=13)
    ckpt = tmp_path / "ckpt"
    a = local_actor(args)
    b = local_actor(args)  # the same process: shares a's process group and megatron parallel state
    try:
        a.train(0, batch)
        a.save(str(ckpt))
        assert is_train_state(ckpt / "train_state")  # megatron's distributed checkpoint format
        b.load(str(ckpt))
        sa, oa = a.full_state()
        sb, ob = b.full_state()
        assert_states_close(sb, sa, atol=0)
        assert oa["param_groups"] == ob["param_groups"]
        assert set(oa["state"]) == {n for n, _ in a.backend.model.named_parameters()}
        for name, st in oa["state"].items():
            assert float(st["step"]) == 2.0
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ob["state"][name][key], st[key]), (name, key)

        # the HF export loads with from_pretrained and holds the same weights
        hsd = hf_model(ckpt / "hf").state_dict()
        assert_states_close({k: hsd[k] for k in sa}, sa, atol=0)
        assert (ckpt / "hf" / "tokenizer.json").is_file()

        # training resumes exactly
        _assert_next_rollout_alike(a, b, batch)
    finally:
        b.shutdown()
        a.shutdown()


# ---------------------------------------------------------------- log-probs from the hidden states


def test_chunked_output_layer_trains_like_the_full_logits(tiny_model_dir, tmp_path):
    """--log-probs-chunk-size 8 (the output layer applied 8 rows at a time, each chunk recomputed in
    backward; slime/training/megatron/head.py) gives the gradients and metrics of
    --log-probs-chunk-size 0 (the model's full logits), entropy loss on; the reference model's
    log-probs (KL) go the same way."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=15, pad_tokens=True)
    flags = [*COMMON, "--train-backend", "megatron"]
    full = grads_after_train(make_args(tiny_model_dir, tmp_path, *flags, "--log-probs-chunk-size", 0), batch)
    chunked = grads_after_train(make_args(tiny_model_dir, tmp_path, *flags, "--log-probs-chunk-size", 8), batch)
    assert_states_close(chunked[0], full[0], atol=1e-6, rtol=1e-5)
    for k, v in full[1].items():  # the log-sum-exp is summed in another order: fp32 rounding of a log-prob
        assert chunked[1][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k  # (ulp 5e-7 at -5) shows in ppo_kl
    assert full[1]["train/entropy_loss"] != 0 and full[1]["train/kl_loss"] != 0


# ---------------------------------------------------------------- --bf16 (fp32 main copies)


def test_bf16_trains_fp32_main_weights_close_to_fp32(tiny_model_dir, tmp_path):
    """--bf16: the parameters compute in bf16; fp32 gradients and main copies take the update (updates
    below bf16's resolution are kept, the push is the main copy rounded to bf16); one step's metrics
    within 2% of fp32 and its gradient direction the same; a save holds the fp32 main copies and
    AdamW state, and training resumes from it exactly."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=16, pad_tokens=True)
    flags = [*COMMON, "--train-backend", "megatron"]
    g32, m32 = grads_after_train(make_args(tiny_model_dir, tmp_path, *flags), batch)
    g16, m16 = grads_after_train(make_args(tiny_model_dir, tmp_path, *flags, "--bf16"), batch)
    assert {v.dtype for v in g16.values()} == {torch.float32}  # accumulated and reduced in fp32
    dot = sum((g16[k] * g32[k]).sum() for k in g32)
    norms = (sum((g16[k] ** 2).sum() for k in g32) * sum((g32[k] ** 2).sum() for k in g32)).sqrt()
    assert dot / norms > 0.999
    for k in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert m16[k] == pytest.approx(m32[k], rel=2e-2), k
    assert m16["train/train_rollout_logprob_abs_diff"] > 10 * m32["train/train_rollout_logprob_abs_diff"]

    # lr 1e-6: AdamW moves each weight by about 1e-6 a step, far below bf16's resolution (~1e-4 here)
    args = make_args(tiny_model_dir, tmp_path, *flags, "--bf16", "--lr", 1e-6)
    a, b = local_actor(args), local_actor(args)  # b shares a's process group and megatron parallel state
    try:
        be = a.backend
        assert {p.dtype for p in be.model.parameters()} == {torch.bfloat16}
        lp, _ = be.forward_logprobs(MicroBatch(batch.tokens, batch.response_lengths))
        assert lp.dtype == torch.float32
        a.train(0, batch)
        main, osd = a.full_state()
        assert {v.dtype for v in main.values()} == {torch.float32}
        assert {v.dtype for st in osd["state"].values() for v in st.values()} == {torch.float32}
        init = initial_state(tiny_model_dir)
        moved = max(float((main[k] - init[k]).abs().max()) for k in init)
        assert 0 < moved <= 3e-6
        unchanged = sum(int((main[k].bfloat16() == init[k].bfloat16()).sum()) for k in init)
        # 94% of the weights (2026-11-27): a bf16 copy alone would have lost their update
        assert unchanged / sum(v.numel() for v in init.values()) > 0.9
        pushed = dict(be.named_weights())
        assert pushed and all(torch.equal(v, main[k].bfloat16()) for k, v in pushed.items())

        ckpt = tmp_path / "ckpt"
        a.save(str(ckpt))
        assert_states_close(hf_model(ckpt / "hf").state_dict(), main, atol=0)  # the fp32 main copies
        b.load(str(ckpt))
        assert_states_close(b.full_state()[0], main, atol=0)
        _assert_next_rollout_alike(a, b, batch)
    finally:
        b.shutdown()
        a.shutdown()


# ---------------------------------------------------------------- tensor parallelism (2 CPU ranks, gloo)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2_untied"])
def test_tensor_parallel_matches_one_rank(kind, tiny_model_dir, tmp_path, ray_session):
    """TP=2 (2 ranks, one TP group; Qwen3 and Qwen2), DP=2 (TP=1; Llama) and one rank: the same metrics
    and weights after two AdamW steps (through full_state: the TP shards gathered back to HF names). Qwen3's q/k norms are
    replicated but see only their rank's heads: their gradients must be summed over the TP group.
    Two samples hold the pad token (its embedding row gets no gradient from them, as in HF): under
    sequence parallelism each TP rank's embedding output is its part of the sequence."""
    gqa_model_dir = _gqa_model(tiny_model_dir, tmp_path / kind, kind)
    batch = synthetic_batch(gqa_model_dir, 8, seed=14, pad_tokens=True)
    # ranks, TP, micro-batch size, flags; the untied (vocabulary-parallel) output layer and SP take their
    # log-probs 8 rows at a time (every TP rank's vocabulary shard per chunk; the tiny vocabulary fits rank 0's)
    chunked = ["--log-probs-chunk-size", 8]
    layouts = {"one": (1, 1, 3, [])}
    if kind == "llama":  # (TP 2 on llama: the Qwen cases run the same code with more to split)
        layouts["dp2"] = (2, 1, 1, [])
    else:
        layouts["tp2"] = (2, 2, 1, chunked if kind == "qwen2_untied" else [])
    if kind == "qwen3":  # sequence parallel: the layer norms see half the tokens each, the q/k norms half the heads
        layouts["tp2_sp"] = (2, 2, 2, ["--sequence-parallel", *chunked])
    results = {}
    for name, (ranks, tp, mbs, flags) in layouts.items():
        args = make_args(gqa_model_dir, tmp_path, *COMMON, "--train-backend", "megatron",
                         "--actor-num-gpus-per-node", ranks, "--tensor-model-parallel-size", tp,
                         "--micro-batch-size", mbs, *flags)
        [metrics], (state, _) = group_train(args, batch)
        results[name] = (metrics, state)
    m1, s1 = results["one"]
    assert set(s1) == set(hf_model(gqa_model_dir).state_dict())  # HF names, biases and untied head included
    if kind == "qwen2_untied":
        assert {"lm_head.weight", "model.layers.0.self_attn.q_proj.bias"} <= set(s1)
    assert m1["train/train_rollout_logprob_abs_diff"] < 1e-5  # first pass: the HF model's log-probs
    assert m1["train/ppo_kl"] != 0
    for name in set(layouts) - {"one"}:
        m, s = results[name]
        assert set(m) == set(m1)
        for k in deterministic(m1):  # timings and memory differ between layouts
            assert m[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), (name, k)
        assert set(s) == set(s1)
        assert_states_close(s, s1, atol=1e-5)


@pytest.mark.slow
def test_bf16_tensor_and_sequence_parallel_match_one_bf16_rank(tiny_model_dir, tmp_path, ray_session):
    """--bf16 under TP 2 + SP (each TP shard's own fp32 main copy, fp32 gradients summed over the TP
    group, bf16 activations through SP's gathers, chunked log-probs over the vocabulary shards) against
    one bf16 rank: the metrics of two rollouts within 2% (bf16 rounding in another order; without the
    fp32 accumulation of the micro-batches' gradients the loss is 5% off)."""
    model_dir = _gqa_model(tiny_model_dir, tmp_path / "qwen3", "qwen3")
    batch = synthetic_batch(model_dir, 8, seed=15)
    # TP 2: two micro-batches a step (their bf16 gradients accumulate in the fp32 main gradient); one rank: one
    layouts = {"one": (1, [], 4), "tp2_sp": (2, ["--tensor-model-parallel-size", 2, "--sequence-parallel"], 1)}
    results = _train_layouts(model_dir, tmp_path, layouts, batch, extra=["--bf16"])
    (m1, (s1, o1)), (m2, (s2, o2)) = results["one"], results["tp2_sp"]
    for step in range(2):
        # (not the KL: a difference of nearby bf16 log-probs, 4.5% apart between the two micro-batch shapes)
        for k in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
            assert m2[step][k] == pytest.approx(m1[step][k], rel=2e-2), (step, k)
    assert {v.dtype for v in s2.values()} == {torch.float32} and set(s2) == set(s1)
    assert set(o2["state"]) == set(o1["state"]) and {float(st["step"]) for st in o2["state"].values()} == {4.0}


# ---------------------------------------------------------------- pipeline parallelism (2 CPU ranks, gloo)


def _four_layer_model(tiny_model_dir, out, tied: bool):
    """The tiny model's shape with 4 decoder layers (2 pipeline stages x 2 virtual stages), random
    norms; tied or untied output layer; the tiny model's tokenizer files."""
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.num_hidden_layers, cfg.tie_word_embeddings = 4, tied
    return _save_variant(LlamaForCausalLM, cfg, 5, tiny_model_dir, out)


def _train_layouts(model_dir, tmp_path, layouts, batch, extra=()):
    results = {}
    for name, (ranks, flags, mbs) in layouts.items():
        args = make_args(model_dir, tmp_path, *COMMON, "--train-backend", "megatron", "--actor-num-gpus-per-node",
                         ranks, "--micro-batch-size", mbs, *flags, *extra)
        results[name] = group_train(args, batch, rollouts=2, optimizer=True)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pipeline_parallel_matches_one_rank(tied, tiny_model_dir, tmp_path, ray_session):
    """PP 2 with 2 virtual stages (interleaved), tied embeddings; PP 2 (1F1B) with an uneven split
    (1 + 3 layers), untied output layer; each against one rank: the same metrics, weights and
    AdamW state after four steps. A tied embedding lives on both end stages and must train as one
    weight."""
    model_dir = _four_layer_model(tiny_model_dir, tmp_path / "four", tied)
    batch = synthetic_batch(model_dir, 8, seed=15)
    pp = ["--pipeline-model-parallel-size", 2]
    # micro-batches of the pipeline: 2 per step of 2 samples (mbs 1 on each rank), or 1 of 4 (mbs 2)
    # padded with a filler to the 2 the interleaved schedule needs
    if tied:
        # (plain PP 2 on the tied model was a case until 2026-11-28, cut for CI time: the untied case runs 1F1B)
        layouts = {"one": (1, [], 4),  # and the last stage's log-probs 8 rows at a time
                   "pp2_vp2": (2, pp + ["--virtual-pipeline-model-parallel-size", 2, "--log-probs-chunk-size", 8], 2)}
    else:
        layouts = {"one": (1, [], 4), "pp2_uneven": (2, pp + ["--decoder-first-pipeline-num-layers", 1], 1)}
    results = _train_layouts(model_dir, tmp_path, layouts, batch)
    m1, (s1, o1) = results["one"]
    assert m1[0]["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert set(s1) == set(hf_model(model_dir).state_dict())
    for name in set(layouts) - {"one"}:
        metrics, (model, optim) = results[name]
        for step in range(2):
            assert set(metrics[step]) == set(m1[step])
            for k in deterministic(m1[step]):
                assert metrics[step][k] == pytest.approx(m1[step][k], rel=1e-4, abs=1e-6), (name, step, k)
        assert_states_close(model, s1, atol=1e-5)
        assert set(optim["state"]) == set(o1["state"])
        for pname, st in o1["state"].items():
            assert float(optim["state"][pname]["step"]) == float(st["step"]) == 4.0
            torch.testing.assert_close(optim["state"][pname]["exp_avg"], st["exp_avg"], atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------- PPO critic (value head)


def _returns(batch, seed=21):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(r, generator=g) for r in batch.response_lengths]


def _critic_steps(critic, batch, returns) -> tuple[list[Tensor], dict, list[Tensor]]:
    """(values before training, metrics of one rollout of two critic steps, values after) of a local critic."""
    before = critic.compute_values(0, batch)
    metrics = critic.train_critic(0, batch, returns)
    return before, deterministic(metrics), critic.compute_values(1, batch)


def _assert_critics_match(got, want, values_atol=1e-5):
    (b1, m1, a1), (b2, m2, a2) = got, want
    for x, y in zip(b1, b2):
        torch.testing.assert_close(x, y, atol=values_atol, rtol=0)  # before training: the same head, the same backbone
    assert set(m1) == set(m2) and "critic/value_loss" in m1
    for k in m2:
        assert m1[k] == pytest.approx(m2[k], rel=1e-4, abs=1e-6), k
    for x, y in zip(a1, a2):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_critic_matches_fsdp_critic(tiny_model_dir, tmp_path):
    """The megatron critic starts from the FSDP critic's weights (HF's token-classification model,
    `score` initialized under the same seed): the same values, and after two critic steps the same
    metrics, values and HF-named weights (score.weight and score.bias included)."""
    from transformers import AutoModelForTokenClassification

    flags = [*COMMON, "--micro-batch-size", 2, "--advantage-estimator", "ppo", "--critic-lr", 2e-3]
    batch = synthetic_batch(tiny_model_dir, 8, seed=17)
    returns = _returns(batch)
    runs = {}
    for backend in ("fsdp", "megatron"):
        critic = local_actor(make_args(tiny_model_dir, tmp_path, *flags, "--train-backend", backend), role="critic")
        try:
            runs[backend] = (_critic_steps(critic, batch, returns), critic.full_state(optimizer=False)[0])
            if backend == "megatron":
                critic.save(str(tmp_path / "ckpt"))
        finally:
            critic.shutdown()
    (got, state), (want, fsdp_state) = runs["megatron"], runs["fsdp"]
    _assert_critics_match(got, want)
    assert {"score.weight", "score.bias"} <= set(state) and "lm_head.weight" not in state
    assert set(state) == set(fsdp_state)
    assert_states_close(state, fsdp_state, atol=1e-5)
    # the HF export is a token-classification checkpoint
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "ckpt" / "hf", num_labels=1, dtype=torch.float32)
    assert_states_close({k: hf.state_dict()[k] for k in state}, state, atol=0)


def _critic_layouts(model_dir, tmp_path, layouts, batch, returns, extra):
    import ray

    from slime.ray.actor_group import TrainGroup

    results = {}
    for name, (ranks, flags, mbs) in layouts.items():
        args = make_args(model_dir, tmp_path, *COMMON, "--train-backend", "megatron", "--actor-num-gpus-per-node",
                         ranks, "--micro-batch-size", mbs, *extra, *flags)
        group = TrainGroup(args, role="critic")
        try:
            group.init()
            idx = batch.rank_indices(args.dp_size, args.global_batch_size)
            refs = [ray.put(batch.select(i)) for i in idx]
            rets = [[returns[j] for j in i] for i in idx]
            ids = [0] * len(idx)

            def values(rollout):
                out = [None] * len(batch)
                for i, vs in zip(idx, group._call("compute_values", [rollout] * len(idx), refs)):
                    for j, v in zip(i, vs):
                        out[j] = v
                return out

            before = values(0)
            metrics = group._call("train_critic", ids, refs, rets)
            assert all(m == metrics[0] for m in metrics[1:])  # every rank reports the group's metrics
            results[name] = (before, deterministic(metrics[0]), values(1))
        finally:
            group.shutdown()
    return results


@pytest.mark.slow
def test_critic_tensor_and_pipeline_parallel_match_one_rank(tiny_model_dir, tmp_path, ray_session):
    """TP 2 with sequence parallelism (the value head is replicated: its gradient, identical on both
    TP ranks, counts once in the norm) and PP 2, on a 4-layer Qwen3 model (q/k norms, untied
    embeddings), against one rank: the same values before training, and after two critic steps the
    same metrics and values."""
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    common = {k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "architectures")}
    cfg = Qwen3Config(**{**common, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                         "num_hidden_layers": 4, "tie_word_embeddings": False})
    model_dir = _save_variant(Qwen3ForCausalLM, cfg, 6, tiny_model_dir, tmp_path / "qwen3_four")
    batch, flags = synthetic_batch(model_dir, 8, seed=18), ["--advantage-estimator", "ppo", "--critic-lr", 2e-3]
    returns = _returns(batch)
    one = local_actor(make_args(model_dir, tmp_path, *COMMON, *flags, "--train-backend", "megatron",
                                "--micro-batch-size", 4), role="critic")  # in this process: no Ray actor to start
    try:
        want = _critic_steps(one, batch, returns)
    finally:
        one.shutdown()
    layouts = {"tp2_sp": (2, ["--tensor-model-parallel-size", 2, "--sequence-parallel"], 2),
               "pp2": (2, ["--pipeline-model-parallel-size", 2], 1)}
    results = _critic_layouts(model_dir, tmp_path, layouts, batch, returns, flags)
    for name in layouts:
        _assert_critics_match(results[name], want)
