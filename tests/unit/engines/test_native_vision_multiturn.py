"""Multi-turn images (examples/vlm_multiturn.py, a tiny random Qwen2.5-VL): after the model's first reply
the environment appends a user turn holding a new image; a real native engine takes the continuing
prompt with both images, the loss masks and `Sample.images` are exact, and the FSDP trainer's
log-probs of the model's tokens equal the engine's (fp32, within 1e-5), packed or padded."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch

from slime.data.dataset import load_prompts
from slime.data.source import prompt_sample
from slime.engines.native.engine import NativeEngine
from slime.engines.native.http import submit
from slime.engines.protocol import build_generate_response, parse_generate_request
from slime.rollout import api
from slime.training.backend import MicroBatch
from slime.training.fsdp.backend import FSDPBackend
from slime.utils.hooks import load_function
from slime.utils.net import LOOPBACK, free_port
from slime.utils.vision import VisionProcessor, image_bytes, inline_source, load_image
from tests.helpers.args import make_args

EXAMPLES = Path(__file__).parents[3] / "examples"
TEMPERATURE = 0.8
TURN = 3  # tokens per model turn (ignore_eos: every turn ends by length)

_spec = importlib.util.spec_from_file_location("vlm_shapes", EXAMPLES / "vlm_shapes.py")
vlm_shapes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vlm_shapes)


class InProcessEngines:
    """The rollout's engine pool over one in-process NativeEngine: SGLang `/generate` bodies in, its
    responses out (parsed and rendered by the engine protocol's own functions); keeps both."""

    def __init__(self, engine: NativeEngine):
        self.engine, self.payloads, self.responses = engine, [], []

    async def generate(self, payload: dict) -> dict:
        (inp,), _ = parse_generate_request(payload)
        res = await submit(self.engine, inp)
        out = build_generate_response(rid=res.rid, text=res.text, output_ids=res.output_ids,
                                      finish_reason=res.finish_reason, prompt_tokens=res.prompt_tokens,
                                      weight_version=res.weight_version,
                                      output_token_logprobs=res.output_token_logprobs, return_logprob=True)
        self.payloads.append(payload)
        self.responses.append(out)
        return out


@pytest.fixture(scope="module")
def episodes(tiny_vl_model_dir, tmp_path_factory):
    """Four two-turn episodes of examples/vlm_multiturn.py on the shapes task: (samples, prompts, calls
    per sample [(payload, response), ...], args)."""
    tmp = tmp_path_factory.mktemp("vlm_multiturn")
    train, _ = vlm_shapes.make_vlm_task(tmp / "task", n_train=4, n_eval=1, colours=2, size=56, seed=1)
    engine = NativeEngine(tiny_vl_model_dir, num_threads=1).start()
    tok = engine.tokenizer
    prompts = load_prompts(train, tok, "prompt", "label", apply_chat_template=True,
                           multimodal_keys={"image": "images"})
    args = make_args(tiny_vl_model_dir, tmp, "--rollout-temperature", TEMPERATURE, "--rollout-max-response-len", TURN,
                     "--apply-chat-template", "--custom-generate-function-path",
                     f"{EXAMPLES / 'vlm_multiturn.py'}:generate")
    generate = load_function(args.custom_generate_function_path, "--custom-generate-function-path")
    samples, calls = [], []
    try:
        for i, p in enumerate(prompts):
            engines = InProcessEngines(engine)
            api.set_context(api.RolloutContext(args, tok, engines, "http://unused"))
            s = prompt_sample(p)
            s.index = i
            params = {"temperature": TEMPERATURE, "max_new_tokens": TURN, "ignore_eos": True,
                      "sampling_seed": 10 * i + 1}
            samples.append(asyncio.run(generate(args, s, params)))
            calls.append(list(zip(engines.payloads, engines.responses)))
    finally:
        api.set_context(None)
        engine.shutdown()
    return samples, prompts, calls, args


def test_env_image_turn_masks_and_images_are_exact(episodes, tiny_vl_model_dir):
    samples, prompts, calls, _ = episodes
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vl_model_dir)
    vp = VisionProcessor(tiny_vl_model_dir, tok)
    pad, eos = vp.image_token_id, tok.eos_token_id
    for s, p, ((pay1, out1), (pay2, out2)) in zip(samples, prompts, calls):
        assert s.metadata["turns"] == 2
        turn1, turn2 = out1["output_ids"], out2["output_ids"]
        assert len(turn1) == len(turn2) == TURN and pad not in turn1 + turn2
        # the env turn, built here independently: the template's text for the new user turn, its
        # image slot expanded as the processor expands a prompt's; the first turn ended by length, so
        # the end-of-turn token comes first
        text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                     {"type": "text", "text": "look again"}]}],
                                       tokenize=False, add_generation_prompt=True)
        env = [eos] + vp.encode("\n" + text, [s.images[1]])[0]
        assert env.count(pad) == 4  # a 56x56 image: 2x2 merged patches
        assert s.tokens == p.input_ids + turn1 + env + turn2
        assert s.response_length == len(turn1) + len(env) + len(turn2)
        assert s.loss_mask == [1] * TURN + [0] * len(env) + [1] * TURN
        lp1 = [lp for lp, _, _ in out1["meta_info"]["output_token_logprobs"]]
        lp2 = [lp for lp, _, _ in out2["meta_info"]["output_token_logprobs"]]
        assert s.rollout_log_probs == lp1 + [0.0] * len(env) + lp2
        # the images, in slot order: the prompt's, then the environment's new drawing of the same colour
        assert len(s.images) == 2 and s.images[0] == p.images[0] and s.images[1].startswith("data:image/png;base64,")
        colours = {c for _, c in load_image(s.images[1]).getcolors()}
        assert vlm_shapes.COLOURS[s.label] in colours
        # the engine gets every image as its bytes (a data: URL), never the driver's file path
        assert pay1["image_data"] == [inline_source(p.images[0])] and pay2["image_data"] == [
            inline_source(x) for x in s.images]
        assert pay1["image_data"][0].startswith("data:image/png;base64,")
        assert image_bytes(pay1["image_data"][0]) == Path(p.images[0]).read_bytes()
        assert pay1["input_ids"] == p.input_ids and pay2["input_ids"] == p.input_ids + turn1 + env
    assert len({s.images[1] for s in samples}) == len(samples)  # a new drawing per episode


