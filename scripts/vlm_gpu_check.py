"""Images on a CUDA device (not run in CI: it needs a GPU): the native engine serves a tiny random
Qwen2.5-VL with image prompts on the GPU, and a plain Hugging Face forward of the same model on the
same device scores the engine's tokens. Prints, per dtype, the largest |engine - HF| log-prob
difference over a batch that mixes 1-image, 2-image and text-only prompts, the engine's wall time,
and whether the images reach the model (the same tokens scored without them differ).

    python scripts/vlm_gpu_check.py [--work DIR]

Needs only torch, transformers, tokenizers and Pillow (no Ray). Exit status 0 when fp32 agrees
within 1e-4 and bf16 within 0.1.
"""

from __future__ import annotations

import argparse
import io
import sys
import threading
import time
from pathlib import Path

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slime.engines.native.engine import NativeEngine  # noqa: E402
from slime.engines.protocol import GenerateInput, SamplingParams  # noqa: E402
from slime.utils.tiny_model import build_tiny_vl_model  # noqa: E402
from slime.utils.vision import load_lm  # noqa: E402

TEMPERATURE = 0.8


def png(color, size) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def prompt(engine, n_images: int, sources):
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": "what is the answer"}]
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)
    return engine.vision.encode(text, sources)[0] if sources else \
        engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def generate(engine, requests):
    results, done = [None] * len(requests), threading.Semaphore(0)
    for k, (ids, imgs, seed) in enumerate(requests):
        sp = SamplingParams(max_new_tokens=16, temperature=TEMPERATURE, seed=seed, ignore_eos=True)

        def cb(res, err, k=k):
            results[k] = err or res
            done.release()
        engine.submit(GenerateInput(rid=f"r{k}", sampling_params=sp, input_ids=ids, image_data=imgs), cb)
    for _ in requests:
        assert done.acquire(timeout=300)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@torch.no_grad()
def hf_log_probs(model, vision, ids, out_ids, sources, device, use_images=True):
    """Hugging Face's own forward (its placeholder mask and rope positions) of prompt + response."""
    full = torch.tensor([ids + out_ids], device=device)
    kw = {}
    if sources and use_images:
        pix = vision.pixel_inputs(sources)
        # mm_token_type_ids: what Qwen's processor hands the forward (1 = an image token of the prompt);
        # without it the forward gives every token a plain text position
        mm = (full == vision.image_token_id).int()
        mm[:, len(ids):] = 0
        kw = dict(pixel_values=pix["pixel_values"].to(device, model.dtype),
                  image_grid_thw=pix["image_grid_thw"].to(device), mm_token_type_ids=mm)
    elif sources:  # the same tokens without the pixels: image tokens become ordinary tokens
        full = full.clone()
        full[full == vision.image_token_id] = vision.tokenizer.pad_token_id or 0
    logits = model(input_ids=full, **kw).logits[0].float() / TEMPERATURE
    lp = torch.log_softmax(logits, -1)
    n = len(ids)
    return lp[n - 1 : n - 1 + len(out_ids)].gather(-1, torch.tensor(out_ids, device=device)[:, None])[:, 0].cpu()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="outputs/vlm_gpu_check")
    ap.add_argument("--device", default="cuda", help="cpu runs the same check without a GPU")
    ap.add_argument("--verbose", action="store_true", help="each request's difference")
    opts = ap.parse_args()
    dev = opts.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    work = Path(opts.work)
    model_dir = build_tiny_vl_model(work / "model", seed=0)
    (work / "red.png").write_bytes(png((255, 0, 0), (60, 50)))
    (work / "blue.png").write_bytes(png((0, 0, 255), (90, 40)))
    red, blue = str(work / "red.png"), "file://" + str((work / "blue.png").resolve())
    ok = True
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}")
    print("| engine dtype | requests | max abs(engine - HF) log-prob | engine wall s | without images differs by |")
    print("|---|---|---|---|---|")
    for dtype, bound in (("float32", 1e-4), ("bfloat16", 0.1)):
        engine = NativeEngine(str(model_dir), dtype=dtype, device=dev).start()
        try:
            one, two = [red], [blue, red]
            requests = [(prompt(engine, 1, one), one, 1), (prompt(engine, 1, one), one, 2),
                        (prompt(engine, 2, two), two, 3), (prompt(engine, 0, None), None, 4),
                        (prompt(engine, 2, two), two, 5)] * 4
            requests = [(ids, imgs, seed + 10 * i) for i, (ids, imgs, seed) in enumerate(requests)]
            t = time.perf_counter()
            results = generate(engine, requests)
            wall = time.perf_counter() - t
            model = load_lm(str(model_dir), dtype=getattr(torch, dtype)).to(dev).eval()
            diffs, blind, skipped = [], [], 0
            for (ids, imgs, _), r in zip(requests, results):
                if imgs and engine.vision.image_token_id in r.output_ids:
                    skipped += 1  # HF's placeholder check counts a generated image token as an image slot
                    continue
                ref = hf_log_probs(model, engine.vision, ids, list(r.output_ids), imgs, dev)
                diffs.append((ref - torch.tensor(r.output_token_logprobs)).abs().max().item())
                if opts.verbose:
                    print(len(imgs or ()), "images:", f"{diffs[-1]:.3g}")
                if imgs:
                    nb = hf_log_probs(model, engine.vision, ids, list(r.output_ids), imgs, dev, use_images=False)
                    blind.append((nb - ref).abs().max().item())
            worst = max(diffs)
            ok &= worst < bound and min(blind) > 1e-3
            print(f"| {dtype} | {len(requests) - skipped} ({skipped} with a generated image token skipped) | "
                  f"{worst:.3g} | "
                  f"{wall:.2f} | {min(blind):.3g} (min over image requests) |")
        finally:
            engine.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
