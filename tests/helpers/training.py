"""Shared code of the trainer tests: args at the tests' sampling temperature, a synthetic rollout
batch scored by a plain HF forward, an in-process train rank, state comparisons and a stub engine
that records weight pushes. (The `ray_session` fixture is in tests/unit/conftest.py.)"""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from slime.training.actor import TrainActor
from slime.types import RolloutBatch
from slime.utils.net import free_port
from tests.helpers import args as _args

TEMPERATURE = 0.8

# two optimizer steps per rollout of 8 samples, KL loss, entropy bonus, asymmetric clip
COMMON = ["--rollout-batch-size", 4, "--n-samples-per-prompt", 2, "--global-batch-size", 4,  # 2 steps
          "--lr", 1e-3, "--use-kl-loss", "--kl-loss-coef", 0.1, "--kl-loss-type", "k3",
          "--entropy-coef", 0.01, "--eps-clip", 0.2, "--eps-clip-high", 0.28, "--adam-eps", 1e-6]


def make_args(model_dir, tmp_path, *extra):
    """`tests.helpers.args.make_args` at `--rollout-temperature TEMPERATURE` (the log-probs of
    `synthetic_batch` are scored at it); `extra` comes last and overrides."""
    return _args.make_args(model_dir, tmp_path, "--rollout-temperature", TEMPERATURE, *extra,
                           data='{"input": "1 + 1"}\n')


def synthetic_batch(model_dir, n, seed=0, pad_tokens=False):
    """n samples with random prompts/responses, partial loss masks, group rewards and
    rollout log-probs computed by a plain HF forward (the engine's definition). `pad_tokens`: the
    model's pad token opens sample 0 and is the second token of sample 1 (HF's embedding gives its
    row no gradient from these positions)."""
    g = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens, lengths, masks, lps = [], [], [], []
    for i in range(n):
        p = int(torch.randint(2, 8, (1,), generator=g))
        r = int(torch.randint(1, 7, (1,), generator=g))
        toks = torch.randint(4, model.config.vocab_size, (p + r,), generator=g)
        if pad_tokens and i < 2:
            toks[i] = model.config.pad_token_id
        with torch.no_grad():
            logits = model(toks[None]).logits[0].float() / TEMPERATURE
        lp = torch.log_softmax(logits, -1)[p - 1 : p - 1 + r].gather(-1, toks[p:, None]).squeeze(-1)
        mask = [1] * r
        if r > 2:
            mask[1] = 0  # a tool token
        tokens.append(toks.tolist())
        lengths.append(r)
        masks.append(mask)
        lps.append(lp.tolist())
    rewards = torch.randn(n, generator=g).tolist()
    return RolloutBatch(tokens=tokens, response_lengths=lengths, loss_masks=masks, rewards=rewards,
                        raw_rewards=list(rewards), rollout_log_probs=lps, group_indices=[i // 2 for i in range(n)])


def local_actor(args, role: str = "actor"):
    """An initialized in-process train rank (world size 1)."""
    actor = TrainActor(args, rank=0, world_size=1, role=role, master_port=free_port())
    actor.init()
    return actor


def grads_after_train(args, batch):
    """(gradients at the optimizer step, metrics) of one `train` of a fresh local rank on `batch`
    (the last step's gradients when there are several; the metrics without timings and memory,
    `deterministic`)."""
    actor = local_actor(args)
    captured = {}
    opt = actor.backend.optimizer
    orig_step = opt.step

    def step(*a, **k):
        for name, p in actor.backend.model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            captured[name] = g.detach().clone()
        return orig_step(*a, **k)

    opt.step = step
    try:
        metrics = actor.train(0, batch)
    finally:
        actor.shutdown()
    return captured, deterministic(metrics)


def group_train(args, batch, rollouts: int = 1, optimizer: bool = False):
    """A fresh TrainGroup of `args` trained `rollouts` times on `batch` (split over its ranks): (the
    metrics of each train call, its `full_state(optimizer)`); the group is shut down after."""
    import ray

    from slime.ray.actor_group import TrainGroup

    group = TrainGroup(args)
    try:
        group.init()
        refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
        metrics = [group.train(i, refs) for i in range(rollouts)]
        return metrics, group.full_state(optimizer=optimizer)
    finally:
        group.shutdown()


def deterministic(metrics: dict) -> dict:
    """The metrics a fixed-seed step must reproduce exactly: all but timings and memory (`perf/*`,
    `memory/*`)."""
    return {k: v for k, v in metrics.items() if not k.startswith(("perf/", "memory/"))}


def initial_state(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def assert_states_close(a, b, atol, rtol=0.0):
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")


def flatten_optim(osd):
    out = {}
    for name, st in osd["state"].items():
        for k, v in st.items():
            out[f"{name}/{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


class StubEngine:
    """A tiny HTTP server that records every POST (path, query, content type, body) and answers
    success, as an engine does to /update_weights_from_tensor."""

    def __init__(self):
        self.calls = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                url = urllib.parse.urlparse(self.path)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                q = dict(urllib.parse.parse_qsl(url.query))
                outer.calls.append((url.path, q, self.headers.get("Content-Type"), body))
                out = json.dumps({"success": True, "weight_version": q.get("weight_version")}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def received(self):
        """name -> tensor over all calls, asserting each name arrives once."""
        out = {}
        for _, _, _, body in self.calls:
            for k, v in load(body).items():
                assert k not in out, f"{k} sent twice"
                out[k] = v
        return out

    def close(self):
        self.server.shutdown()
        self.server.server_close()
