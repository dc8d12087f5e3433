"""What the vLLM adapter knows of the model's vocabulary without vLLM: its size (config.json) and
each token's text (the checkpoint's tokenizer, loaded on first use: only requests that want texts
of log-prob tokens vLLM names by id need it)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from transformers import AutoTokenizer


def vocab_size(model_path: str) -> int | None:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(v) if v else None


class TokenTexts:
    """`token_texts(ids)`: the text of each token decoded alone (SGLang's `return_text_in_logprobs`)."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self._tokenizer = None
        self._lock = threading.Lock()

    def __call__(self, ids: list[int]) -> list[str]:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return [self._tokenizer.decode([t]) for t in ids]
