"""Images in the native engine (Qwen2-VL / Qwen2.5-VL): SGLang's `image_data` on `/generate`.

A request's images are decoded and run through the model's image processor on the server's prepare
thread (`prepare`): a `text` prompt gets each image slot (`<|vision_start|><|image_pad|><|vision_end|>`)
expanded to the image's token count; an `input_ids` prompt must already hold them expanded (what
`slime.data` and the processor produce). The request then carries its pixel inputs
(`Request.pixels`).

At admission, requests with images are prefilled apart from the text ones, one prompt per forward
(n samples of one prompt share it): the Hugging Face forward with `pixel_values` /
`image_grid_thw` (the vision tower runs there) and the 3-D rope positions of the model's own
`get_rope_index`. Its KV rows then join the running batch like any other; each decode step gives an
image row the text position plus its rope delta (what HF's generate does), the same for all
three rope axes. Nothing is cached across requests or weight versions: the vision tower runs at
every prefill with the weights of that moment.

Not supported with images (refused with a clear error): prompt log-probs (`logprob_start_len`),
deterministic inference, LoRA adapters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from slime.engines.native.kv_cache import BatchKV
from slime.engines.protocol import GenerateInput, ProtocolError
from slime.utils.vision import ImageError, VisionProcessor, is_vision_config, rope_index

if TYPE_CHECKING:
    from slime.engines.native.engine import NativeEngine
    from slime.engines.native.requests import Request


def processor_of(engine: NativeEngine) -> VisionProcessor | None:
    """The image processor of a vision-language model; None for a text-only one."""
    cfg = engine.model.config
    return VisionProcessor(engine.tokenizer_path, engine.tokenizer, cfg) if is_vision_config(cfg) else None


class PreparedImages(list):
    """A request's image sources once decoded: `pixels` holds their pixel inputs."""

    pixels: dict


def prepare(engine: NativeEngine, inp: GenerateInput, name: str = "image_data") -> dict | None:
    """Pixel inputs of a request's `image_data` (None without images), computed once: `inp.image_data`
    becomes a `PreparedImages`; a `text` prompt's image slots are expanded in place. ProtocolError names
    the request field when the images cannot be used."""
    if not inp.image_data:
        return None
    if isinstance(inp.image_data, PreparedImages):
        return inp.image_data.pixels
    if engine.vision is None:
        raise ProtocolError(name, f"the model {engine.model_path} is text-only; it takes no images")
    if engine.deterministic:
        raise ProtocolError(name, "images are not supported with deterministic inference yet")
    if inp.lora_name is not None:
        raise ProtocolError(name, "images are not supported with a LoRA adapter yet")
    if inp.return_logprob and inp.logprob_start_len >= 0:
        raise ProtocolError(name, "prompt log-probs (logprob_start_len) of a prompt with images are not supported")
    try:
        pixels = engine.vision.pixel_inputs(inp.image_data)
        if inp.input_ids is None:
            inp.text = engine.vision.expand(inp.text, pixels["image_grid_thw"])
        else:
            engine.vision.check_tokens(inp.input_ids, pixels["image_grid_thw"])
    except ImageError as e:
        raise ProtocolError(name, str(e)) from None
    inp.image_data = PreparedImages(inp.image_data)
    inp.image_data.pixels = pixels
    return pixels


def image_key(r: Request) -> tuple | None:
    """What makes two requests' images the same (for prefill dedup): their sources."""
    return None if r.pixels is None else tuple(r.image_sources)


def prefill_one(engine: NativeEngine, reqs: list[Request]) -> tuple[BatchKV, torch.Tensor]:
    """The prompt with images that `reqs` share: (its KV cache row, last-position logits [1, V] float);
    each request's `rope_delta` is set."""
    prompt, pixels = reqs[0].input_ids, reqs[0].pixels
    ids = torch.tensor([prompt], dtype=torch.long, device=engine.device)
    grid = pixels["image_grid_thw"].to(engine.device)
    pos, delta = rope_index(engine.model, ids, grid)
    kv = BatchKV(1, len(prompt), engine.device)
    mask = torch.ones_like(ids)
    kv.prefill_mask(mask)
    out = engine.model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        pixel_values=pixels["pixel_values"].to(engine.device, engine.dtype),
        image_grid_thw=grid,
        past_key_values=kv.hf_cache(engine.num_layers),
        use_cache=True,
        logits_to_keep=1,
    )
    kv.advance(len(prompt))
    for r in reqs:
        r.rope_delta = int(delta.view(-1)[0])
    return kv, out.logits[:, -1, :].float()


def prefill_groups(reqs: list[Request]) -> list[list[Request]]:
    """Admitted requests in prefill groups: all text ones together, then the ones with images by prompt."""
    text = [r for r in reqs if r.pixels is None]
    groups: dict[tuple, list[Request]] = {}
    for r in reqs:
        if r.pixels is not None:
            groups.setdefault((tuple(r.input_ids), image_key(r)), []).append(r)
    return ([text] if text else []) + list(groups.values())


def decode_positions(pos: torch.Tensor, rows: list[Request]) -> torch.Tensor:
    """Position ids [B, 1] of a decode step: the text positions plus each image row's rope delta."""
    deltas = [r.rope_delta for r in rows]
    if not any(deltas):
        return pos
    return pos + torch.tensor(deltas, dtype=pos.dtype, device=pos.device).view(-1, 1)
