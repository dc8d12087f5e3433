import json
import pickle
import subprocess
import sys

import pytest

from slime.arguments import parse_args
from slime.utils.errors import SlimeConfigError
from slime.utils.threads import cpu_threads


@pytest.fixture
def base(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input": f"q{i}", "label": str(i)}) for i in range(10)) + "\n")
    return ["--hf-checkpoint", tiny_model_dir, "--prompt-data", str(data), "--output-dir", str(tmp_path / "out")]


def test_derived_values(base):
    args = parse_args(base + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                              "--global-batch-size", "8", "--num-rollout", "3"])
    assert args.num_steps_per_rollout == 2
    assert args.dp_size == 1 and args.num_engines == 1
    assert args.eps_clip_high == args.eps_clip == 0.2
    assert args.eval_temperature == args.rollout_temperature
    assert args.sglang_args == {}


def test_global_batch_defaults_to_one_step(base):
    args = parse_args(base + ["--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--num-rollout", "1"])
    assert (args.global_batch_size, args.num_steps_per_rollout) == (6, 1)


def test_batch_rule_message_shows_numbers(base):
    with pytest.raises(SlimeConfigError) as e:
        parse_args(base + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                           "--global-batch-size", "8", "--num-steps-per-rollout", "3", "--num-rollout", "1"])
    msg = str(e.value)
    assert "4 * 4 = 16" in msg and "8 * 3 = 24" in msg


def test_unknown_flag_suggests_closest(base):
    with pytest.raises(SlimeConfigError, match=r"unknown flag --rollout-batch-sise \(did you mean --rollout-batch-size\?\)"):
        parse_args(base + ["--rollout-batch-sise", "4", "--num-rollout", "1"])


def test_sglang_flags_are_collected(base):
    args = parse_args(base + ["--rollout-batch-size", "1", "--num-rollout", "1",
                              "--sglang-mem-fraction-static", "0.7", "--sglang-enable-dp-attention",
                              "--sglang-context-length=4096"])
    assert args.sglang_args == {"mem_fraction_static": "0.7", "enable_dp_attention": True, "context_length": "4096"}


def test_args_are_read_only_and_picklable(base):
    args = parse_args(base + ["--rollout-batch-size", "1", "--num-rollout", "1"])
    with pytest.raises(AttributeError, match="read-only"):
        args.lr = 1.0
    copy = pickle.loads(pickle.dumps(args))
    assert copy.rollout_batch_size == 1
    with pytest.raises(AttributeError):
        copy.lr = 1.0


def test_unpickling_args_imports_neither_torch_nor_transformers(base, tmp_path):
    """Every Ray actor unpickles `args`: the EngineServer actor, which only supervises its engine's
    process, must not pay torch's and transformers' import (about 3 CPU-s) for it. Flags that put
    slime objects into `args` (eval datasets, script flags) are on."""
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text('{"input": "q", "label": "1"}\n')
    args = parse_args(base + ["--rollout-batch-size", "1", "--num-rollout", "1",
                              "--eval-prompt-data", "probe", str(eval_data)])
    blob = tmp_path / "args.pkl"
    blob.write_bytes(pickle.dumps(args))
    code = ("import pickle, sys; a = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "print(a.rollout_batch_size, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "[]"], out.stdout + out.stderr


def test_missing_checkpoint_dir(base, tmp_path):
    argv = list(base)
    argv[1] = str(tmp_path / "nope")
    with pytest.raises(SlimeConfigError, match=r"--hf-checkpoint: directory .*nope does not exist"):
        parse_args(argv + ["--rollout-batch-size", "1", "--num-rollout", "1"])


def test_two_ranks_and_engines(base):
    args = parse_args(base + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1",
                              "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"])
    assert (args.dp_size, args.num_engines) == (2, 2)
    with pytest.raises(SlimeConfigError, match="divisible by the data-parallel size 2"):
        parse_args(base + ["--rollout-batch-size", "3", "--num-rollout", "1", "--actor-num-gpus-per-node", "2"])


def test_overlapped_training_splits_the_cpus(base, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    flags = base + ["--rollout-batch-size", "4", "--num-rollout", "1", "--actor-num-gpus-per-node", "2",
                    "--rollout-num-gpus", "6", "--rollout-num-gpus-per-engine", "2"]  # 2 ranks, 3 engines
    sync, overlapped = parse_args(flags), parse_args(flags, overlap_training=True)
    # train.py alternates generation and training: each takes every CPU
    assert cpu_threads(sync, "train") == 8
    assert cpu_threads(sync, "rollout") == 5
    # train_async.py runs both at once: 2/5 of the CPUs for 2 ranks, 3/5 for 3 engines
    assert cpu_threads(overlapped, "train") == 3
    assert cpu_threads(overlapped, "rollout") == 3
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # one rank and one engine on two cores: one thread each
    small = parse_args(base + ["--rollout-batch-size", "4", "--num-rollout", "1"], overlap_training=True)
    assert cpu_threads(small, "train") == 1
    assert cpu_threads(small, "rollout") == 1


def test_num_epoch_derives_num_rollout(base):
    args = parse_args(base + ["--rollout-batch-size", "4", "--num-epoch", "2"])
    assert args.num_rollout == 5  # 2 epochs * 10 prompts // 4


def test_eval_sets(base, tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text('{"input": "x", "label": "1"}\n')
    args = parse_args(base + ["--rollout-batch-size", "1", "--num-rollout", "1", "--eval-prompt-data", "a", str(p), "b", str(p)])
    assert args.eval_sets == {"a": str(p), "b": str(p)}
    args = parse_args(base + ["--rollout-batch-size", "1", "--num-rollout", "1", "--eval-prompt-data", str(p)])
    assert args.eval_sets == {"eval": str(p)}
    with pytest.raises(SlimeConfigError, match="NAME PATH pairs"):
        parse_args(base + ["--rollout-batch-size", "1", "--num-rollout", "1", "--eval-prompt-data", "a", str(p), "b"])


def test_debug_modes(base, tmp_path):
    common = base + ["--rollout-batch-size", "1", "--num-rollout", "2"]
    args = parse_args(common + ["--load-debug-rollout-data", str(tmp_path / "r{rollout_id}.json")])
    assert args.debug_train_only and args.num_engines == 0 and args.rollout_num_gpus == 0
    with pytest.raises(SlimeConfigError, match=r"needs \{rollout_id\} in it when --num-rollout > 1"):
        parse_args(common + ["--save-debug-rollout-data", str(tmp_path / "r.json")])
    with pytest.raises(SlimeConfigError, match="--debug-train-only needs --load-debug-rollout-data PATH"):
        parse_args(common + ["--debug-train-only"])
    with pytest.raises(SlimeConfigError, match="exclude each other"):
        parse_args(common + ["--debug-rollout-only", "--debug-train-only"])
    with pytest.raises(SlimeConfigError, match="--save/--load need train ranks"):
        parse_args(common + ["--debug-rollout-only", "--save", str(tmp_path / "c")])
