"""The driver (train.py / train_async.py's own process) starts the Ray actors, parses and checks the
flags and logs the metrics. transformers, the trainer's backends, peft, torch's distributed
checkpoint and tensor packages and math-verify are imported in the processes that use them (train
ranks, the rollout manager, the engines), not in the driver: together they cost it about 3 s of CPU
at every start (5.9 -> 2.8 s for `import train`, measured 2026-11-28)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NOT_IN_THE_DRIVER = ("transformers", "peft", "math_verify", "torch.distributed.checkpoint", "torch.distributed.tensor",
                     "slime.training.fsdp.backend", "slime.training.megatron.backend", "slime.training.freeze",
                     "slime.training.lora")


@pytest.mark.parametrize("entry", ["train", "train_async"])
def test_the_driver_imports_none_of_the_trainer_stack(entry):
    code = f"import sys, {entry}; print(sorted(m for m in {NOT_IN_THE_DRIVER!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"{entry}.py's process imports {proc.stdout.strip()}"
