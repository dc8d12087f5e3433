"""A synthetic visual task for vision-language RL (docs/vlm.md): the colour of a shape.

Each row's image is a shape (circle, square or triangle) drawn with Pillow in one of four colours
at a random place and size; the prompt asks for the colour's digit (0 red, 1 green, 2 blue,
3 yellow: digits, so the tiny model's word-level vocabulary can answer), scored by `--rm-type math`.
The text alone never tells the colour: only a policy that looks at the pixels earns the reward.

    python examples/vlm_shapes.py /tmp/vlm_task           # writes images/, train.jsonl, eval.jsonl
    python -m slime.utils.tiny_model /tmp/tiny_vl --vl    # or a real Qwen2.5-VL checkpoint
    python train.py --hf-checkpoint /tmp/tiny_vl --prompt-data /tmp/vlm_task/train.jsonl \\
        --input-key prompt --label-key label --apply-chat-template \\
        --multimodal-keys '{"image": "images"}' --rm-type math ...
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"0": (220, 30, 30), "1": (30, 180, 30), "2": (30, 60, 220), "3": (230, 210, 20)}
SHAPES = ("circle", "square", "triangle")


def draw(shape: str, colour: tuple[int, int, int], rng: random.Random, size: int = 84) -> Image.Image:
    img = Image.new("RGB", (size, size), (245, 245, 245))
    d = ImageDraw.Draw(img)
    r = rng.randint(size // 6, size // 3)
    cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
    if shape == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return img


def make_vlm_task(out_dir: str | Path, n_train: int = 64, n_eval: int = 16, seed: int = 0) -> tuple[Path, Path]:
    """Write `images/*.png`, `train.jsonl` and `eval.jsonl` (image paths relative to the files)."""
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for name, n in (("train.jsonl", n_train), ("eval.jsonl", n_eval)):
        with open(out_dir / name, "w") as f:
            for i in range(n):
                label, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
                image = f"images/{name.split('.')[0]}_{i}.png"
                draw(shape, COLOURS[label], rng).save(out_dir / image)
                row = {"prompt": "<image> what number is the answer ?", "images": [image], "label": label}
                f.write(json.dumps(row) + "\n")
    return out_dir / "train.jsonl", out_dir / "eval.jsonl"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(*make_vlm_task(a.out_dir, seed=a.seed))
