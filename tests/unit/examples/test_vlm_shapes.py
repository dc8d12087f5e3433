"""The synthetic visual task of examples/vlm_shapes.py loads as image prompts of the tiny VL model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from transformers import AutoTokenizer

from slime.data.dataset import load_prompts

_spec = importlib.util.spec_from_file_location("vlm_shapes", Path(__file__).parents[3] / "examples" / "vlm_shapes.py")
vlm_shapes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vlm_shapes)


def test_shapes_task_loads_with_images(tiny_vl_model_dir, tmp_path):
    train, _ = vlm_shapes.make_vlm_task(tmp_path, n_train=6, n_eval=2)
    tok = AutoTokenizer.from_pretrained(tiny_vl_model_dir)
    prompts = load_prompts(train, tok, "prompt", "label", apply_chat_template=True,
                           multimodal_keys={"image": "images"})
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert len(prompts) == 6 and all(p.label in vlm_shapes.COLOURS for p in prompts)
    assert all(len(p.images) == 1 and p.input_ids.count(pad) == 9 for p in prompts)  # 84x84: 3x3 tokens
    # two colours, 56x56 images (2x2 image tokens)
    train, _ = vlm_shapes.make_vlm_task(tmp_path / "small", n_train=16, n_eval=2, colours=2, size=56)
    small = load_prompts(train, tok, "prompt", "label", apply_chat_template=True, multimodal_keys={"image": "images"})
    assert {p.label for p in small} == {"0", "1"} and all(p.input_ids.count(pad) == 4 for p in small)
    assert len({tuple(p.input_ids) for p in small}) == 1  # the text is the same for every row


def test_shapes_task_labels_are_balanced_in_every_run_of_colours_rows(tmp_path):
    """A policy blind to the pixels scores exactly 1/colours on any batch of a multiple of `colours`
    prompts (the e2e run's 8 of 2 colours), so a higher reward is read from the images."""
    for colours in (2, 3):
        train, evaluation = vlm_shapes.make_vlm_task(tmp_path / str(colours), n_train=24, n_eval=6, colours=colours,
                                                     size=28)
        for path in (train, evaluation):
            labels = [json.loads(line)["label"] for line in path.read_text().splitlines()]
            runs = [sorted(labels[i:i + colours]) for i in range(0, len(labels), colours)]
            assert runs == [sorted(vlm_shapes.COLOURS)[:colours]] * len(runs), labels
            assert labels[:colours * 4] != sorted(vlm_shapes.COLOURS)[:colours] * 4  # each run in a random order
