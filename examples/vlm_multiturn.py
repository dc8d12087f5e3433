"""Multi-turn images (docs/vlm.md#multi-turn-images): after the model's first reply the environment
shows it a new image and the model answers again. A custom generate function for the shapes task of
examples/vlm_shapes.py:

    python train.py ... --multimodal-keys '{"image": "images"}' --rm-type math \\
        --custom-generate-function-path examples/vlm_multiturn.py:generate

The episode: the model answers the prompt (its image); the environment appends a user turn
`<image> look again` whose image is a new drawing of the same colour (another shape, place and size,
drawn here with the row's label); the model answers again. Each model turn gets up to
--rollout-max-response-len tokens. `--rm-type math` scores the last number of the response (the
second answer when it gives one).

Tokens: the model's turns have loss mask 1 and their rollout log-probs; the user turn (chat-template
glue, the new image's expanded `<|image_pad|>` tokens, the text) has loss mask 0. `Sample.images`
becomes [the prompt's image, the new one], the order of their slots: what the engine takes with the
second turn's prompt and the trainer with every forward. A first reply that holds an `<|image_pad|>`
token ends the episode there (the engine would take it for an image slot of the next turn's prompt).
"""

from __future__ import annotations

import base64
import functools
import io
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slime.rollout.api import context, continue_sample
from slime.rollout.multiturn import env_image_tokens
from slime.types import Sample
from slime.utils.vision import VisionProcessor, load_image
from vlm_shapes import COLOURS, SHAPES, draw

LOOK_AGAIN = "look again"


@functools.lru_cache(maxsize=4)
def _processor(model_path: str) -> VisionProcessor:
    return VisionProcessor(model_path, context().tokenizer)


def second_image(sample: Sample, seed: int) -> str:
    """A new drawing of the colour of `sample.label`, as large as the prompt's image, as a data: URL."""
    if sample.label not in COLOURS:
        raise ValueError(f"vlm_multiturn: label {sample.label!r} is not a colour digit of vlm_shapes "
                         f"({sorted(COLOURS)})")
    rng = random.Random(seed)
    size = load_image(sample.images[0]).size[0]
    buf = io.BytesIO()
    draw(rng.choice(SHAPES), COLOURS[sample.label], rng, size).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    tokenizer = context().tokenizer
    params = {**sampling_params, "max_new_tokens": args.rollout_max_response_len}
    first = await continue_sample(sample, params)
    processor = _processor(args.hf_checkpoint)
    if first.finish_reason == "abort" or processor.image_token_id in first.output_ids:
        sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=False)
        sample.metadata = {**sample.metadata, "turns": 1, "last_turn": first.text}
        return sample
    seed = int(params.get("sampling_seed") or sample.index or 0)
    image = second_image(sample, seed)
    ended = bool(first.output_ids) and first.output_ids[-1] == tokenizer.eos_token_id
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": LOOK_AGAIN}]}]
    ids = env_image_tokens(tokenizer, processor, turn, [image], turn_ended=ended,
                           chat_template_kwargs=args.apply_chat_template_kwargs)
    sample.append_env_tokens(ids, images=[image])
    if params.get("sampling_seed") is not None:  # a fresh seed for the second turn
        params["sampling_seed"] = int(params["sampling_seed"]) + 1
    second = await continue_sample(sample, params)
    sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=False)
    sample.metadata = {**sample.metadata, "turns": 2, "last_turn": second.text}
    return sample
