"""Images in the FSDP trainer (Qwen2-VL / Qwen2.5-VL): what only the Hugging Face model needs.

The pixel inputs, image slots and padded rows' 3-D positions are the trainers' shared ones
(slime.training.vision). Here:

- packed row (the default): each sample's positions [3, n_i] concatenated into [3, 1, N]; the
  samples attend one at a time (packed_attention), the vision tower sees every image alone;
- the model's forward puts image features into the image slots only (`images_only`): an
  `<|image_pad|>` the policy generated is an ordinary token with a text position, as it was in
  the engine;
- the PPO critic of a VL model (`load_critic`).

The vision tower runs inside the model's forward, so its weights train (or stay frozen with
`--freeze-params-name-list`) like any others and reach the engines under their HF names.
"""

from __future__ import annotations

import contextlib

import torch

from slime.training.vision import IMAGE_MASK, image_grids, pixel_inputs, slots
from slime.utils.vision import VisionProcessor, load_lm, rope_index, vl_core


def load_critic(path: str, **kwargs) -> torch.nn.Module:
    """The PPO critic of a vision-language model. transformers has no token-classification class for
    the Qwen-VL family, so the critic is the model itself (`load_lm`) with its language-model head
    replaced by a fresh 1-output linear layer, what `AutoModelForTokenClassification(num_labels=1)`
    puts on a text model (`score`: weight ~ N(0, initializer_range), bias 0): the forward's `.logits`
    are then the values [B, L, 1], and the vision tower trains with the rest."""
    model = load_lm(path, **kwargs)
    text = model.config.get_text_config(decoder=True)
    lm_head = model.get_output_embeddings()
    head = torch.nn.Linear(lm_head.in_features, 1, bias=True, dtype=lm_head.weight.dtype)
    with torch.no_grad():
        head.weight.normal_(0.0, float(text.initializer_range))
        head.bias.zero_()
    model.set_output_embeddings(head)
    for config in {id(c): c for c in (model.config, text)}.values():
        config.tie_word_embeddings = False  # the value head is its own weight, never the embedding
    return model


def packed_inputs(model, processor: VisionProcessor, mb, ids: torch.Tensor, lens: list[int]) -> dict:
    """The image inputs of one packed row ids [1, N]: pixel inputs, position ids [3, 1, N], image mask."""
    pix = pixel_inputs(processor, mb.images, ids.device)
    pos, masks, start = [], [], 0
    for n, grid in zip(lens, image_grids(mb.images, pix["image_grid_thw"])):
        row = ids[:, start:start + n]
        mask = slots(model, processor, row, [grid])
        if grid is None:
            pos.append(torch.arange(n, device=ids.device).view(1, 1, n).expand(3, 1, n))
        else:
            pos.append(rope_index(model, row, grid, image_mask=mask)[0])
        masks.append(mask)
        start += n
    return {**pix, "position_ids": torch.cat(pos, -1), IMAGE_MASK: torch.cat(masks, -1)}


@contextlib.contextmanager
def images_only(model, mask: torch.Tensor | None):
    """Within it, the model's forward puts image features into the image tokens of `mask` only (the
    image slots), not into image tokens the policy generated."""
    if mask is None:
        yield
        return
    core = vl_core(model)
    original = core.get_placeholder_mask
    pad = int(core.config.image_token_id) + 1  # any id but the image token's: only the mask is read

    def prompt_placeholders(input_ids, inputs_embeds, image_features=None, video_features=None):
        if input_ids is not None:
            input_ids = torch.where(mask | (input_ids != int(core.config.image_token_id)), input_ids, pad)
        return original(input_ids, inputs_embeds=inputs_embeds, image_features=image_features,
                        video_features=video_features)

    core.get_placeholder_mask = prompt_placeholders  # an instance attribute; removed below
    try:
        yield
    finally:
        del core.get_placeholder_mask
