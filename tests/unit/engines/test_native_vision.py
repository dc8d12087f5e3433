"""Images in prompts (a tiny random Qwen2.5-VL): the native engine's `image_data` and the FSDP
trainer's pixel inputs give the same log-probs (fp32, within 1e-5), packed or padded, with image
and text requests sharing the engine's decode batch; the vision tower trains and its weights reach
the engine; the PPO critic sees the images; bad image requests are refused with the field named."""

from __future__ import annotations

import pytest
import torch

from slime.engines.native.engine import NativeEngine
from slime.engines.protocol import GenerateInput, ProtocolError, SamplingParams, parse_generate_request
from slime.training.backend import MicroBatch
from slime.training.fsdp.backend import FSDPBackend
from slime.utils.net import LOOPBACK, free_port
from tests.helpers.args import make_args
from tests.helpers.http import post_json
from tests.helpers.native_server import native_server
from tests.helpers.vision import TEMPERATURE, prompt_ids, prompt_text, rollout, write_images


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def engine(tiny_vl_model_dir):
    e = NativeEngine(tiny_vl_model_dir, num_threads=1).start()
    yield e
    e.shutdown()


def _backend(model_dir, tmp_path, *flags):
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = make_args(model_dir, tmp_path, "--rollout-temperature", TEMPERATURE, *flags)
    return FSDPBackend(args, 0, 1, LOOPBACK, free_port())


@pytest.mark.parametrize("flags", [[], ["--disable-sequence-packing"]], ids=["packed", "padded"])
def test_engine_and_trainer_log_probs_agree_on_image_prompts(engine, images, tiny_vl_model_dir, tmp_path, flags):
    mb, engine_lp = rollout(engine, images)
    be = _backend(tiny_vl_model_dir, tmp_path, *flags)
    try:
        assert be.pack == (not flags)
        train_lp, _ = be.forward_logprobs(mb)
        diff = (train_lp - engine_lp).abs().max().item()
        print(f"max |engine - trainer| log-prob ({'padded' if flags else 'packed'}): {diff:.3g}")
        assert diff < 1e-5
        # without its images the prompt scores differently: the pixels really reach the model
        blind, _ = be.forward_logprobs(MicroBatch(mb.tokens, mb.response_lengths))
        assert (blind - engine_lp).abs().max().item() > 1e-3
    finally:
        be.close()


def test_vision_tower_trains_is_pushed_to_the_engine_and_can_be_frozen(tiny_vl_model_dir, images, tmp_path):
    engine = NativeEngine(tiny_vl_model_dir, num_threads=1).start()
    be = _backend(tiny_vl_model_dir, tmp_path / "a", "--lr", 1e-2)
    try:
        mb, _ = rollout(engine, images)
        before = {n: p.detach().clone() for n, p in be.model.named_parameters() if ".visual." in f".{n}"}
        be.train_step([mb], lambda k, lp, ent: -lp.mean())
        after = dict(be.model.named_parameters())
        assert all(not torch.equal(before[n], after[n]) for n in before if n.endswith("patch_embed.proj.weight"))
        engine.update_weights(dict(be.named_weights()), weight_version="1")
        mb, engine_lp = rollout(engine, images)
        train_lp, _ = be.forward_logprobs(mb)
        assert (train_lp - engine_lp).abs().max().item() < 1e-5
    finally:
        be.close()
        engine.shutdown()
    frozen = _backend(tiny_vl_model_dir, tmp_path / "b", "--freeze-params-name-list", "visual")
    try:
        visual = [p.requires_grad for n, p in frozen.model.named_parameters() if "visual" in n]
        assert visual and not any(visual)
        assert any(p.requires_grad for n, p in frozen.model.named_parameters() if "language_model" in n)
    finally:
        frozen.close()


