#!/usr/bin/env bash
# Verify the SGLang rollout backend on a machine with NVIDIA GPUs (not run in CI: it needs a GPU).
#
#   scripts/run_sglang_gpu_check.sh [HF_MODEL_DIR]
#
# 1. installs sglang into slime's venv (skip with SKIP_INSTALL=1);
# 2. starts one SGLang server from slime's command line (sglang_command) and makes every control
#    call of SGLangControl against it: generate, pause/continue, abort, flush, release/resume
#    memory, update from disk (weights served change, weight_version moves), and, with >= 2 GPUs,
#    an NCCL broadcast update from a trainer-side group (sglang_weight_group);
# 3. runs 3 rollouts with --rollout-backend sglang without training, then a 3-rollout GRPO run.
# Without a model dir it uses slime's tiny random Llama (no download). Logs go to $OUT (default
# outputs/sglang_gpu_check). Exit status 0 only when every step passed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/sglang_gpu_check}
mkdir -p "$OUT"
. .venv/bin/activate
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 TOKENIZERS_PARALLELISM=false
nvidia-smi -L || { echo "no NVIDIA GPU visible"; exit 2; }
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  pip install --quiet sglang 2>&1 | tail -2
fi
python -c "import sglang; print('sglang', sglang.__version__)"

MODEL=${1:-}
if [ -z "$MODEL" ]; then
  MODEL="$OUT/tiny_model"
  python -c "from slime.utils.tiny_model import build_tiny_model as b; b('$MODEL', seed=0)"
fi
python - "$MODEL" > "$OUT/data.jsonl" <<'EOF'
import json, sys
for i in range(16):
    print(json.dumps({"input": f"what is {i} plus {i}", "label": str(2 * i)}))
EOF

echo "== step 2: control calls against a real SGLang server"
python - "$MODEL" "$OUT" <<'EOF'
import asyncio, subprocess, sys, time
import torch
from slime.arguments import parse_args
from slime.engines.control import AsyncEngineControl, wait_until_healthy
from slime.engines.native.weight_group import new_group
from slime.engines.sglang import broadcast_layout, sglang_command
from slime.utils.net import free_port

model, out = sys.argv[1], sys.argv[2]
# --enable-memory-saver: needed for release/resume
args = parse_args(["--hf-checkpoint", model, "--prompt-data", f"{out}/data.jsonl", "--rollout-batch-size", "1",
                   "--num-rollout", "1", "--output-dir", out, "--rollout-backend", "sglang",
                   "--sglang-enable-memory-saver", "--sglang-mem-fraction-static", "0.3",
                   "--sglang-log-level", "warning"])
port = free_port()
cmd = sglang_command(args, 0, "127.0.0.1", port)
print(" ".join(cmd), flush=True)
log = open(f"{out}/sglang_server.log", "wb")
proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
url = f"http://127.0.0.1:{port}"
ok = True


def check(name, cond):
    global ok
    ok &= bool(cond)
    print(("PASS " if cond else "FAIL ") + name, flush=True)


