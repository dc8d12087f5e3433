"""Images of prompt rows (`--multimodal-keys '{"image": COLUMN}'`) for vision-language models.

A row's COLUMN holds its images: one or a list of file paths (relative ones are read from the data
file's folder), `file://` or `data:image/...;base64,` URLs, base64 strings, or (Parquet) image
structs `{"bytes": ..., "path": ...}`. A sample keeps them as sources (strings; bytes become a base64
`data:` URL), never pixels: the engine and the trainer decode them.

Placement: where the prompt's text has `<image>` markers, each becomes the next image (as many
markers as images); else the images come first in the first user message. The chat template of the
model then renders each image part as its slot (Qwen-VL: `<|vision_start|><|image_pad|><|vision_end|>`)
and the processor expands every slot to its image's token count (slime.utils.vision).
Every error is a DataError naming the row, the column and the image.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from slime.utils.errors import DataError

MARKER = "<image>"


class RowImages:
    def __init__(self, tokenizer, multimodal_keys: dict, data_path: Path):
        model = tokenizer.name_or_path
        if set(multimodal_keys) != {"image"}:
            raise DataError(f"--multimodal-keys: only images are supported (key \"image\"), "
                            f"got {sorted(multimodal_keys)}")
        # imported here: slime.utils.vision needs torch and transformers, and this module is imported
        # wherever `args` is unpickled (through slime.eval_flags), text-only runs included
        from transformers import AutoConfig
        from slime.utils.vision import VisionProcessor, is_vision_config  # (see above)

        config = AutoConfig.from_pretrained(model)
        if not is_vision_config(config):
            raise DataError(f"--multimodal-keys: {model} is a text-only model ({config.model_type}); "
                            "it takes no images")
        self.column = multimodal_keys["image"]
        self.processor = VisionProcessor(model, tokenizer, config)
        self.folder = data_path.parent

    def sources(self, where: str, row: dict) -> list[str]:
        """The row's image sources (an empty list: no images)."""
        value = row.get(self.column)
        if value is None:
            return []
        items = value if isinstance(value, list) else [value]
        return [self._source(where, i, x) for i, x in enumerate(items)]

    def _source(self, where: str, i: int, x: Any) -> str:
        if isinstance(x, dict):  # a Parquet image struct
            x = x.get("bytes") or x.get("path")
        if isinstance(x, (bytes, bytearray)):
            return "data:image;base64," + base64.b64encode(bytes(x)).decode()
        if not isinstance(x, str) or not x:
            raise DataError(f"{where}: field {self.column!r} (--multimodal-keys) image {i} must be a path, URL or "
                            f"base64 string, got {type(x).__name__}")
        local = self.folder / x
        if not x.startswith(("data:", "file://", "/")) and len(x) < 4096 and local.is_file():
            return str(local.resolve())
        return x

    def place(self, where: str, prompt: str | list[dict], n: int, apply_chat_template: bool) -> list[dict]:
        """The prompt as chat messages whose content holds the n image parts."""
        if not apply_chat_template:
            raise DataError(f"{where}: images need --apply-chat-template (the chat template places them)")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        markers = sum(m["content"].count(MARKER) for m in messages)
        if markers not in (0, n):
            raise DataError(f"{where}: the prompt has {markers} {MARKER} markers for {n} images "
                            f"(field {self.column!r})")
        if markers:
            n = 0  # every image goes where its marker is
        for m in messages:
            if markers:
                pieces = m["content"].split(MARKER)
                parts = [{"type": "text", "text": pieces[0]}]
                for piece in pieces[1:]:
                    parts += [{"type": "image"}, {"type": "text", "text": piece}]
                m["content"] = [p for p in parts if p.get("text") != ""]
            elif m["role"] == "user" and n:
                m["content"] = [{"type": "image"}] * n + [{"type": "text", "text": m["content"]}]
                n = 0
            else:
                m["content"] = [{"type": "text", "text": m["content"]}]
        if n:
            raise DataError(f"{where}: no user message to put the images of field {self.column!r} in")
        return messages

    def encode(self, where: str, text: str, images: list[str]) -> list[int]:
        """The rendered prompt's token ids with every image slot expanded (the images decoded and checked)."""
        from slime.utils.vision import ImageError  # here: see __init__

        try:
            return self.processor.encode(text, images)[0]
        except ImageError as e:
            raise DataError(f"{where}: field {self.column!r} (--multimodal-keys): {e}") from None
