"""A vision-language model (the tiny random Qwen2.5-VL) in the megatron backend: megatron-core's
GPTModel with multimodal rope plus the checkpoint's HF vision tower (slime/training/megatron/vision.py)
scores the engine's image rollouts as the engine did, trains like the FSDP trainer (the vision tower
included), pushes and saves under the checkpoint's HF names, resumes, and splits over TP ranks.
Skipped without megatron-core."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core")

from slime.engines.native.engine import NativeEngine  # noqa: E402
from slime.training.backend import MicroBatch  # noqa: E402
from slime.training.fsdp.backend import FSDPBackend  # noqa: E402
from slime.training.megatron.backend import MegatronBackend  # noqa: E402
from slime.types import RolloutBatch  # noqa: E402
from slime.utils.errors import SlimeConfigError  # noqa: E402
from slime.utils.net import LOOPBACK, free_port  # noqa: E402
from tests.helpers.args import make_args  # noqa: E402
from tests.helpers.training import COMMON, assert_states_close, deterministic, group_train  # noqa: E402
from tests.helpers.vision import TEMPERATURE, generate_all, prompt_ids, rollout, write_images  # noqa: E402

MEGATRON = ("--train-backend", "megatron")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def engine(tiny_vl_model_dir):
    e = NativeEngine(tiny_vl_model_dir, num_threads=1).start()
    yield e
    e.shutdown()


def _backend(cls, model_dir, tmp_path, *flags):
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = make_args(model_dir, tmp_path, "--rollout-temperature", TEMPERATURE, *flags)
    return cls(args, 0, 1, LOOPBACK, free_port())


def _loss(k, lp, ent):
    return -lp.mean()


def test_megatron_scores_image_rollouts_as_the_engine_did(engine, images, tiny_vl_model_dir, tmp_path):
    mb, engine_lp = rollout(engine, images)
    be = _backend(MegatronBackend, tiny_vl_model_dir, tmp_path, *MEGATRON)
    try:
        assert be.model.position_embedding_type == "mrope"
        train_lp, _ = be.forward_logprobs(mb)
        diff = (train_lp - engine_lp).abs().max().item()
        print(f"max |engine - megatron| log-prob: {diff:.3g}")
        assert diff < 1e-5
        # without its images the prompts score differently: the pixels really reach the model
        blind, _ = be.forward_logprobs(MicroBatch(mb.tokens, mb.response_lengths))
        assert (blind - engine_lp).abs().max().item() > 1e-3
        # the text-only sample (the 4th) scores the same either way: text positions on all three rope axes
        a, b = sum(mb.response_lengths[:3]), sum(mb.response_lengths[:4])
        torch.testing.assert_close(blind[a:b], train_lp[a:b], atol=1e-6, rtol=0)
    finally:
        be.close()


def test_megatron_trains_pushes_saves_and_resumes_like_fsdp(engine, images, tiny_vl_model_dir, tmp_path):
    """One step on image rollouts: the gradient norm and the updated model's log-probs of FSDP's, the
    vision tower moved; the weights pushed under the checkpoint's HF names (FSDP's) reproduce the
    trainer's log-probs in the engine; a save is a Qwen2.5-VL HF directory and a train state that a
    fresh backend resumes from."""
    from transformers import AutoModelForImageTextToText

    mb, _ = rollout(engine, images)
    meg = _backend(MegatronBackend, tiny_vl_model_dir, tmp_path / "m", *MEGATRON, "--lr", 1e-2)
    fsdp = _backend(FSDPBackend, tiny_vl_model_dir, tmp_path / "f", "--lr", 1e-2)
    try:
        before = {k: v.clone() for k, v in meg.named_weights()}
        norms = meg.train_step([mb], _loss), fsdp.train_step([mb], _loss)
        assert norms[0] == pytest.approx(norms[1], rel=1e-5)
        lp_meg, _ = meg.forward_logprobs(mb)
        lp_fsdp, _ = fsdp.forward_logprobs(mb)
        assert (lp_meg - lp_fsdp).abs().max().item() < 1e-5
        pushed = dict(meg.named_weights())
        assert set(pushed) == set(dict(fsdp.named_weights()))
        moved = [k for k in pushed if not torch.equal(pushed[k], before[k])]
        assert "model.visual.patch_embed.proj.weight" in moved and "model.language_model.norm.weight" in moved

        engine.update_weights(pushed, weight_version="1")
        mb2, engine_lp = rollout(engine, images)
        assert (meg.forward_logprobs(mb2)[0] - engine_lp).abs().max().item() < 1e-5

        meg.save(tmp_path / "ckpt")
        saved = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt" / "hf", dtype=torch.float32)
        assert type(saved).__name__ == "Qwen2_5_VLForConditionalGeneration"
        sd = saved.state_dict()
        assert_states_close({k: sd[k] for k in pushed}, pushed, atol=0)
        resumed = _backend(MegatronBackend, tiny_vl_model_dir, tmp_path / "r", *MEGATRON, "--lr", 1e-2)
        try:
            resumed.load(tmp_path / "ckpt")
            assert_states_close(dict(resumed.named_weights()), pushed, atol=0)
            resumed.train_step([mb2], _loss), meg.train_step([mb2], _loss)  # the AdamW moments came back too
            assert_states_close(dict(resumed.named_weights()), dict(meg.named_weights()), atol=0)
        finally:
            resumed.close()
    finally:
        fsdp.close()
        meg.close()
        engine.update_weights({k: v for k, v in before.items()}, weight_version="2")


def test_megatron_freezes_the_vision_tower_and_refuses_what_it_does_not_build(tiny_vl_model_dir, tmp_path):
    frozen = _backend(MegatronBackend, tiny_vl_model_dir, tmp_path / "a", *MEGATRON,
                      "--freeze-params-name-list", "visual")
    try:
        visual = [p.requires_grad for n, p in frozen.model.named_parameters() if n.startswith("vision.visual.")]
        assert visual and not any(visual)
        assert all(p.requires_grad for n, p in frozen.model.named_parameters() if n.startswith("decoder."))
    finally:
        frozen.close()
    keys = ("--apply-chat-template", "--multimodal-keys", json.dumps({"image": "images"}), *MEGATRON)
    for flags, why in [(("--pipeline-model-parallel-size", 2, "--actor-num-gpus-per-node", 2),
                        "needs --pipeline-model-parallel-size 1"),
                       (("--advantage-estimator", "ppo"), "megatron critic of a vision-language model"),
                       (("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", tiny_vl_model_dir),
                        "--opd-teacher-load with a vision-language model")]:
        with pytest.raises(SlimeConfigError, match=why):
            make_args(tiny_vl_model_dir, tmp_path, *keys, *flags)


def test_megatron_bf16_computes_the_vision_tower_in_bf16_with_fp32_main_copies(engine, images, tiny_vl_model_dir,
                                                                              tmp_path):
    mb, engine_lp = rollout(engine, images)
    be = _backend(MegatronBackend, tiny_vl_model_dir, tmp_path, *MEGATRON, "--bf16")
    try:
        assert {p.dtype for n, p in be.model.named_parameters() if n.startswith("vision.")} == {torch.bfloat16}
        lp, _ = be.forward_logprobs(mb)
        assert lp.dtype == torch.float32 and (lp - engine_lp).abs().max().item() < 2e-2  # 4.9e-3 (2026-11-28)
        assert 0 < be.train_step([mb], _loss) < float("inf")
        main, _ = be.full_state(optimizer=False)
        assert {v.dtype for k, v in main.items() if k.startswith("model.visual.")} == {torch.float32}
    finally:
        be.close()


# ---------------------------------------------------------------- tensor parallelism (2 CPU ranks, gloo)


def _gqa_vl_model(tiny_vl_model_dir, out):
    """The tiny Qwen2.5-VL with 4 query heads over 2 KV groups (TP 2 splits them), head_dim 32; the
    tiny model's tokenizer and image processor."""
    import shutil
    from pathlib import Path

    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    cfg = AutoConfig.from_pretrained(tiny_vl_model_dir)
    text = cfg.text_config
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 4, 2, 32
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [8, 4, 4]}
    torch.manual_seed(5)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(out)
    for f in Path(tiny_vl_model_dir).iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy2(f, Path(out) / f.name)
    return str(out)


