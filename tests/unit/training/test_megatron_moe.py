"""Mixture of experts on the megatron backend (`--train-backend megatron`, slime.training.megatron.moe)
on CPU (gloo): the tiny Qwen3-MoE / Mixtral / Qwen2-MoE give the Hugging Face model's log-probs, the
HF names round trip (and the saved checkpoint carries the per-expert names), the load-balancing loss
equals the FSDP backend's, rollout routing replay forces the given experts, expert parallelism
(2 ranks, with and without the distributed optimizer) and pipeline parallelism (2 stages) match one
rank and their checkpoints load at one rank (and through the tools/ converter), and what is not
built yet is refused at start-up. Skipped without megatron-core."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from slime.training.backend import MicroBatch  # noqa: E402
from slime.utils.errors import SlimeConfigError  # noqa: E402
from slime.utils.moe_routing import RoutingHook  # noqa: E402
from slime.utils.tiny_model import build_tiny_moe_model  # noqa: E402
from tests.helpers.training import (  # noqa: E402
    COMMON,
    TEMPERATURE,
    assert_states_close,
    deterministic,
    local_actor,
    make_args,
    synthetic_batch,
)

MEGATRON = ["--train-backend", "megatron"]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    return {f: str(build_tiny_moe_model(tmp_path_factory.mktemp(f), seed=1, family=f))
            for f in ("qwen3_moe", "mixtral", "qwen2_moe")}


def _hf_log_probs(model_dir, batch, idx, routed=None):
    """Response log-probs of a plain HF fp32 forward per sample (forced to `routed[i]` when given)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hook = RoutingHook(model)
    out = []
    for i in idx:
        toks, n = batch.tokens[i], batch.response_lengths[i]
        with torch.no_grad():
            if routed is None:
                logits = model(torch.tensor([toks]), use_cache=False).logits[0]
            else:
                rows = torch.cat([routed[i], torch.full((1, routed[i].shape[1]), -1, dtype=torch.int32)])
                with hook.replaying(rows.reshape(len(toks), hook.num_layers, hook.top_k)):
                    logits = model(torch.tensor([toks]), use_cache=False).logits[0]
        p = len(toks) - n
        lp = torch.log_softmax(logits.float() / TEMPERATURE, -1)[p - 1: p - 1 + n]
        out.append(lp.gather(-1, torch.tensor(toks[p:])[:, None])[:, 0])
    return torch.cat(out)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_megatron_moe_matches_hf_and_round_trips_names(family, moe_dirs, tmp_path):
    model_dir = moe_dirs[family]
    batch = synthetic_batch(model_dir, 4, seed=21)
    actor = local_actor(make_args(model_dir, tmp_path, *COMMON, *MEGATRON, "--micro-batch-size", 2))
    try:
        be = actor.backend
        mb = actor._mb(batch, [0, 1, 2])
        lp, _ = be.forward_logprobs(mb)
        assert (lp.cpu() - _hf_log_probs(model_dir, batch, [0, 1, 2])).abs().max() < 1e-5
        hf_sd = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        named = dict(be.named_weights())  # the names the weight push sends: transformers' in-memory (fused) ones
        assert set(named) == set(hf_sd) - {"lm_head.weight"}
        assert_states_close(named, {k: hf_sd[k] for k in named}, atol=0)
        actor.save(str(tmp_path / "ckpt"))
    finally:
        actor.shutdown()
    with safe_open(str(tmp_path / "ckpt" / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in keys or \
        "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys  # the checkpoint's per-expert names
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf", dtype=torch.float32).state_dict()
    assert_states_close({k: reloaded[k] for k in named}, named, atol=0)


def test_megatron_aux_loss_equals_fsdp_and_replay_forces_experts(moe_dirs, tmp_path):
    """The load-balancing loss of one training forward is the FSDP backend's (the same HF formula);
    R3: the forward uses the given experts and gives the HF model's log-probs forced to them."""
    model_dir = moe_dirs["qwen3_moe"]
    batch = synthetic_batch(model_dir, 8, seed=22)
    aux = {}
    for backend in ("fsdp", "megatron"):
        (tmp_path / backend).mkdir()
        actor = local_actor(make_args(model_dir, tmp_path / backend, *COMMON, "--train-backend", backend,
                                      "--moe-aux-loss-coeff", 1.0, "--disable-sequence-packing"))
        try:
            be = actor.backend
            mb = actor._mb(batch, [0, 1, 2, 3])
            be.forward_logprobs(mb, grad=True)
            aux[backend] = float(be.routing.training_forward(be.last_routing, *be.routing_layout(mb)).detach())
            if backend == "megatron":
                own = be.routing.recorded_per_sample(be.last_routing, *be.routing_layout(mb))
                forced = [((r + 1) % 4).reshape(r.shape[0], -1) for r in own]
                lp, _ = be.forward_logprobs(MicroBatch(mb.tokens, mb.response_lengths, forced))
                used = be.routing.recorded_per_sample(be.last_routing, *be.routing_layout(mb))
                assert all(torch.equal(u.reshape(u.shape[0], -1), f) for u, f in zip(used, forced))
                expect = _hf_log_probs(model_dir, batch, [0, 1, 2, 3], routed=dict(enumerate(forced)))
                assert (lp.cpu() - expect).abs().max() < 1e-5
                metrics = actor.train(0, batch)
                assert metrics["train/moe/layer_1/experts_used"] == 4.0
        finally:
            actor.shutdown()
    assert aux["megatron"] == pytest.approx(aux["fsdp"], rel=1e-5)


PP2 = ["--pipeline-model-parallel-size", 2, "--actor-num-gpus-per-node", 2]


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", 2, "--actor-num-gpus-per-node", 2],
     "--tensor-model-parallel-size 2 with a mixture-of-experts model needs --sequence-parallel"),
    (["--tensor-model-parallel-size", 2, "--sequence-parallel", "--expert-tensor-parallel-size", 4,
      "--actor-num-gpus-per-node", 4], r"--expert-tensor-parallel-size 4: must be 1 \(every expert whole on each "
                                       r"tensor-parallel rank\) or the --tensor-model-parallel-size 2"),
])
def test_moe_layouts_not_built_are_refused_at_start_up(moe_dirs, tmp_path, flags, message):
    """What an MoE run on the megatron backend does not build yet: one line at parse time, before any
    rank starts."""
    with pytest.raises(SlimeConfigError, match=message):
        make_args(moe_dirs["qwen3_moe"], tmp_path, *COMMON, *MEGATRON, *flags)


