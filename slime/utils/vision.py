"""Images for vision-language models (Qwen2-VL / Qwen2.5-VL): decoding, the processor, 3-D rope positions.

Shared by the data loader (slime.data.dataset), the native engine (slime.engines.native.vision) and
the FSDP trainer (slime.training.fsdp.vision), so that every part turns the same image source into
the same pixels, the same image tokens and the same position ids.

An image *source* is what a dataset row or a request carries, kept compact (samples store the
source, never pixels): a file path, a `file://` URL, a `data:image/...;base64,` URL, or bare
base64. `load_image` decodes one; a missing file or undecodable bytes raise `ImageError`, naming it.

A local file does not travel as its path: `inline_source` gives its bytes as a `data:` URL, which is
what the rollout client sends to the engines and what the train ranks receive, so neither an engine
nor a train rank on another machine has to see the driver's files.

`VisionProcessor` is the Qwen-VL processor's work done from the model directory's tokenizer and
image processor (`AutoImageProcessor`): pixels and grid of each image, and each `<|image_pad|>` of
a rendered prompt expanded to the image's token count (t * h * w / merge_size**2), exactly as
`Qwen2_5_VLProcessor` does. (transformers' combined processor needs torchvision for its video half;
this needs only Pillow.) `rope_index` is Hugging Face's own `get_rope_index` of the model.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import mimetypes
import re
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

IMAGE_PAD = "<|image_pad|>"
_BASE64 = re.compile(r"[A-Za-z0-9+/\s]+=*\s*")


class ImageError(ValueError):
    """An image that cannot be read; the message names it."""


def describe(src: Any, path: bool = False) -> str:
    """A short name for an image source in messages: base64 and data: URLs cut after their start; a
    `path` (or file:// URL) cut before its end, which names the file."""
    if isinstance(src, (bytes, bytearray)):
        return f"<{len(src)} bytes>"
    s = str(src)
    if len(s) <= 80:
        return s
    return f"...{s[-70:]}" if path else s[:60] + f"...({len(s)} chars)"


def image_bytes(src: Any) -> bytes:
    """The encoded bytes of an image source (path, file:// URL, data: URL, base64 or bytes)."""
    if isinstance(src, (bytes, bytearray)):
        return bytes(src)
    if isinstance(src, dict):  # OpenAI's {"url": ...} or a Parquet struct {"bytes": ..., "path": ...}
        src = src.get("url") or src.get("bytes") or src.get("path")
        return image_bytes(src)
    if not isinstance(src, str) or not src:
        raise ImageError(f"image {describe(src)}: expected a path, a file:// or data: URL, or base64")
    if src.startswith("data:"):
        head, _, payload = src.partition(",")
        if ";base64" not in head:
            raise ImageError(f"image {describe(src)}: only base64 data: URLs are supported")
        return _b64(payload, src)
    if src.startswith(("http://", "https://")):
        raise ImageError(f"image {describe(src)}: remote URLs are not fetched; give a path or base64")
    path = Path(src[len("file://"):] if src.startswith("file://") else src)
    if src.startswith("file://") or (len(src) < 4096 and path.is_file()):
        if not path.is_file():
            raise ImageError(f"image {describe(src, path=True)}: no such file")
        return path.read_bytes()
    if len(src) >= 64 and _BASE64.fullmatch(src):
        return _b64(src, src)
    if len(src) < 4096 and (path.suffix or "/" in src):
        raise ImageError(f"image {describe(src, path=True)}: no such file")
    return _b64(src, src)


def _local_file(src: str) -> Path | None:
    """The file a path or file:// URL names (None for a data: URL, base64 or a remote URL)."""
    if src.startswith("file://"):
        return Path(src[len("file://"):])
    if src.startswith(("data:", "http://", "https://")) or len(src) >= 4096:
        return None
    path = Path(src)
    return path if path.is_file() else None


@functools.lru_cache(maxsize=256)
def _file_data_url(path: str, mtime_ns: int, size: int) -> str:
    mime = mimetypes.guess_type(path)[0] or "image"
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()


def inline_source(src: Any) -> Any:
    """`src` with a local file (a path or a file:// URL) replaced by a base64 `data:` URL of its
    bytes; every other source unchanged. The n samples of a prompt share one encoding (cached by the
    file's path, modification time and size). ImageError names a file:// URL whose file is missing."""
    if not isinstance(src, str):
        return src
    path = _local_file(src)
    if path is None:
        return src
    try:
        st = path.stat()
    except OSError:
        raise ImageError(f"image {describe(src, path=True)}: no such file") from None
    return _file_data_url(str(path), st.st_mtime_ns, st.st_size)


def _b64(payload: str, src: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"image {describe(src)}: not a file path and not valid base64") from None


def load_image(src: Any) -> Image.Image:
    """The RGB image of a source; ImageError names the source when it cannot be read or decoded."""
    if isinstance(src, Image.Image):
        return src.convert("RGB")
    data = image_bytes(src)
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ImageError(f"image {describe(src)}: cannot decode ({e})") from None
    return img.convert("RGB")


def is_vision_config(config) -> bool:
    """Whether a model config is a vision-language model slime can feed images to (Qwen2-VL family)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def load_lm(path: str, **kwargs) -> torch.nn.Module:
    """The Hugging Face model of `path` with a language-model head: `AutoModelForCausalLM`, or for a
    vision-language model `AutoModelForImageTextToText` (e.g. Qwen2_5_VLForConditionalGeneration)."""
    import transformers  # here, as in VisionProcessor: the driver imports this module for its helpers only

    vision = is_vision_config(transformers.AutoConfig.from_pretrained(path))
    cls = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    return cls.from_pretrained(path, **kwargs)


def own_memory(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its parameters and buffers copied into memory this process owns, for a model that
    computes on the CPU. `load_lm` leaves them in transformers' mapping of the checkpoint's
    safetensors file: 8-byte aligned there (CPU kernels then round differently from the 64-byte
    aligned copy any sharding, memory release or resume makes) and changed if that file is rewritten."""
    for t in [*model.parameters(), *model.buffers()]:
        t.data = t.data.clone()
    return model


class VisionProcessor:
    """Images -> model inputs for a Qwen-VL model directory (its tokenizer and image processor)."""

    def __init__(self, path: str, tokenizer=None, config=None):
        import transformers  # see load_lm

        config = config or transformers.AutoConfig.from_pretrained(path)
        if not is_vision_config(config):
            raise ValueError(f"{path}: {getattr(config, 'model_type', '?')} is a text-only model")
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(path)
        self.tokenizer = tokenizer
        self.image_token_id = int(config.image_token_id)
        self.merge = int(getattr(self.image_processor, "merge_size", config.vision_config.spatial_merge_size))
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_token_id) if tokenizer else IMAGE_PAD

    def pixel_inputs(self, sources: list) -> dict[str, torch.Tensor]:
        """{"pixel_values": [patches, C*T*P*P] float, "image_grid_thw": [images, 3] long} of the images."""
        images = [load_image(s) for s in sources]
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        return [int(n) for n in (grid_thw.prod(-1) // (self.merge**2)).tolist()]

    def expand(self, text: str, grid_thw: torch.Tensor) -> str:
        """A rendered prompt with each image token repeated its image's token count."""
        counts = self.tokens_per_image(grid_thw)
        if text.count(self.image_token) != len(counts):
            raise ImageError(f"the prompt has {text.count(self.image_token)} image slots for {len(counts)} images")
        parts = text.split(self.image_token)
        return parts[0] + "".join(self.image_token * n + rest for n, rest in zip(counts, parts[1:]))

    def check_tokens(self, input_ids: list[int], grid_thw: torch.Tensor) -> None:
        """ImageError unless the prompt's image tokens are exactly the images' (already expanded)."""
        have = sum(1 for t in input_ids if t == self.image_token_id)
        want = sum(self.tokens_per_image(grid_thw))
        if have != want:
            raise ImageError(f"the prompt has {have} image tokens, its {len(grid_thw)} images need {want} "
                             f"(one {self.image_token} per image slot, expanded by the processor)")

    def encode(self, text: str, sources: list) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(expanded input ids, pixel inputs) of a rendered prompt with image slots and its images."""
        pix = self.pixel_inputs(sources)
        ids = self.tokenizer(self.expand(text, pix["image_grid_thw"]), add_special_tokens=False)["input_ids"]
        return ids, pix


def vl_core(model: torch.nn.Module) -> torch.nn.Module:
    """The submodule of a vision-language model that owns `get_rope_index` (e.g. Qwen2_5_VLModel)."""
    for m in model.modules():
        if callable(getattr(m, "get_rope_index", None)):
            return m
    raise ValueError(f"{type(model).__name__} has no get_rope_index: not a Qwen-VL model")


def image_token_mask(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: the image tokens (`<|image_pad|>`) of input_ids; which of them hold image features
    is the trainer's choice (slime.training.vision.slots)."""
    return input_ids == int(vl_core(model).config.image_token_id)


def rope_index(model: torch.nn.Module, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
               attention_mask: torch.Tensor | None = None,
               image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's 3-D (temporal, height, width) rope positions of input_ids [B, L] (the model's own
    `get_rope_index`): (position_ids [3, B, L], deltas [B, 1]); a token after the prompt at text position
    p has position p + delta. `image_mask` [B, L]: the image tokens (default: every image token)."""
    core = vl_core(model)
    if image_mask is None:
        image_mask = input_ids == int(core.config.image_token_id)
    return core.get_rope_index(input_ids, image_mask.int(), image_grid_thw=image_grid_thw,
                               attention_mask=attention_mask)


def megatron_refusal(pp: int, critic: bool, teacher: bool) -> str | None:
    """What the megatron backend does not build for a vision-language model (slime.training.megatron.vision),
    as the one line that refuses it, or None."""
    if pp > 1:
        return ("a vision-language model with --train-backend megatron needs --pipeline-model-parallel-size 1 "
                "(images through pipeline stages are not built; use --train-backend fsdp)")
    if critic:
        return ("the megatron critic of a vision-language model is not built (--advantage-estimator ppo: use "
                "--train-backend fsdp)")
    if teacher:
        return ("--opd-teacher-load with a vision-language model is not built for --train-backend megatron (use "
                "--train-backend fsdp)")
    return None
