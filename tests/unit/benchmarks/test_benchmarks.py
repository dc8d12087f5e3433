"""benchmarks/decode_step.py: the record it writes is consistent (tiny model, a few steps)."""

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))


def test_decode_step_record(tmp_path):
    import decode_step

    out = tmp_path / "decode_step.json"
    rc = decode_step.main(["--model", "tiny", "--batch", "4", "--rounds", "2", "--steps", "3", "--warmup-steps", "2",
                           "--dtypes", "bfloat16", "--profile", "--json", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    # both engines hold the same context; each round advances it by --steps
    assert rec["context"][1] == rec["hf_context"]
    assert rec["context"][1] - rec["context"][0] == 2 * 3
    assert set(rec["ms_per_step"]) == {"native", "hf", "gemm", "gemm_prepacked", "native_bfloat16"}
    assert all(len(v) == 2 and min(v) > 0 for v in rec["ms_per_step_rounds"].values())
    ms = rec["ms_per_step"]
    assert rec["gemm_floor_ms"] == min(ms["gemm"], ms["gemm_prepacked"])
    assert abs(rec["max_vs_hf"] - ms["hf"] / rec["gemm_floor_ms"]) < 0.01
    # tiny model: 2 layers of q, o (128x128), k, v (128x64: one KV head) and gate, up, down
    # (128x256), plus the 128 x vocab LM head; 2 FLOPs per multiply-add, 4 rows
    from slime.utils.tiny_model import build_tokenizer

    vocab = len(build_tokenizer())
    flops = 2 * 4 * (2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256) + 128 * vocab)
    assert abs(rec["gemm_gflops"] - flops / rec["gemm_floor_ms"] / 1e6) < 0.1
    assert rec["native_profile"][0]["self_ms_per_step"] >= rec["native_profile"][-1]["self_ms_per_step"]


def test_lora_push_record(tiny_model_dir):
    """benchmarks/lora_push.py on the tiny model: the adapter push carries exactly the adapter's
    tensors (rank 4 on the 14 linear layers, fp32), the full pushes every parameter."""
    import lora_push
    import torch
    from transformers import AutoModelForCausalLM

    rows = {r["config"]: r for r in lora_push.run(tiny_model_dir, rank=4, pushes=1, threads=1)}
    full = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                           dtype=torch.float32).parameters())
    assert rows["full, tensor"]["bytes"] == rows["full, disk"]["bytes"] == rows["LoRA, merged (tensor)"]["bytes"] == full
    assert rows["LoRA, adapter"]["bytes"] == 4 * 4 * 2 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 256))
    assert rows["LoRA, adapter"]["payload_bytes"] > rows["LoRA, adapter"]["bytes"]  # + the safetensors header
    assert all(r["seconds"] > 0 for r in rows.values())


