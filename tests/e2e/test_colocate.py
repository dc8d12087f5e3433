"""train.py with and without --colocate, and with several weight-sync buckets vs one: the same seed
and data reach the same parameters; a colocated run's memory really changes hands each rollout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.e2e import records, run

pytestmark = pytest.mark.e2e


def cmd(task, out, save, *extra, model=None):
    return [
        sys.executable, "train.py", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.01",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--num-rollout", "2", "--prompt-data", task["train"], "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--hf-checkpoint", model or task["model"], "--rollout-max-response-len", "4",
        "--lr", "1e-2", "--micro-batch-size", "4", "--seed", "7", "--output-dir", str(out), "--save", str(save),
        # an entropy bonus moves the weights even when no sample of the untrained model earns a reward
        "--entropy-coef", "0.01",
        *extra,
    ]


def final_params(save):
    from safetensors.torch import load_file

    return load_file(str(Path(save) / "rollout_000001" / "hf" / "model.safetensors"))


def test_colocated_and_disaggregated_reach_the_same_parameters(task, tmp_path):
    """Pushing by /dev/shm path in 64 KiB buckets while the engine and the trainer hand memory back
    and forth gives the run that broadcasts in one bucket, step for step. (The third mode, HTTP
    bodies, in bounded buckets is checked against a running engine's checksums in
    tests/unit/training/test_colocate.py::test_push_modes_reach_a_native_engine.)"""
    runs = {
        # disaggregated, default: process-group broadcast in one bucket (512MB buffer)
        "broadcast": ["--update-weights-mode", "distributed"],
        # colocated: engines release/resume, trainer offloads, weights by /dev/shm path in 64 KiB buckets
        "colocated": ["--colocate", "--update-weight-buffer-size", "64KiB"],
    }
    results = {}
    for name, extra in runs.items():
        out, save = tmp_path / name, tmp_path / f"{name}_ckpt"
        proc = run(cmd(task, out, save, *extra), OMP_NUM_THREADS="1")
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        results[name] = (records(out), final_params(save), proc.stdout)

    assert "weights by distributed" in results["broadcast"][2]
    assert "colocated; weights by disk" in results["colocated"][2]
    assert all(r["weights/buckets"] >= 10 for r in results["colocated"][0])  # ~1.2 MB in 64 KiB buckets
    assert all(r["weights/buckets"] == 1 for r in results["broadcast"][0])

    base_records, base, _ = results["broadcast"]
    init = final_params_from_hf(task["model"])
    assert max((base[k] - init[k]).abs().max().item() for k in base) > 1e-3  # training moved the weights
    recs, params, _ = results["colocated"]
    # the same samples and rewards were generated from the same weights
    assert [r["rollout/raw_reward"] for r in recs] == [r["rollout/raw_reward"] for r in base_records]
    assert [r["train/loss"] for r in recs] == pytest.approx([r["train/loss"] for r in base_records], abs=1e-6)
    assert params.keys() == base.keys()
    for k in base:
        torch.testing.assert_close(params[k], base[k], rtol=0, atol=1e-6, msg=k)


def final_params_from_hf(model_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def test_colocated_memory_changes_hands(task, tmp_path):
    """A bigger tiny model (~60 MB of fp32 weights) so the handoff stands out of the process noise:
    each rollout the engine's RSS drops when it releases its weights and KV cache and comes back
    when it resumes, and the trainer's drops by about its offloaded state while the engine generates."""
    from slime.utils.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0, hidden_size=512, num_layers=4, num_heads=8,
                             num_kv_heads=4, intermediate_size=2048)
    weights_mb = sum(t.numel() * t.element_size() for t in final_params_from_hf(model).values()) / 2**20
    assert weights_mb > 40
    out, save = tmp_path / "out", tmp_path / "ckpt"
    proc = run(cmd(task, out, save, "--colocate", model=str(model)), OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(out)
    assert len(recs) == 2
    for i, r in enumerate(recs):
        serving, released = r["memory/engine_rss_mb_serving"], r["memory/engine_rss_mb_released"]
        resumed = r["memory/engine_rss_mb_resumed"]
        assert serving - released > 0.8 * weights_mb, r  # the engine gave its weights back
        assert resumed - released > 0.8 * weights_mb, r  # ... and has them again for the next rollout
        # trainer: parameters + AdamW moments + the reference model = about 4x the weights
        assert r["memory/train_offloaded_mb"] > 3.5 * weights_mb, r
        # onloaded before training: params + reference (+ the AdamW moments from rollout 1 on, created
        # by the first step) come back; offloaded after the step they are all gone again
        freed = r["memory/train_rss_mb_training"] - r["memory/train_rss_mb_offloaded"]
        assert freed > (1.5 if i == 0 else 2.5) * weights_mb, r
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-3  # the engine served the trained weights
