"""A synthetic visual task for vision-language RL (docs/vlm.md): the colour of a shape.

Each row's image is a shape (circle, square or triangle) drawn with Pillow in one of the first
`--colours` of four colours (0 red, 1 green, 2 blue, 3 yellow: digits, so the tiny model's
word-level vocabulary can answer) at a random place and size; the prompt (the same for every row)
asks for the colour's digit, scored by `--rm-type math`. The text alone never tells the colour, and
the labels are balanced: a policy that does not look at the pixels scores 1/colours.

GRPO on it with the tiny random Qwen2.5-VL learns to read the colour (tests/e2e/test_vlm.py runs this;
docs/vlm.md has the figures):

    python -m slime.utils.tiny_model /tmp/tiny_vl --vl     # or a real Qwen2.5-VL checkpoint
    python examples/vlm_shapes.py /tmp/vlm_task --colours 2 --size 84   # images/, train.jsonl, eval.jsonl
    python train.py --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \\
        --hf-checkpoint /tmp/tiny_vl --prompt-data /tmp/vlm_task/train.jsonl --input-key prompt --label-key label \\
        --apply-chat-template --multimodal-keys '{"image": "images"}' --rm-type math --advantage-estimator grpo \\
        --rollout-batch-size 8 --n-samples-per-prompt 8 --global-batch-size 64 --micro-batch-size 64 \\
        --num-rollout 56 --rollout-max-response-len 1 --rollout-temperature 1.0 --lr 1e-3 --seed 1 \\
        --eval-prompt-data shapes /tmp/vlm_task/eval.jsonl --n-samples-per-eval-prompt 8 --eval-interval 56 \\
        --output-dir /tmp/vlm_out

examples/vlm_multiturn.py is a custom generate function on this task in which the environment shows
a second image after the model's first answer.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"0": (220, 30, 30), "1": (30, 180, 30), "2": (30, 60, 220), "3": (230, 210, 20)}
SHAPES = ("circle", "square", "triangle")
PROMPT = "<image> what number is the answer ?"  # the same for every row: the colour is in the pixels only


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


def make_vlm_task(out_dir: str | Path, n_train: int = 64, n_eval: int = 16, seed: int = 0, colours: int = 4,
                  size: int = 84) -> tuple[Path, Path]:
    """Write `images/*.png`, `train.jsonl` and `eval.jsonl` (image paths relative to the files): the
    first `colours` colours of COLOURS, `size`x`size` images. The labels are balanced: each run of
    `colours` rows has every label once, so a policy blind to the pixels scores 1/colours on any
    run of them (a batch of a multiple of `colours` prompts)."""
    labels = sorted(COLOURS)[:colours]
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for name, n in (("train.jsonl", n_train), ("eval.jsonl", n_eval)):
        with open(out_dir / name, "w") as f:
            block: list[str] = []
            for i in range(n):
                if not block:  # every `colours` rows hold each label once, in a random order
                    block = rng.sample(labels, len(labels))
                label, shape = block.pop(), rng.choice(SHAPES)
                image = f"images/{name.split('.')[0]}_{i}.png"
                draw(shape, COLOURS[label], rng, size).save(out_dir / image)
                row = {"prompt": PROMPT, "images": [image], "label": label}
                f.write(json.dumps(row) + "\n")
    return out_dir / "train.jsonl", out_dir / "eval.jsonl"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--colours", type=int, default=4, choices=range(1, len(COLOURS) + 1),
                        help="how many colours (labels 0..colours-1)")
    parser.add_argument("--size", type=int, default=84, help="image side in pixels (84: 9 image tokens)")
    a = parser.parse_args()
    print(*make_vlm_task(a.out_dir, seed=a.seed, colours=a.colours, size=a.size))
