"""The one way tests get slime's arguments: through slime's own parser, as a user's flags would."""

from __future__ import annotations

from pathlib import Path

from slime.arguments import parse_args

DEFAULT_ROW = '{"input": "1 + 1", "label": "2"}\n'


def make_args(model_dir, tmp_path, *flags, data: str = DEFAULT_ROW, overlap_training: bool = False):
    """Parsed, validated args for the model at `model_dir`: a prompt file under `tmp_path` holding
    `data` (JSONL text), one rollout of one prompt, output under `tmp_path/out`; `flags` (strings or
    numbers) come last, so they override these defaults."""
    tmp_path = Path(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text(data)
    return parse_args(["--hf-checkpoint", str(model_dir), "--prompt-data", str(prompts), "--rollout-batch-size", "1",
                       "--num-rollout", "1", "--output-dir", str(tmp_path / "out"), *map(str, flags)],
                      overlap_training=overlap_training)
