#!/usr/bin/env bash
# The trainer on a machine with one NVIDIA GPU (not run in CI: it needs a GPU). Three measurements:
#
#   scripts/run_train_gpu_check.sh [HF_MODEL_DIR]
#
# 1. a short bf16 GRPO run through train.py: the quickstart's task and settings, one GPU shared by
#    the train rank and the embedded engine (--colocate), 3 rollouts; prints per rollout the step
#    time (perf/train_time), the trainer's model TFLOP/s (perf/train_model_tflops) and CUDA peak
#    (memory/train_cuda_peak_mb), the rollout time and the train-vs-engine log-prob difference;
# 2. benchmarks/train_mfu.py in bf16 and fp32 (the quickstart step over the same device's dense
#    matmul rate);
# 3. benchmarks/train_memory.py without the LoRA rows (each memory feature off and on, and what
#    the KL reference adds to the CUDA peak).
# HF_MODEL_DIR defaults to SmolLM2-135M-Instruct from slime's cache (slime/utils/pretrained.py).
# Logs and JSON lines go to $OUT (default outputs/train_gpu_check). PYTHON (default: the venv's
# python, else python3) runs everything; STEPS (default "1 2 3") picks measurements. Exit status 0
# only when every step that ran completed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/train_gpu_check}
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L || { echo "no NVIDIA GPU visible"; exit 2; }
MODEL=${1:-$($PYTHON -c "from slime.utils.pretrained import smollm2_135m_instruct as m; print(m())")}
status=0
STEPS=${STEPS:-1 2 3}

if [[ " $STEPS " == *" 1 "* ]]; then
echo "== 1. bf16 GRPO run, 3 rollouts, one GPU (--colocate)"
$PYTHON - "$OUT/task" <<'EOF'
import sys
sys.path.insert(0, "examples")
from tasks import make_quickstart_task
make_quickstart_task(sys.argv[1], n_train=512, n_eval=64, seed=0)
EOF
rm -rf "$OUT/grpo"
timeout "${GRPO_TIMEOUT:-300}" $PYTHON train.py --hf-checkpoint "$MODEL" --input-key prompt --label-key label \
  --apply-chat-template --advantage-estimator grpo --prompt-data "$OUT/task/train.jsonl" \
  --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --colocate --bf16 \
  --rollout-batch-size 8 --n-samples-per-prompt 8 --global-batch-size 64 --micro-batch-size 8 --num-rollout 3 \
  --rollout-max-response-len 48 --rollout-temperature 1.0 --lr 2e-5 --use-kl-loss --kl-loss-coef 0.001 \
  --rm-type math --rollout-shuffle --seed 1 --output-dir "$OUT/grpo" > "$OUT/grpo.log" 2>&1 || status=1
tail -n 25 "$OUT/grpo.log"
$PYTHON - "$OUT/grpo/metrics.jsonl" <<'EOF' || status=1
import json, sys
keys = ["perf/train_time", "perf/train_model_tflops", "memory/train_cuda_peak_mb", "perf/rollout_time",
        "perf/update_weights_time", "train/train_rollout_logprob_abs_diff", "rollout/raw_reward"]
rows = [r for r in map(json.loads, open(sys.argv[1])) if "perf/train_time" in r]
print("| rollout | " + " | ".join(keys) + " |")
print("|---" * (len(keys) + 1) + "|")
for i, r in enumerate(rows):
    print(f"| {i} | " + " | ".join(f"{r[k]:.4g}" if k in r else "-" for k in keys) + " |")
sys.exit(0 if len(rows) == 3 else 1)
EOF
fi

if [[ " $STEPS " == *" 2 "* ]]; then
echo "== 2. train step MFU (bf16, then fp32)"
for flags in "--bf16" ""; do
  timeout 120 $PYTHON benchmarks/train_mfu.py --model "$MODEL" --steps 5 --json "$OUT/mfu.jsonl" -- $flags \
    2>&1 | grep -v "it/s]" | tail -n 15 || status=1
done
fi

if [[ " $STEPS " == *" 3 "* ]]; then
echo "== 3. train memory"
timeout 300 $PYTHON benchmarks/train_memory.py --model "$MODEL" --json "$OUT/memory.jsonl" \
  --configs "base (fp32, full logits);--bf16;--gradient-checkpointing;chunked log-probs (1024);--optimizer-cpu-offload;all on;all on, KL loss off (no reference model)" \
  || status=1
fi
exit $status
