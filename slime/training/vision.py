"""Images in a trainer (Qwen2-VL / Qwen2.5-VL), what both backends do with a micro-batch's images.

A micro-batch carries each sample's image sources (`MicroBatch.images`, what the data and the
engine saw). They are decoded by the model's image processor (slime.utils.vision) into
`pixel_values` / `image_grid_thw`: the samples' images concatenated in sample order, as the model
places their features into the image tokens in order. The 3-D rope positions come from the model's
own `get_rope_index` (`model`: any module that holds one, slime.utils.vision.vl_core).

A sample's image tokens that hold image features are its first ones, as many as its images take
(`slots`): the prompt's and those of images an environment appended in a later turn (that turn's
engine call took them as part of its prompt). An `<|image_pad|>` the policy generated after them is
an ordinary token with a text position, as it was in the engine.
"""

from __future__ import annotations

import torch

from slime.utils.vision import VisionProcessor, image_token_mask, rope_index


def has_images(images: list | None) -> bool:
    """Whether any sample of a micro-batch (its `images`: per sample a list of sources or None) has one."""
    return bool(images) and any(images)


def pixel_inputs(processor: VisionProcessor, images: list, device) -> dict:
    """{"pixel_values", "image_grid_thw"} of every sample's images, in sample order."""
    pix = processor.pixel_inputs([s for imgs in images for s in (imgs or [])])
    return {"pixel_values": pix["pixel_values"].to(device), "image_grid_thw": pix["image_grid_thw"].to(device)}


def image_grids(images: list, grid: torch.Tensor) -> list[torch.Tensor | None]:
    """Each sample's rows of the micro-batch's image_grid_thw."""
    out, k = [], 0
    for imgs in images:
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


IMAGE_MASK = "slime_image_mask"  # the key of the image-slot mask among a forward's inputs


def padded_inputs(model, processor: VisionProcessor, images: list, ids: torch.Tensor, attn: torch.Tensor) -> dict:
    """The image inputs of padded rows ids [B, T] (right padded, `attn` their mask): pixel inputs,
    position ids [3, B, T] and the image-slot mask [B, T] (under IMAGE_MASK)."""
    pix = pixel_inputs(processor, images, ids.device)
    mask = slots(model, processor, ids, image_grids(images, pix["image_grid_thw"]))
    pos, _ = rope_index(model, ids, pix["image_grid_thw"], attention_mask=attn, image_mask=mask)
    return {**pix, "position_ids": pos, IMAGE_MASK: mask}