@pytest.mark.parametrize("flags, message", [
    (["--moe-grouped-gemm"], "--moe-grouped-gemm: needs GPU kernels"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type flex: needs GPU kernels"),
    (["--expert-model-parallel-size", 2], "--expert-model-parallel-size 2: must divide the 1 train ranks"),
])
def test_megatron_moe_flags(moe_dirs, tmp_path, flags, message):
    with pytest.raises(SlimeConfigError, match=message):
        local_actor(make_args(moe_dirs["qwen3_moe"], tmp_path, *COMMON, *MEGATRON, *flags))


@pytest.mark.slow
def test_expert_parallel_matches_one_rank(moe_dirs, tmp_path, ray_session):
    """EP 2 (2 ranks, 2 experts each, all-to-all over gloo) with the distributed optimizer (the dense
    weights' AdamW state split over the 2 data-parallel ranks, each expert's kept by the rank that holds
    it; EP with torch AdamW: test_model_parallel_matches_one_rank's tp2_ep2 and ep2_pp2_vp2) and one
    rank: the same metrics (expert usage and grad norm included), weights and AdamW state after two steps. The distributed optimizer's EP 2 checkpoint resumes at one
    rank: the loaded state is the saved one exactly, and the next step is the one-rank run's."""
    import ray

    from slime.ray.actor_group import TrainGroup

    model_dir = moe_dirs["qwen3_moe"]
    batch = synthetic_batch(model_dir, 8, seed=23)
    ep2 = ["--expert-model-parallel-size", 2]
    layouts = {"ep2_zero1": (2, [*ep2, "--use-distributed-optimizer"], 1), "one": (1, [], 2)}
    results = {}
    for name, (ranks, flags, mbs) in layouts.items():
        args = make_args(model_dir, tmp_path, *COMMON, *MEGATRON, "--actor-num-gpus-per-node", ranks,
                         "--micro-batch-size", mbs, *flags)
        group = TrainGroup(args)
        try:
            group.init()
            refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
            results[name] = ([group.train(0, refs), group.train(1, refs)], group.full_state(optimizer=True))
            if name != "one":  # each rank writes its own experts
                group.save(str(tmp_path / f"{name}_ckpt"))
            else:  # a third step, then the same step again from the EP 2 distributed optimizer's checkpoint
                results["step2"] = (group.train(2, refs), group.full_state(optimizer=True))
                group.load(str(tmp_path / "ep2_zero1_ckpt"))
                results["loaded"] = group.full_state(optimizer=True)
                results["resumed"] = (group.train(2, refs), group.full_state(optimizer=True))
        finally:
            group.shutdown()
    m1, (s1, o1) = results["one"]
    assert m1[0]["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert "train/moe/layer_0/max_load" in m1[0]
    for layout in ("ep2_zero1",):
        metrics, (s2, o2) = results[layout]
        for step in range(2):
            assert set(metrics[step]) == set(m1[step])
            for k in deterministic(m1[step]):
                assert metrics[step][k] == pytest.approx(m1[step][k], rel=1e-4, abs=1e-6), (layout, step, k)
        assert set(s2) == set(s1)
        assert_states_close(s2, s1, atol=1e-5)
        assert set(o2["state"]) == set(o1["state"])
        for pname, st in o1["state"].items():
            torch.testing.assert_close(o2["state"][pname]["exp_avg"], st["exp_avg"], atol=1e-6, rtol=1e-4)
    # resharding resume: EP 2 + distributed optimizer -> one rank with torch AdamW
    _, (s_saved, o_saved) = results["ep2_zero1"]
    s_loaded, o_loaded = results["loaded"]
    assert_states_close(s_loaded, s_saved, atol=0)
    assert set(o_loaded["state"]) == set(o_saved["state"])
    for pname, st in o_saved["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(o_loaded["state"][pname][key], st[key]), (pname, key)
    (m_step2, (s_step2, _)), (m_resumed, (s_resumed, _)) = results["step2"], results["resumed"]
    for k in deterministic(m_step2):
        assert m_resumed[k] == pytest.approx(m_step2[k], rel=1e-4, abs=1e-6), k
    assert_states_close(s_resumed, s_step2, atol=1e-5)
    s2 = results["ep2_zero1"][1][0]
    # the EP 2 checkpoint, read back at EP 1 by tools/convert_torch_dist_to_hf.py: every expert, exactly
    out = tmp_path / "ep2_hf"
    proc = subprocess.run([sys.executable, "tools/convert_torch_dist_to_hf.py", "--input-dir",
                           str(tmp_path / "ep2_zero1_ckpt" / "train_state"), "--output-dir", str(out),
                           "--origin-hf-dir", model_dir], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(converted) == set(s2)
    assert_states_close(converted, s2, atol=0)


def _random_routes(batch, layers=2, top_k=2, experts=4, seed=5):
    """For every sample, distinct random experts for each token but the last: what R3 replays."""
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(layers)])
                         for _ in range(len(t) - 1)]).to(torch.int32) for t in batch.tokens]


