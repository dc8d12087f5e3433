"""HF -> slime checkpoint -> HF round trip through tools/convert_to_hf.py."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[3]

SAVE = textwrap.dedent("""
    import json, socket, sys
    from slime.arguments import parse_args
    from slime.training.actor import TrainActor
    model, data, ckpt = sys.argv[1:4]
    args = parse_args(["--hf-checkpoint", model, "--prompt-data", data, "--rollout-batch-size", "1",
                       "--num-rollout", "1", "--output-dir", ckpt + "_out"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    actor = TrainActor(args, rank=0, world_size=1, master_port=port)
    actor.init()
    actor.save(ckpt + "/rollout_000000")
    open(ckpt + "/rollout_000000/meta.json", "w").write(json.dumps({"rollout_id": 0}))
    open(ckpt + "/rollout_000000/rollout_state.json", "w").write("{}")  # a checkpoint's whole layout
    open(ckpt + "/latest", "w").write("rollout_000000\\n")
    actor.shutdown()
""")


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("convert")
    data = work / "d.jsonl"
    data.write_text(json.dumps({"input": "x"}) + "\n")
    ckpt = work / "ckpt"
    ckpt.mkdir()
    subprocess.run([sys.executable, "-c", SAVE, tiny_model_dir, str(data), str(ckpt)], check=True, cwd=ROOT)
    return ckpt


def convert(*argv):
    return subprocess.run([sys.executable, "tools/convert_to_hf.py", *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True)


def test_round_trip_gives_identical_tensors(tiny_model_dir, checkpoint, tmp_path):
    out = tmp_path / "hf"
    proc = convert("--input-dir", checkpoint, "--output-dir", out)  # resolves `latest`
    assert proc.returncode == 0, proc.stderr
    original = load_file(Path(tiny_model_dir) / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    assert sorted(original) == sorted(converted)
    for name, tensor in original.items():
        assert torch.equal(tensor, converted[name]), name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == len(AutoTokenizer.from_pretrained(out))


def test_vocab_size_trims_padded_rows(checkpoint, tmp_path):
    out = tmp_path / "hf"
    proc = convert("--input-dir", checkpoint / "rollout_000000", "--output-dir", out, "--vocab-size", "60")
    assert proc.returncode == 0, proc.stderr
    assert load_file(out / "model.safetensors")["model.embed_tokens.weight"].shape[0] == 60
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 60


def test_not_a_checkpoint_is_one_clear_line(tmp_path):
    proc = convert("--input-dir", tmp_path, "--output-dir", tmp_path / "o")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"slime: error: --input-dir {tmp_path}: not a checkpoint (no meta.json) and no latest file in it"