@pytest.mark.parametrize("flags", [[], ["--disable-sequence-packing"]], ids=["packed", "padded"])
def test_trainer_log_probs_equal_the_rollouts_on_model_tokens(episodes, tiny_vl_model_dir, tmp_path, flags):
    samples, _, _, _ = episodes
    args = make_args(tiny_vl_model_dir, tmp_path, "--rollout-temperature", TEMPERATURE, *flags)
    be = FSDPBackend(args, 0, 1, LOOPBACK, free_port())
    try:
        mb = MicroBatch([s.tokens for s in samples], [s.response_length for s in samples],
                        images=[s.images for s in samples])
        train_lp, _ = be.forward_logprobs(mb)
        mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool)
        rollout = torch.tensor([lp for s in samples for lp in s.rollout_log_probs])
        assert int(mask.sum()) == 2 * TURN * len(samples)
        diff = (train_lp[mask] - rollout[mask]).abs().max().item()
        print(f"max |engine - trainer| log-prob, two-image episodes ({'padded' if flags else 'packed'}): {diff:.3g}")
        assert diff < 1e-5
        # the second image reaches the second turn only: another colour in its place changes the
        # second turn's log-probs, never the first's (it comes before the image)
        other = [[s.images[0], next(x.images[1] for x in samples if x.label != s.label)] for s in samples]
        swapped, _ = be.forward_logprobs(MicroBatch(mb.tokens, mb.response_lengths, images=other))
        first = torch.tensor([k < TURN for s in samples for k in range(s.response_length)])
        assert (swapped[first] - train_lp[first]).abs().max().item() < 1e-5
        assert (swapped[mask & ~first] - train_lp[mask & ~first]).abs().max().item() > 1e-3
    finally:
        be.close()
