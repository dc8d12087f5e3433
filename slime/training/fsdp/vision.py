"""Images in the FSDP trainer (Qwen2-VL / Qwen2.5-VL): a micro-batch's pixel inputs and 3-D positions.

A micro-batch carries each sample's image sources (`MicroBatch.images`, what the data and the
engine saw); here they are decoded by the model's image processor (slime.utils.vision) into
`pixel_values` / `image_grid_thw` (the samples' images concatenated in sample order, as the
model's forward scatters them into the image tokens in order) and the model's 3-D rope position
ids from its own `get_rope_index`, per sample:

- packed row (the default): each sample's positions [3, n_i] concatenated into [3, 1, N]; the
  samples attend one at a time (packed_attention), the vision tower sees every image alone;
- padded rows: `get_rope_index` of the [B, T] batch with its attention mask.

A sample's image tokens that hold image features are its first ones, as many as its images take
(`slots`): the prompt's and those of images an environment appended in a later turn (that turn's
engine call took them as part of its prompt). An `<|image_pad|>` the policy generated after them is
an ordinary token with a text position, as it was in the engine (`images_only`). The vision tower
runs inside the model's forward, so its weights train (or stay frozen with
`--freeze-params-name-list`) like any others and reach the engines under their HF names.
"""

from __future__ import annotations

import contextlib

import torch

from slime.utils.vision import VisionProcessor, image_token_mask, load_lm, rope_index, vl_core

IMAGE_MASK = "slime_image_mask"  # the key of the image-slot mask among a forward's inputs


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


def has_images(mb) -> bool:
    return bool(getattr(mb, "images", None)) and any(mb.images)


def _pixels(processor: VisionProcessor, mb, device) -> dict:
    sources = [s for imgs in mb.images for s in (imgs or [])]
    pix = processor.pixel_inputs(sources)
    return {"pixel_values": pix["pixel_values"].to(device), "image_grid_thw": pix["image_grid_thw"].to(device)}


def _grids(mb, grid: torch.Tensor) -> list[torch.Tensor | None]:
    """Each sample's rows of the micro-batch's image_grid_thw."""
    out, k = [], 0
    for imgs in mb.images:
        n = len(imgs or [])
        out.append(grid[k:k + n] if n else None)
        k += n
    return out


def slots(model, processor: VisionProcessor, ids: torch.Tensor, grids: list[torch.Tensor | None]) -> torch.Tensor:
    """[B, L] bool: the image tokens of rows ids [B, L] that hold image features, each row's first
    ones, as many as its images (`grids`, one per row) take."""
    mask = image_token_mask(model, ids)
    n = [sum(processor.tokens_per_image(g)) if g is not None else 0 for g in grids]
    return mask & (mask.cumsum(-1) <= torch.as_tensor(n, device=ids.device)[:, None])


def packed_inputs(model, processor: VisionProcessor, mb, ids: torch.Tensor, lens: list[int]) -> dict:
    """The image inputs of one packed row ids [1, N]: pixel inputs, position ids [3, 1, N], image mask."""
    pix = _pixels(processor, mb, ids.device)
    pos, masks, start = [], [], 0
    for n, grid in zip(lens, _grids(mb, pix["image_grid_thw"])):
        row = ids[:, start:start + n]
        mask = slots(model, processor, row, [grid])
        if grid is None:
            pos.append(torch.arange(n, device=ids.device).view(1, 1, n).expand(3, 1, n))
        else:
            pos.append(rope_index(model, row, grid, image_mask=mask)[0])
        masks.append(mask)
        start += n
    return {**pix, "position_ids": torch.cat(pos, -1), IMAGE_MASK: torch.cat(masks, -1)}


def padded_inputs(model, processor: VisionProcessor, mb, ids: torch.Tensor, attn: torch.Tensor) -> dict:
    """The image inputs of padded rows ids [B, T] (right padded, `attn` their mask)."""
    pix = _pixels(processor, mb, ids.device)
    mask = slots(model, processor, ids, _grids(mb, pix["image_grid_thw"]))
    pos, _ = rope_index(model, ids, pix["image_grid_thw"], attention_mask=attn, image_mask=mask)
    return {**pix, "position_ids": pos, IMAGE_MASK: mask}


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