def test_train_mfu_record(tiny_model_dir, tmp_path):
    """benchmarks/train_mfu.py on the tiny model: the FLOPs it counts, the ratio and the breakdown
    are consistent with its timings."""
    import train_mfu
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path / "mfu.jsonl"
    rec = train_mfu.main(["--model", str(tiny_model_dir), "--steps", "3", "--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(rec))
    batch = train_mfu.quickstart_batch(str(tiny_model_dir))
    assert rec["tokens"] == sum(len(t) for t in batch.tokens)
    assert len(batch) == 64 and set(batch.group_indices) == set(range(8))
    assert all(8 <= r <= 48 for r in batch.response_lengths)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert rec["params"] == params
    assert rec["model_tflop"] * 1e12 == 8 * params * rec["tokens"]  # 6 (train) + 2 (the KL reference)
    assert rec["step_s"] == sorted(rec["steps_s"])[1]
    assert 0 < rec["ref_forward_s"] < rec["step_s"] and 0 < rec["optimizer_s"] < rec["step_s"]
    assert abs(rec["train_fwd_bwd_and_rest_s"] - (rec["step_s"] - rec["ref_forward_s"] - rec["optimizer_s"])) < 1e-9
    assert abs(rec["achieved_gflops"] - rec["model_tflop"] * 1e3 / rec["step_s"]) < 1e-6
    assert abs(rec["ratio"] - rec["achieved_gflops"] / rec["matmul_gflops"]) < 1e-9
    # the trainer's own perf/train_model_tflops measures the same step from inside the train call
    assert rec["logged_train_model_tflops"] * 1e3 == pytest.approx(rec["achieved_gflops"], rel=0.05)
    assert rec["device"] == "cpu" and rec["cuda_peak_mb"] is None
    # the machine is measured before every step and after the last; the ratio uses the best of these
    assert len(rec["matmul_gflops_measured"]) == 4 and rec["matmul_gflops"] == max(rec["matmul_gflops_measured"]) > 0
    # each step against the matmul rate measured just before it
    paired = [rec["model_tflop"] * 1e3 / s / r for s, r in zip(rec["steps_s"], rec["matmul_gflops_measured"])]
    assert rec["paired_ratios"] == pytest.approx(paired, rel=1e-9)
    assert rec["paired_ratio"] == pytest.approx(sorted(paired)[1], rel=1e-9)


def test_megatron_train_record(tmp_path):
    """benchmarks/megatron_train.py on a small model: its records' tokens/s and step times agree, and
    the pipeline bubble is measured for both schedule runs of the train step with the micro-batch
    count the layout implies."""
    pytest.importorskip("megatron.core")
    import statistics

    import megatron_train

    out = tmp_path / "megatron.jsonl"
    records = megatron_train.main(["--steps", "1", "--layers", "4", "--hidden", "128", "--samples", "8",
                                   "--micro-batch-size", "1", "--layouts", "megatron PP 2 x VP 2",
                                   "--json", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == json.loads(json.dumps(records))
    [vp] = records
    assert vp["step_s"] == statistics.median(vp["steps_s"]) > 0
    assert vp["tokens_per_s"] == vp["tokens"] / vp["step_s"] and vp["vs_first"] == 1.0
    assert vp["ranks"] == 2
    logprobs, train = vp["bubble"]
    assert (logprobs["kind"], train["kind"]) == ("log-probs", "train")
    # 8 samples over 2 ranks, 1 per micro-batch: 4 pipeline micro-batches of both ranks' samples
    assert logprobs["microbatches"] == train["microbatches"] == 4
    assert train["ideal"] == 1 / (2 * 4 + 1)  # interleaved: (p - 1) / (v m + p - 1)
    for p in (logprobs, train):
        assert len(p["bubble_per_stage"]) == 2 and all(0 <= b < 1 for b in p["bubble_per_stage"])


def test_startup_cpu_roles_and_sampling(tmp_path):
    """benchmarks/startup_cpu.py: each process of a run is counted under its role, Ray's renamed actor
    workers included, and the CPU of a child process that exits before the run ends is kept."""
    import startup_cpu

    roles = {
        "/venv/bin/python train.py --actor-num-nodes 1": "driver (train.py)",
        "ray::RolloutManager.generate": "RolloutManager",
        "ray::TrainActor.train": "train rank",
        "ray::EngineServer.start": "engine server actor",
        "/venv/bin/python3 -m slime.engines.native --model-path m --port 1": "engine (native)",
        "/venv/bin/python3 -m sglang_router.launch_router --port 2": "router",
        "ray::IDLE": "idle Ray workers",
        "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x": "Ray cluster",
        "ray::DashboardAgent": "Ray cluster",
    }
    assert {c: startup_cpu.role_of(c) for c in roles} == roles
    assert startup_cpu.cpu_by_role({1: ("ray::TrainActor.train", 2.0), 2: ("ray::TrainActor.init", 1.5),
                                    3: ("train.py", 0.5)}) == {"train rank": 3.5, "driver (train.py)": 0.5}

    # a parent that starts a child burning ~0.6 s of CPU, waits for it, then prints the first rollout's line
    child = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass  # slime.engines.native"
    parent = tmp_path / "train.py"
    parent.write_text("import subprocess, sys, time\n"
                      f"subprocess.run([sys.executable, '-c', {child!r}])\n"
                      "print('rollout 0 | reward=0', flush=True)\ntime.sleep(0.3)\n")
    rec = startup_cpu.run_once([sys.executable, str(parent)], env=dict(os.environ), interval=0.05)
    assert rec["returncode"] == 0
    assert 0.3 <= rec["cpu_s"]["engine (native)"] <= 1.0, rec  # the last sample can miss its final 0.05 s or more
    assert "driver (train.py)" in rec["cpu_s"]
    assert 0.5 < rec["first_rollout_s"] < rec["wall_s"], rec