@pytest.mark.slow
def test_tensor_and_sequence_parallel_match_one_rank(tiny_vl_model_dir, images, tmp_path, ray_session):
    """TP 2 + SP against one rank on image samples: the same metrics and weights after two AdamW steps
    (the vision tower replicated on both TP ranks; under SP each rank's half of the sequence gives half
    its gradient, summed over the TP group). (TP 2 without SP was a case here until 2026-11-28, cut for
    CI time: SP's path holds TP's and adds the split sequence.)"""
    model_dir = _gqa_vl_model(tiny_vl_model_dir, tmp_path / "gqa")
    engine = NativeEngine(model_dir, num_threads=1).start()
    try:  # long text, then the images: their tokens lie in the padded rows' second half, SP rank 1's part
        words = "what is the answer " * 10
        sources = [[images["red"]], [images["blue"], images["green"]]] * 4
        requests = [(prompt_ids(engine, len(src), src, words=words, images_last=True), src, k)
                    for k, src in enumerate(sources)]
        results = generate_all(engine, requests)
    finally:
        engine.shutdown()
    tokens = [ids + r.output_ids for (ids, _, _), r in zip(requests, results)]
    lengths = [len(r.output_ids) for r in results]
    slots = [[i for i, t in enumerate(ids) if t == engine.vision.image_token_id] for ids, _, _ in requests]
    assert min(s[-1] for s in slots) >= max(len(t) for t in tokens) // 2
    rewards = torch.randn(8, generator=torch.Generator().manual_seed(3)).tolist()
    batch = RolloutBatch(tokens=tokens, response_lengths=lengths, loss_masks=[[1] * r for r in lengths],
                         rewards=rewards, raw_rewards=list(rewards),
                         rollout_log_probs=[list(r.output_token_logprobs) for r in results],
                         group_indices=[i // 2 for i in range(8)], images=sources)
    layouts = {"one": (1, 1, 4, []), "tp2_sp": (2, 2, 2, ["--sequence-parallel", "--log-probs-chunk-size", 8])}
    results = {}
    for name, (ranks, tp, mbs_, flags) in layouts.items():
        args = make_args(model_dir, tmp_path, "--rollout-temperature", TEMPERATURE, *COMMON, *MEGATRON,
                         "--actor-num-gpus-per-node", ranks, "--tensor-model-parallel-size", tp,
                         "--micro-batch-size", mbs_, *flags)
        [metrics], (state, _) = group_train(args, batch)
        results[name] = (metrics, state)
    m1, s1 = results["one"]
    assert m1["train/train_rollout_logprob_abs_diff"] < 1e-5  # the engine's log-probs, images and all
    assert any(k.startswith("model.visual.") for k in s1)
    for name in ("tp2_sp",):
        m, s = results[name]
        for key in deterministic(m1):
            assert m[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), (name, key)
        assert_states_close(s, s1, atol=1e-5)

