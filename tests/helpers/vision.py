"""Image prompts for the vision-language tests (the tiny random Qwen2.5-VL): three images of three
kinds of source, prompts with 0-2 image slots, and a rollout of them through the native engine
whose log-probs a trainer must reproduce."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path

import torch
from PIL import Image

from slime.engines.protocol import GenerateInput, SamplingParams
from slime.training.backend import MicroBatch

TEMPERATURE = 0.8


def png(color, size) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_images(d: Path) -> dict[str, str]:
    """{"red": a path, "blue": a file:// URL, "green": a data: URL}, of three sizes."""
    (d / "red.png").write_bytes(png((255, 0, 0), (60, 50)))
    (d / "blue.png").write_bytes(png((0, 0, 255), (90, 40)))
    green = "data:image/png;base64," + base64.b64encode(png((0, 255, 0), (56, 56))).decode()
    return {"red": str(d / "red.png"), "blue": "file://" + str(d / "blue.png"), "green": green}


def prompt_text(engine, n_images: int, words: str = "what is the answer", images_last: bool = False) -> str:
    """A rendered chat prompt with `n_images` image slots before (or with `images_last`, after) `words`."""
    content = [{"type": "image"}] * n_images
    content = [{"type": "text", "text": words}, *content] if images_last else [*content, {"type": "text", "text": words}]
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)


def prompt_ids(engine, n_images: int, sources=None, **kwargs) -> list[int]:
    text = prompt_text(engine, n_images, **kwargs)
    if sources:
        return engine.vision.encode(text, sources)[0]
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_all(engine, requests):
    """Submit every (ids, images, seed) at once (image and text rows share the decode batch)."""
    results, done = [None] * len(requests), threading.Semaphore(0)
    for k, (ids, imgs, seed) in enumerate(requests):
        sp = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, seed=seed, ignore_eos=True)

        def cb(res, err, k=k):
            results[k] = err or res
            done.release()
        engine.submit(GenerateInput(rid=f"r{k}", sampling_params=sp, input_ids=ids, image_data=imgs), cb)
    for _ in requests:
        assert done.acquire(timeout=120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def rollout(engine, images) -> tuple[MicroBatch, torch.Tensor]:
    """Five samples (one image, two images, none) as a micro-batch, and the engine's log-probs of their tokens."""
    one, two = [images["red"]], [images["blue"], images["green"]]
    requests = [(prompt_ids(engine, 1, one), one, 1), (prompt_ids(engine, 1, one), one, 2),
                (prompt_ids(engine, 2, two), two, 3), (prompt_ids(engine, 0), None, 4),
                (prompt_ids(engine, 2, two), two, 5)]
    results = generate_all(engine, requests)
    mb = MicroBatch([ids + r.output_ids for (ids, _, _), r in zip(requests, results)],
                    [len(r.output_ids) for r in results], images=[imgs for _, imgs, _ in requests])
    return mb, torch.tensor([lp for r in results for lp in r.output_token_logprobs])