REPLAY_FLAGS = {"none": [], "r3": ["--use-rollout-routing-replay"],
                "r2_aux": ["--use-routing-replay", "--moe-aux-loss-coeff", 0.1]}
# layout: (train ranks, flags); without --expert-tensor-parallel-size it is the TP size (megatron's default)
LAYOUTS = {"tp2_etp1": (2, ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                            "--expert-tensor-parallel-size", 1]),
           "ep2_pp2_vp2": (4, ["--expert-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                               "--num-layers-per-virtual-pipeline-stage", 1]),
           "tp2_pp2": (4, ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                           "--pipeline-model-parallel-size", 2]),
           "tp2_ep2": (4, ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                           "--expert-model-parallel-size", 2, "--expert-tensor-parallel-size", 1])}
EXPERT_TP = {"tp2_pp2": 2}  # the layouts whose experts are split over the TP group


@pytest.fixture(scope="module")
def kv2_dirs(tmp_path_factory):
    """The tiny MoE models with 2 key/value heads, which TP 2 splits, and a 4-layer Qwen3-MoE (2 stages x 2
    virtual stages)."""
    dirs = {f: str(build_tiny_moe_model(tmp_path_factory.mktemp(f"{f}_kv2"), seed=1, family=f,
                                        num_key_value_heads=2)) for f in ("qwen3_moe", "qwen2_moe")}
    dirs["qwen3_moe_4l"] = str(build_tiny_moe_model(tmp_path_factory.mktemp("qwen3_moe_4l"), seed=1,
                                                    num_key_value_heads=2, num_hidden_layers=4))
    return dirs


