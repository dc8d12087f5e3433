"""Prompt rows with images (`--multimodal-keys`): sources kept compact on the prompt, slots placed by
the chat template and expanded to each image's tokens, and errors that name the row and the image."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image
from transformers import AutoTokenizer

from slime.data.dataset import load_prompts
from slime.data.source import prompt_sample
from slime.rollout.train_data import to_train_batch
from slime.types import Sample
from slime.utils.errors import DataError, SlimeConfigError
from slime.utils.vision import ImageError, describe, image_bytes, inline_source
from tests.helpers.args import make_args

KEYS = {"image": "images"}


def _png(color, size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tok(tiny_vl_model_dir):
    return AutoTokenizer.from_pretrained(tiny_vl_model_dir)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_images_from_paths_urls_and_base64(tok, tmp_path):
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    b64 = base64.b64encode(_png((0, 0, 255), (112, 56))).decode()
    rows = [
        {"q": "what colour", "images": "red.png"},  # relative to the data file
        {"q": "what <image> and <image> yes", "images": [f"file://{tmp_path}/red.png", b64]},
        {"q": [{"role": "user", "content": "no picture"}], "images": None},
    ]
    prompts = load_prompts(_write(tmp_path / "d.jsonl", rows), tok, "q", apply_chat_template=True,
                           multimodal_keys=KEYS)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    start = tok.convert_tokens_to_ids("<|vision_start|>")
    assert prompts[0].images == [str((tmp_path / "red.png").resolve())]
    assert prompts[0].input_ids.count(pad) == 4 and prompts[0].input_ids.count(start) == 1  # 56x56: 2x2 tokens
    assert prompts[1].input_ids.count(pad) == 4 + 8 and prompts[1].input_ids.count(start) == 2
    text = tok.decode(prompts[1].input_ids)
    assert text.index("what") < text.index("<|vision_start|>") < text.index(" and ") < text.rindex("yes")
    assert prompts[2].images is None and pad not in prompts[2].input_ids
    assert prompts[0].prompt == "what colour"  # the row's prompt as written
    sample = prompt_sample(prompts[1])
    assert sample.images == prompts[1].images and all(isinstance(s, str) for s in sample.images)


@pytest.mark.parametrize("images, why", [
    ("missing.png", r"d.jsonl:1: field 'images' \(--multimodal-keys\): image .*missing.png: no such file"),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), r"d.jsonl:1: .*cannot decode"),
    ("@@not base64@@", r"d.jsonl:1: .*not a file path and not valid base64"),
    ([1], r"d.jsonl:1: field 'images' \(--multimodal-keys\) image 0 must be a path"),
])
def test_bad_images_name_the_row(tok, tmp_path, images, why):
    path = _write(tmp_path / "d.jsonl", [{"q": "what colour", "images": images}])
    with pytest.raises(DataError, match=why):
        load_prompts(path, tok, "q", apply_chat_template=True, multimodal_keys=KEYS)


def test_marker_count_and_chat_template_are_checked(tok, tmp_path):
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    path = _write(tmp_path / "d.jsonl", [{"q": "<image> <image>", "images": ["red.png"]}])
    with pytest.raises(DataError, match="2 <image> markers for 1 images"):
        load_prompts(path, tok, "q", apply_chat_template=True, multimodal_keys=KEYS)
    path = _write(tmp_path / "e.jsonl", [{"q": "what colour", "images": ["red.png"]}])
    with pytest.raises(DataError, match="need --apply-chat-template"):
        load_prompts(path, tok, "q", multimodal_keys=KEYS)


def test_images_for_a_text_only_model_is_one_clear_line(tiny_model_dir, tiny_vl_model_dir, tmp_path):
    text_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = _write(tmp_path / "d.jsonl", [{"q": "what colour", "images": "red.png"}])
    with pytest.raises(DataError, match="is a text-only model \\(llama\\); it takes no images"):
        load_prompts(path, text_tok, "q", apply_chat_template=True, multimodal_keys=KEYS)
    # and at start-up, before anything runs
    with pytest.raises(SlimeConfigError, match="--multimodal-keys .* is a text-only model \\(llama\\)"):
        make_args(tiny_model_dir, tmp_path, "--apply-chat-template", "--multimodal-keys", json.dumps(KEYS))
    with pytest.raises(SlimeConfigError, match="--multimodal-keys .* needs --apply-chat-template"):
        make_args(tiny_vl_model_dir, tmp_path, "--multimodal-keys", json.dumps(KEYS))
    with pytest.raises(SlimeConfigError, match="--multimodal-keys: images are served by the native and sglang "
                                               "engines only; --rollout-backend vllm takes none"):
        make_args(tiny_vl_model_dir, tmp_path, "--apply-chat-template", "--multimodal-keys", json.dumps(KEYS),
                  "--rollout-backend", "vllm")
    args = make_args(tiny_vl_model_dir, tmp_path, "--apply-chat-template", "--multimodal-keys", json.dumps(KEYS))
    assert args.multimodal_keys == KEYS


def test_local_files_travel_as_their_bytes(tiny_vl_model_dir, tmp_path):
    """What the engines and the train ranks receive for an image: a local file (path or file:// URL)
    as a data: URL of its bytes, encoded once for the n samples of a prompt; other sources as given."""
    red = tmp_path / "red.png"
    red.write_bytes(_png((255, 0, 0)))
    url = inline_source(str(red))
    assert url.startswith("data:image/png;base64,") and image_bytes(url) == red.read_bytes()
    assert inline_source(f"file://{red}") == url
    assert inline_source(str(red)) is url  # cached: one encoding shared by every sample of the prompt
    b64 = base64.b64encode(_png((0, 0, 255))).decode()
    assert inline_source(b64) is b64 and inline_source(url) is url
    red.write_bytes(_png((0, 255, 0), (64, 56)))  # a rewritten file is read again
    assert image_bytes(inline_source(str(red))) == red.read_bytes()
    with pytest.raises(ImageError, match=r"image (file://|\.\.\.).*/missing\.png: no such file"):  # a long path
        inline_source(f"file://{tmp_path}/missing.png")  # is cut before its end, which names the file
    # the train batch: local files inlined, the samples themselves keep their paths
    args = make_args(tiny_vl_model_dir, tmp_path, "--apply-chat-template", "--multimodal-keys", json.dumps(KEYS))
    samples = [Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], reward=1.0, rollout_log_probs=[-0.5],
                      images=[str(red), b64], group_index=0, index=0),
               Sample(tokens=[1, 2, 4], response_length=1, loss_mask=[1], reward=0.0, rollout_log_probs=[-0.5],
                      group_index=0, index=1)]
    batch = to_train_batch(args, samples, None)
    assert batch.images == [[inline_source(str(red)), b64], None]
    assert samples[0].images == [str(red), b64]


def test_a_long_missing_path_is_named_by_its_end_and_base64_by_its_start(tmp_path):
    """Messages cut long sources: a path keeps the end that names the file (however long the temporary
    directory is), base64 keeps its start and says how long it was."""
    deep = tmp_path.joinpath(*["d" * 30] * 4, "nope.png")
    with pytest.raises(ImageError, match=r"^image \.\.\..*/nope\.png: no such file$"):
        image_bytes(str(deep))
    assert describe(str(deep), path=True).endswith("/nope.png") and len(describe(str(deep), path=True)) == 73
    b64 = "QUJD" * 40
    assert describe(b64) == b64[:60] + "...(160 chars)"