async def main():
    c = ctl = AsyncEngineControl(url, timeout=300)
    gen = {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                          "ignore_eos": True}, "return_logprob": True}
    first = await c.generate(gen)
    check("generate returns 8 tokens and logprobs", first["meta_info"]["completion_tokens"] == 8
          and len(first["meta_info"]["output_token_logprobs"]) == 8)
    long = asyncio.create_task(c.generate(dict(gen, rid="long", sampling_params=dict(gen["sampling_params"],
                                                                                    max_new_tokens=4000))))
    await asyncio.sleep(1.0)
    await ctl.pause("retract")
    await ctl.continue_generation()
    await ctl.abort("long")
    res = await asyncio.wait_for(long, 120)
    check("abort by rid ends the request as aborted", res["meta_info"]["finish_reason"]["type"] == "abort")
    await ctl.flush_cache()
    await ctl.release_memory()
    await ctl.resume_memory()
    again = await c.generate(gen)
    check("release/resume memory keeps the weights", again["output_ids"] == first["output_ids"])

    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    m.save_pretrained(f"{out}/perturbed")
    began = await ctl.begin_weight_update()
    await ctl.update_weights_from_disk(f"{out}/perturbed", weight_version="disk-1")
    if began:
        await ctl.end_weight_update()
    changed = await c.generate(gen)
    check("update from disk: weight_version moves", await ctl.weight_version() == "disk-1"
          and changed["meta_info"]["weight_version"] == "disk-1")
    check("update from disk: the served weights changed", changed["output_ids"] != first["output_ids"])

    if torch.cuda.device_count() >= 2:  # the trainer's end needs its own GPU for NCCL
        torch.cuda.set_device(torch.cuda.device_count() - 1)
        world, offsets = broadcast_layout(1, 1)
        mport = free_port()
        join = asyncio.create_task(ctl.init_weights_update_group("127.0.0.1", mport, offsets[0], world, "wug"))
        pg, _store = await asyncio.to_thread(new_group, "127.0.0.1", mport, 0, world, "wug", "nccl", 120)
        await join
        named = [(n, p.detach().to("cuda", torch.bfloat16)) for n, p in
                 AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).named_parameters()]
        began = await ctl.begin_weight_update()
        upd = asyncio.create_task(ctl.update_weights_from_distributed(
            [n for n, _ in named], [t.dtype for _, t in named], [list(t.shape) for _, t in named], "wug",
            weight_version="dist-1"))
        await asyncio.to_thread(lambda: [pg.broadcast(t, 0).wait() for _, t in named])
        await upd
        if began:
            await ctl.end_weight_update()
        back = await c.generate(gen)
        check("update from distributed: original weights served again",
              back["output_ids"] == first["output_ids"] and back["meta_info"]["weight_version"] == "dist-1")
    else:
        print("SKIP update from distributed (needs 2 GPUs)")
    await c.close()


try:
    wait_until_healthy(url, timeout=900, process=proc)
    asyncio.run(main())
finally:
    proc.terminate()
    proc.wait(60)
sys.exit(0 if ok else 1)
EOF

# the train rank and the SGLang engine each need a GPU (colocated SGLang is refused: its weight updates
# need CUDA-IPC handles, which slime does not produce)
PLACE="--rollout-num-gpus 1"
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
  echo "SKIP steps 3a/3b: train.py with --rollout-backend sglang needs 2 GPUs (one train rank, one engine)"
  exit 0
fi
COMMON=(--hf-checkpoint "$MODEL" --prompt-data "$OUT/data.jsonl" --label-key label --rollout-backend sglang
        --actor-num-gpus-per-node 1 --advantage-estimator grpo --rollout-batch-size 4 --n-samples-per-prompt 4
        --global-batch-size 16 --num-rollout 3 --rollout-max-response-len 32 --rm-type exact
        --sglang-log-level warning)
count_rows() {
  python -c "import sys; print(sum(1 for _ in open(sys.argv[1])))" "$1/metrics.jsonl" 2>/dev/null || echo 0
}

echo "== step 3a: 3 rollouts with --rollout-backend sglang, no training (--debug-rollout-only)"
python train.py "${COMMON[@]}" $PLACE --debug-rollout-only --output-dir "$OUT/rollout_only"
[ "$(count_rows "$OUT/rollout_only")" = 3 ] && echo "PASS 3 rollouts generated and scored" \
  || { echo "FAIL rollout-only run"; exit 1; }

echo "== step 3b: a 3-rollout GRPO run with --rollout-backend sglang (trains and pushes weights)"
if python train.py "${COMMON[@]}" $PLACE --output-dir "$OUT/grpo" && [ "$(count_rows "$OUT/grpo")" = 3 ]; then
  echo "PASS 3 rollouts trained, weights pushed to SGLang"
else
  echo "FAIL GRPO run: see docs/engines/sglang.md, 'What the trainer's push still needs for SGLang'"
  exit 1
fi