def _moe_batch(model_dir, replay):
    batch = synthetic_batch(model_dir, 8, seed=23)
    if replay == "r3":
        layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
        batch.routed_experts = _random_routes(batch, layers=layers)
    return batch


def _train_two_rollouts(model_dir, tmp_path, batch, ranks, mbs, flags, save=None, load=None):
    """(metrics of rollouts 0 and 1, full state) of a megatron train group; `save`: then write its
    checkpoint there; `load`: then load that checkpoint and return its full state too."""
    import ray

    from slime.ray.actor_group import TrainGroup

    args = make_args(model_dir, tmp_path, *COMMON, *MEGATRON, "--actor-num-gpus-per-node", ranks,
                     "--micro-batch-size", mbs, *flags)
    group = TrainGroup(args)
    try:
        group.init()
        refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
        out = ([group.train(0, refs), group.train(1, refs)], group.full_state(optimizer=True))
        if save:
            group.save(save)
        if load:
            group.load(load)
            out = (*out, group.full_state(optimizer=True))
        return out
    finally:
        group.shutdown()


def _expert_fc2_widths(ckpt: str) -> set[int]:
    """The column counts of the pieces the experts' linear_fc2 weights were written in (torch's checkpoint
    metadata of megatron's distributed checkpoint)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(Path(ckpt) / "train_state")).read_metadata().state_dict_metadata
    keys = [k for k in md if "experts" in k and k.endswith("linear_fc2.weight") and not k.startswith("optimizer")]
    assert keys, sorted(md)[:20]
    return {int(c.sizes[-1]) for k in keys for c in md[k].chunks}


_ONE_RANK: dict = {}  # (model, replay) -> the one-rank run both layouts compare with (one module, one worker)


def _one_rank(model_dir, tmp_path, replay):
    if (model_dir, replay) not in _ONE_RANK:
        _ONE_RANK[(model_dir, replay)] = _train_two_rollouts(model_dir, tmp_path, _moe_batch(model_dir, replay), 1, 4,
                                                             REPLAY_FLAGS[replay])
    return _ONE_RANK[(model_dir, replay)]


@pytest.mark.slow
@pytest.mark.parametrize("layout, replay, family", [
    ("tp2_etp1", "none", "qwen2_moe"), ("tp2_pp2", "r2_aux", "qwen3_moe"), ("tp2_ep2", "r3", "qwen3_moe"),
    ("ep2_pp2_vp2", "r3", "qwen3_moe_4l")])
def test_model_parallel_matches_one_rank(layout, replay, family, kv2_dirs, tmp_path, ray_session):
    """Each layout against one rank: the same metrics (expert usage included), HF-named weights and
    AdamW state after two steps.
    - TP 2 with sequence parallelism: each TP rank routes its half of the sequence; each expert is split
      over the two (expert tensor parallelism 2, megatron's default), or whole on both with
      --expert-tensor-parallel-size 1 (`tp2_etp1`, on Qwen2-MoE, whose shared expert's gated fc1 is split
      like a dense MLP's).
    - TP 2 x PP 2 (`tp2_pp2`): each stage's TP ranks route their halves, 1F1B over the stages; its
      checkpoint loads at one rank exactly and holds each expert's fc2 as two column halves.
    - TP 2 x EP 2 (`tp2_ep2`): the EP group is the TP group, each TP rank holds half the experts and
      dispatches its half of the sequence; its checkpoint loads at one rank exactly.
    - EP 2 x PP 2 with 2 virtual stages (`ep2_pp2_vp2`, a 4-layer model): the interleaved schedule padded
      with a filler micro-batch; the two pipelines of a stage dispatch tokens to each other's experts in
      every forward and backward.
    Routing replay rides on these layouts. R3 (`tp2_ep2`, `ep2_pp2_vp2`): random experts given for every
    token are replayed (the trainer's log-probs move far from the rollout's). R2 with the load-balancing
    loss (`tp2_pp2`): the old-policy forward's routing, joined over the stages and the TP ranks' halves,
    is replayed by each rollout's second step, and each rank adds the loss's share of its layers and
    tokens, with the micro-batch's expert counts of every layer and token joined over all four (the
    model-parallel group's micro-batch is the one rank's; the loss and the router weights are not the
    plain run's).
    PP 2 alone and TP 2 alone (with R2 and the loss, its checkpoint loaded at one rank) were cases here
    until 2026-11-28; they were cut for CI time (about 100 s each under two workers), as the combined
    layouts run the same code per dimension. PP 2 with R3, PP 2 with R2 and the loss, and TP 2 with R3
    were each checked alone on 2026-11-27."""
    model_dir = kv2_dirs[family]
    m1, (s1, o1) = _one_rank(model_dir, tmp_path, replay)
    # the load-balancing loss is one formula over a micro-batch's tokens: the model-parallel group's
    # micro-batch (its ranks' samples together) must be the one rank's (4 samples)
    ckpt = str(tmp_path / "ckpt") if layout in ("tp2_pp2", "tp2_ep2") else None
    ranks, flags = LAYOUTS[layout]
    m2, (s2, o2) = _train_two_rollouts(model_dir, tmp_path, _moe_batch(model_dir, replay), ranks,
                                       2 if replay == "r2_aux" else 1, [*flags, *REPLAY_FLAGS[replay]], save=ckpt)
    diff = m1[0]["train/train_rollout_logprob_abs_diff"]
    assert diff > 1e-2 if replay == "r3" else diff < 1e-5
    for step in range(2):
        assert {"train/moe/layer_0/max_load", "train/moe/layer_1/experts_used"} <= set(m2[step])
        assert set(m2[step]) == set(m1[step])
        for k in deterministic(m1[step]):
            assert m2[step][k] == pytest.approx(m1[step][k], rel=1e-4, abs=1e-6), (step, k)
    assert set(s2) == set(s1)
    assert_states_close(s2, s1, atol=1e-5)
    assert set(o2["state"]) == set(o1["state"])
    for pname, st in o1["state"].items():  # TP 2 pads the vocabulary rows to a multiple of 256 (zeros)
        got = o2["state"][pname]["exp_avg"]
        torch.testing.assert_close(got[: st["exp_avg"].shape[0]], st["exp_avg"], atol=1e-6, rtol=1e-4)
        assert not got[st["exp_avg"].shape[0]:].any()
    if replay == "r2_aux":  # the replayed routing and the load-balancing loss changed the run
        free_metrics, (free, _) = _one_rank(model_dir, tmp_path, "none")
        assert free_metrics[0]["train/loss"] != pytest.approx(m1[0]["train/loss"], rel=1e-4)
        router = "model.layers.0.mlp.gate.weight"
        assert (free[router] - s1[router]).abs().max() > 1e-4
    if ckpt:  # TP 2 x PP 2's and TP 2 x EP 2's checkpoints at one rank
        # each expert's fc2 [hidden, ffn] as the ranks wrote it: halves of the ffn columns when the experts
        # are split over the TP group (ETP 2), whole when every TP rank holds them (ETP 1)
        ffn = AutoConfig.from_pretrained(model_dir).moe_intermediate_size
        assert _expert_fc2_widths(ckpt) == {ffn // EXPERT_TP.get(layout, 1)}
        *_, (s_loaded, o_loaded) = _train_two_rollouts(model_dir, tmp_path, _moe_batch(model_dir, replay), 1, 4, [],
                                                       load=ckpt)
        assert_states_close(s_loaded, s2, atol=0)
        for pname, st in o2["state"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                got = o_loaded["state"][pname][key]  # one rank pads the vocabulary to 128 rows, TP 2 to 256
                assert torch.equal(got, st[key][: got.shape[0]] if got.dim() else st[key]), (pname, key)