def test_ppo_critic_values_see_the_images_and_train(engine, images, tiny_vl_model_dir, tmp_path):
    """The PPO critic of a VL model (its LM head replaced by a 1-output value head): values of image
    prompts, packed and padded alike, depend on the pixels; a few regression steps toward fixed
    returns lower the value loss and train the vision tower too."""
    mb, _ = rollout(engine, images)
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = make_args(tiny_vl_model_dir, tmp_path, "--advantage-estimator", "ppo", "--critic-lr", 1e-4)
    critic = FSDPBackend(args, 0, 1, LOOPBACK, free_port(), value_head=True)
    try:
        assert critic.pack and critic.model.get_output_embeddings().out_features == 1
        values = critic.forward_values(mb)
        assert values.shape == (sum(mb.response_lengths),)
        critic.pack = False
        torch.testing.assert_close(critic.forward_values(mb), values, atol=1e-5, rtol=1e-5)
        critic.pack = True
        blind = critic.forward_values(MicroBatch(mb.tokens, mb.response_lengths))
        image_rows = torch.cat([torch.full((n,), imgs is not None) for n, imgs in zip(mb.response_lengths, mb.images)])
        assert (blind - values)[image_rows].abs().min() > 1e-4  # every image prompt's values move without it
        torch.testing.assert_close(blind[~image_rows], values[~image_rows], atol=1e-5, rtol=1e-5)

        returns = image_rows.float() * 2 - 1  # +1 on the image prompts' tokens, -1 on the text prompt's
        patch = next(p for n, p in critic.model.named_parameters() if n.endswith("patch_embed.proj.weight"))
        before = patch.detach().clone()
        losses = []
        for _ in range(4):
            losses.append(float(((critic.forward_values(mb) - returns) ** 2).mean()))
            critic.train_step([mb], lambda k, v, ent: ((v - returns) ** 2).mean())
        print("value loss per step:", [round(x, 4) for x in losses])
        assert losses[-1] < 0.5 * losses[0], losses
        assert not torch.equal(patch.detach(), before)
    finally:
        critic.close()


def test_bad_image_requests_name_the_field(engine, images, tiny_model_dir, tmp_path):
    ids = prompt_ids(engine, 1, [images["red"]])
    sp = SamplingParams(max_new_tokens=2)
    cases = [
        (GenerateInput(rid="a", sampling_params=sp, input_ids=ids, image_data=[str(tmp_path / "nope.png")]),
         "nope.png: no such file"),
        (GenerateInput(rid="b", sampling_params=sp, input_ids=ids, image_data=["data:image/png;base64,aGVsbG8="]),
         "cannot decode"),
        (GenerateInput(rid="c", sampling_params=sp, input_ids=ids, image_data=[images["red"], images["red"]]),
         "image tokens"),
        (GenerateInput(rid="d", sampling_params=sp, input_ids=ids, image_data=[images["red"]], return_logprob=True,
                       logprob_start_len=0), "logprob_start_len"),
    ]
    for inp, why in cases:
        with pytest.raises(ProtocolError, match=why):
            engine.submit(inp, lambda res, err: None)
    text_engine = NativeEngine(tiny_model_dir, num_threads=1)
    with pytest.raises(ProtocolError, match="text-only"):
        text_engine.submit(GenerateInput(rid="e", sampling_params=sp, input_ids=[5, 6], image_data=[images["red"]]),
                           lambda res, err: None)
    # SGLang's forms: one image, a list, and one entry per prompt of a batch
    (one,), _ = parse_generate_request({"input_ids": [1, 2], "image_data": "x.png"})
    assert one.image_data == ["x.png"]
    batch, _ = parse_generate_request({"input_ids": [[1], [2]], "image_data": [["a.png", "b.png"], None]})
    assert [b.image_data for b in batch] == [["a.png", "b.png"], None]
    with pytest.raises(ProtocolError, match="image_data"):
        parse_generate_request({"input_ids": [[1], [2]], "image_data": ["a.png"]})


def test_http_generate_and_chat_take_images(engine, images, tiny_vl_model_dir, tmp_path):
    ids = prompt_ids(engine, 1, [images["green"]])
    want = engine.generate(ids, {"max_new_tokens": 5, "temperature": 0}, image_data=[images["green"]])
    with native_server(tiny_vl_model_dir, tmp_path / "server.log") as (url, _):
        sp = {"max_new_tokens": 5, "temperature": 0}
        by_ids = post_json(url, "/generate", {"input_ids": ids, "image_data": images["green"], "sampling_params": sp})
        by_text = post_json(url, "/generate", {"text": prompt_text(engine, 1), "image_data": [images["green"]],
                                               "sampling_params": sp})
        assert by_ids["output_ids"] == by_text["output_ids"] == want.output_ids
        assert by_text["meta_info"]["prompt_tokens"] == len(ids)
        chat = post_json(url, "/v1/chat/completions", {
            "max_tokens": 5, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": images["green"]}},
                                                      {"type": "text", "text": "what is the answer"}]}]})
        assert chat["usage"]["prompt_tokens"] == len(ids)
