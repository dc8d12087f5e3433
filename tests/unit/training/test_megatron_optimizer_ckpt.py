"""The megatron backend's distributed optimizer (`ShardedAdamW`, --use-distributed-optimizer) and
its training state in megatron's distributed checkpoint format (`dist_checkpoint.py`), on CPU (gloo).

The multi-process cases run this file's `_worker` in one process per rank (a FileStore rendezvous,
gloo bound to 127.0.0.1); `python test_megatron_optimizer_ckpt.py SCENARIO RANK WORLD DIR` runs one rank.
Skipped without megatron-core."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron.core import parallel_state as ps  # noqa: E402

from slime.training.megatron import shims  # noqa: E402
from slime.training.megatron.dist_checkpoint import load_train_state, save_train_state  # noqa: E402
from slime.training.megatron.model import build_model  # noqa: E402
from slime.training.megatron.optimizer import ShardedAdamW, assign_owners  # noqa: E402
from slime.training.megatron.weights import (  # noqa: E402
    full_mcore_state,
    global_names,
    is_tied_duplicate,
    load_hf_into,
    partition_dim,
    unshard,
)
from slime.utils.dist import gloo_at  # noqa: E402
from slime.utils.errors import SlimeConfigError  # noqa: E402
from slime.utils.net import LOOPBACK  # noqa: E402
from slime.utils.pipeline_layout import PipelineLayout  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

# (name, TP, PP, distributed optimizer) of the states saved by 2 ranks (DP = 2 / (TP x PP)) ...
SAVES = [("tp2", 2, 1, False), ("dp2_dist", 1, 1, True), ("pp2", 1, 2, False)]
# ... and where each is loaded: (saved, TP, PP, distributed optimizer, ranks)
LOADS = [
    ("tp2", 1, 1, True, 2),        # TP 2 -> TP 1 (DP 2), plain AdamW -> distributed
    ("dp2_dist", 2, 1, False, 2),  # TP 1 -> TP 2, DP 2 -> DP 1, distributed -> plain
    ("dp2_dist", 1, 1, False, 2),  # the same DP 2 without the distributed optimizer
    ("pp2", 1, 1, True, 2),        # PP 2 -> PP 1 (DP 2), distributed
    ("pp2", 2, 1, False, 2),       # PP 2 -> TP 2
    ("tp2", 1, 2, False, 2),       # TP 2 -> PP 2 (a tied embedding: the last stage's output layer is its copy)
    ("dp2_dist", 1, 2, True, 2),   # DP 2 -> PP 2, distributed
    ("tp2", 1, 1, False, 1),       # TP 2 -> one rank
    ("dp2_dist", 1, 1, True, 1),   # DP 2 -> DP 1, distributed optimizer on one rank
    ("pp2", 1, 1, False, 1),       # PP 2 -> one rank
]


# ---------------------------------------------------------------- one process (fast)


def test_owners_are_balanced_largest_first_and_deterministic():
    assert assign_owners([10, 1, 7, 3, 3], 2) == [0, 1, 1, 1, 0]  # 10 | 7 3 1 ... loads 13 / 11
    assert assign_owners([5, 5, 5], 1) == [0, 0, 0]
    assert assign_owners([4], 3) == [0]
    numels = [(i * 7919) % 1000 + 1 for i in range(200)]
    owners = assign_owners(numels, 4)
    loads = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(4)]
    assert max(loads) - min(loads) <= max(numels)
    assert owners == assign_owners(list(numels), 4)


def test_sharded_adamw_without_data_parallelism_is_adamw():
    torch.manual_seed(0)
    params = [torch.randn(8, 3), torch.randn(5)]
    mine = [p.clone().requires_grad_() for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    opt, plain = ShardedAdamW(mine, None, **HYPER), torch.optim.AdamW(ref, **HYPER)
    for _ in range(3):
        for a, b in zip(mine, ref):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        plain.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    assert all(a.grad is None for a in mine)
    assert opt.state_bytes() == 2 * 4 * sum(p.numel() for p in params) + 2 * 4  # two moments + fp32 steps


def test_load_refuses_a_directory_that_is_not_a_distributed_checkpoint(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(SlimeConfigError, match=f"--load {tmp_path}: not a megatron distributed checkpoint"):
        load_train_state(tmp_path, [], None)


# ---------------------------------------------------------------- several processes


# `python -c`: a main module without a file, so the process megatron's checkpoint writer spawns
# (a multiprocessing Manager) does not re-import this file and megatron-core with it
WORKER = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("megatron_optimizer_ckpt_worker", {str(Path(__file__))!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module._worker(*sys.argv[1:2], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
"""


def _run_ranks(scenario: str, world: int, workdir: Path, timeout: int = 240) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, scenario, str(r), str(world), str(workdir)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    assert not failed, "\n".join(f"--- rank {r} (exit {rc}):\n{outs[r][-4000:]}" for r, rc in failed)
    return outs


@pytest.mark.slow
def test_sharded_adamw_matches_adamw_over_two_ranks(tmp_path):
    outs = _run_ranks("optim", 2, tmp_path)
    print("".join(outs))


@pytest.mark.slow
def test_train_state_resumes_at_another_layout(tiny_model_dir, tmp_path):
    """Saved at TP 2, at DP 2 with the distributed optimizer and at PP 2; loaded at other layouts: the
    same full model and optimizer state (atol 0) and the same parameters after the next step."""
    _qwen3_gqa(tiny_model_dir, tmp_path / "hf")
    outs = _run_ranks("ckpt", 2, tmp_path)
    print("".join(outs))


def _qwen3_gqa(tiny_model_dir, out: Path) -> None:
    """The tiny model's shape as Qwen3 with 4 query heads over 2 KV groups (TP 2 splits them), q/k
    norms (replicated over TP) and non-trivial norm weights; a tied output layer."""
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model_dir).to_dict()
    cfg = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 32
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)


# ---------------------------------------------------------------- the ranks' side


def _init(rank: int, world: int, store: Path) -> None:
    dist.init_process_group(gloo_at(LOOPBACK), store=dist.FileStore(str(store), world), rank=rank,
                            world_size=world)


@contextlib.contextmanager
def _parallel(tp: int, pp: int = 1):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    shims.use_cpu_rng_tracker()
    try:
        yield
    finally:
        ps.destroy_model_parallel()


def _chunks(cfg, hf_state, tp: int, pp: int = 1) -> list:
    with shims.cpu_only_cuda_shims():
        model = build_model(cfg, tp=tp, layout=PipelineLayout(pp=pp))
    load_hf_into(model, hf_state, cfg, tp, ps.get_tensor_model_parallel_rank())
    return [model]


def _optimizer(chunks: list, distributed: bool):
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    opt = ShardedAdamW(params, ps.get_data_parallel_group(), **HYPER) if distributed \
        else torch.optim.AdamW(params, **HYPER)
    for g in opt.param_groups:
        g["schedule_step"] = 0  # like slime's learning-rate schedule: a count kept in the groups
    return opt


def _step(chunks: list, opt, vocab: int) -> None:
    """One AdamW step on the fixed loss sum(mask * (p^2 / 4 + p / 100)) over every parameter: its
    gradient p / 2 + 1/100 is elementwise, so the same at every layout (already "reduced" over
    DP); the padded vocabulary rows get none (as in training: they stay zero)."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    for c in chunks:
        for name, p in c.named_parameters():
            g = p.detach() * 0.5 + 0.01
            if name in VOCAB_PARAMS:
                rows = torch.arange(p.shape[0]) + tp_rank * p.shape[0]
                g[rows >= vocab] = 0
            p.grad = g
    for g in opt.param_groups:
        g["lr"] = HYPER["lr"] / (1 + g["schedule_step"])
        g["schedule_step"] += 1
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full(chunks: list, opt, vocab: int) -> dict:
    """Full model and optimizer state by whole-model megatron name (every rank), the padded
    vocabulary rows checked to be zero and cut; the groups' hyperparameters."""
    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts

    model, optim = {}, {}
    for c in chunks:  # copies: a replicated parameter comes back as the live tensor
        model.update({k: v.clone() for k, v in full_mcore_state(c, gather).items()})
    named = [(global_names(c)[n], n, p, c) for c in chunks for n, p in c.named_parameters()]
    if isinstance(opt, ShardedAdamW):
        local = opt.full_state([(g, p) for g, _, p, _ in named], all_ranks=True)
    else:
        local = {g: opt.state[p] for g, _, p, _ in named if p in opt.state}
    for g, n, p, c in named:
        if is_tied_duplicate(c, n):
            continue
        dim = partition_dim(p)
        for key, v in sorted(local.get(g, {}).items()):
            optim.setdefault(g, {})[key] = v.clone() if key == "step" or dim is None else unshard(n, gather(v), dim)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        parts: list = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(parts, (model, optim), group=ps.get_pipeline_model_parallel_group())
        for m, o in parts:
            model.update(m)
            optim.update(o)
    for name in VOCAB_PARAMS:
        for d, key in [(model, name)] + [(optim[name], k) for k in optim.get(name, {}) if k != "step"]:
            if key in d:
                assert not d[key][vocab:].any(), (name, key)
                d[key] = d[key][:vocab]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"model": model, "optim": optim, "groups": groups}


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got["groups"] == want["groups"], what
    assert set(got["model"]) == set(want["model"]), what
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), (what, k, (got["model"][k] - v).abs().max())
    assert set(got["optim"]) == set(want["optim"]) and want["optim"], what
    for k, st in want["optim"].items():
        assert set(got["optim"][k]) == {"step", "exp_avg", "exp_avg_sq"}, (what, k)
        for key, v in st.items():
            assert torch.equal(got["optim"][k][key], v), (what, k, key)


def _hf(workdir: Path, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(workdir / "hf")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    if overrides:
        return cfg, {k: v.detach() for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    hf = AutoModelForCausalLM.from_pretrained(workdir / "hf", dtype=torch.float32)
    return cfg, {k: v.detach() for k, v in hf.state_dict().items()}


def _scenario_ckpt(rank: int, world: int, workdir: Path) -> None:
    cfg, hf_state = _hf(workdir)
    vocab = cfg.vocab_size
    for name, tp, pp, distributed in SAVES:
        with _parallel(tp, pp):
            chunks = _chunks(cfg, hf_state, tp, pp)
            opt = _optimizer(chunks, distributed)
            _step(chunks, opt, vocab)
            ref = _full(chunks, opt, vocab)
            if distributed:
                plain = 2 * 4 * sum(p.numel() for c in chunks for p in c.parameters())
                print(f"rank {rank} {name}: optimizer state {opt.state_bytes()} bytes of plain AdamW's "
                      f"{plain + 4 * len(opt.params)}")
            save_train_state(workdir / name, chunks, opt, extra={"iteration": 1, "saved_as": name})
            _step(chunks, opt, vocab)
            refs = {"ref": ref, "next": _full(chunks, opt, vocab)}
            if rank == 0:
                torch.save(refs, workdir / f"{name}.ref.pt")
    dist.barrier()

    def check(saved, tp, pp, distributed):
        what = f"{saved} -> TP {tp} PP {pp} DP {dist.get_world_size() // (tp * pp)} distributed={distributed}"
        refs = torch.load(workdir / f"{saved}.ref.pt")
        with _parallel(tp, pp):
            chunks = _chunks(cfg, hf_state, tp, pp)
            opt = _optimizer(chunks, distributed)
            for g in opt.param_groups:
                g["lr"] = 123.0  # overwritten by the checkpoint's
            extra = load_train_state(workdir / saved, chunks, opt)
            assert extra == {"iteration": 1, "saved_as": saved}, what
            _assert_same(_full(chunks, opt, vocab), refs["ref"], what)
            _step(chunks, opt, vocab)
            _assert_same(_full(chunks, opt, vocab), refs["next"], what + ", next step")
        print(f"rank {rank}: {what}: identical")

    for saved, tp, pp, distributed, ranks in LOADS:
        if ranks == world:
            check(saved, tp, pp, distributed)
    dist.destroy_process_group()
    if rank != 0:
        return
    _init(0, 1, workdir / "store_one")  # rank 0 goes on alone: the one-rank layouts
    for saved, tp, pp, distributed, ranks in LOADS:
        if ranks == 1:
            check(saved, tp, pp, distributed)
    with _parallel(1):
        chunks = _chunks(cfg, hf_state, 1)
        save_train_state(workdir / "model_only", chunks, None)
        with pytest.raises(SlimeConfigError, match="has no optimizer state"):
            load_train_state(workdir / "model_only", chunks, _optimizer(chunks, False))
        assert load_train_state(workdir / "model_only", chunks, None) == {}
        other_cfg, other_state = _hf(workdir, intermediate_size=cfg.intermediate_size // 2)
        other = _chunks(other_cfg, other_state, 1)
        with pytest.raises(SlimeConfigError, match=r"linear_fc1.weight has shape .* in the checkpoint, .* in this "
                                                   r"model: it was saved from another model"):
            load_train_state(workdir / "tp2", other, _optimizer(other, False))


def _scenario_optim(rank: int, world: int, workdir: Path) -> None:
    """ShardedAdamW over 2 data-parallel ranks against torch AdamW on the same gradients."""
    torch.manual_seed(0)  # the same parameters and gradients on every rank (gradients arrive reduced)
    shapes = [(300,), (64, 32), (7, 5), (128,), (33, 17), (1,)]
    init = [torch.randn(s) for s in shapes]

    def groups(params):
        return [{"params": params[:4]}, {"params": params[4:], "lr": 3e-3, "weight_decay": 0.0}]

    mine = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = ShardedAdamW(groups(mine), dist.group.WORLD, **HYPER)
    plain = torch.optim.AdamW(groups(ref), **HYPER)

    def step(pairs, n=1):
        for _ in range(n):
            grads = [torch.randn(p.shape) for p in pairs[0][1]]
            for o, params in pairs:
                for p, g in zip(params, grads):
                    p.grad = g.clone()
                o.step()
                o.zero_grad(set_to_none=False)

    step([(opt, mine), (plain, ref)], 3)
    assert all(torch.equal(a, b) for a, b in zip(mine, ref)), [(a - b).abs().max() for a, b in zip(mine, ref)]
    assert all(not a.grad.any() for a in mine)
    # each parameter's state on its owner only; together, plain AdamW's
    owned = [i for i, p in enumerate(mine) if opt.owns(p)]
    assert {id(p) for p in opt.state} == {id(mine[i]) for i in owned} and 0 < len(owned) < len(mine)
    total = torch.tensor([opt.state_bytes()])
    dist.all_reduce(total)
    plain_bytes = sum(v.numel() * v.element_size() for st in plain.state.values() for v in st.values())
    assert int(total) == plain_bytes
    print(f"rank {rank}: owns {len(owned)} of {len(mine)} parameters, {opt.state_bytes()} of {plain_bytes} "
          "optimizer-state bytes")
    # the full state: on DP rank 0, or everywhere
    named = [(f"p{i}", p) for i, p in enumerate(mine)]
    want = {f"p{i}": plain.state[p] for i, p in enumerate(ref)}
    for all_ranks in (False, True):
        full = opt.full_state(named, all_ranks=all_ranks)
        if rank == 0 or all_ranks:
            assert set(full) == set(want)
            for k, st in want.items():
                assert set(full[k]) == set(st) and all(torch.equal(full[k][x], st[x]) for x in st), k
        else:
            assert full == {}
    # torch-format state dicts: a plain AdamW's loads into a new ShardedAdamW; a rank's own round-trips
    again = [p.detach().clone().requires_grad_() for p in mine]
    opt2 = ShardedAdamW(groups(again), dist.group.WORLD, **HYPER)
    opt2.load_state_dict(copy.deepcopy(plain.state_dict()))  # torch's load keeps the tensors it is given
    again3 = [p.detach().clone().requires_grad_() for p in mine]
    opt3 = ShardedAdamW(groups(again3), dist.group.WORLD, **HYPER)
    opt3.load_state_dict(copy.deepcopy(opt.state_dict()))
    step([(opt, mine), (plain, ref), (opt2, again), (opt3, again3)], 2)
    for params in (mine, again, again3):
        assert all(torch.equal(a, b) for a, b in zip(params, ref))
    assert opt.param_groups[1]["lr"] == 3e-3 and opt2.param_groups[1]["weight_decay"] == 0.0
    # fewer parameters than ranks: rank 1 owns none, and still steps with the group
    lone, lone_ref = init[1].clone().requires_grad_(), init[1].clone().requires_grad_()
    step([(ShardedAdamW([lone], dist.group.WORLD, **HYPER), [lone]),
          (torch.optim.AdamW([lone_ref], **HYPER), [lone_ref])], 2)
    assert torch.equal(lone, lone_ref)
    # parameters replicated over different groups (expert parallelism: each rank's own experts, the
    # dense weights over both ranks): every rank keeps its experts' whole state and never receives
    # another rank's experts; the dense weights' state is split over the two ranks as above
    own = [dist.new_group([r]) for r in range(world)][rank]  # the expert-data-parallel group of size 1
    experts = [torch.randn(40, 8) + rank for _ in range(2)]  # different on each rank
    dense = [p.clone() for p in init[:4]]
    mixed = [p.clone().requires_grad_() for p in experts + dense]
    mixed_ref = [p.clone().requires_grad_() for p in experts + dense]
    n_experts = len(experts)
    opt_mixed = ShardedAdamW(mixed, dist.group.WORLD, **HYPER,
                             dp_group_of=lambda p: own if any(p is e for e in mixed[:n_experts]) else dist.group.WORLD)
    plain_mixed = torch.optim.AdamW(mixed_ref, **HYPER)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in dense]
        expert_grads = [torch.randn(p.shape) * (rank + 1) for p in experts]  # each rank's own
        for params, o in ((mixed, opt_mixed), (mixed_ref, plain_mixed)):
            for p, gr in zip(params, expert_grads + grads):
                p.grad = gr.clone()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(mixed, mixed_ref))
    assert all(opt_mixed.owns(p) for p in mixed[:n_experts])
    assert 0 < sum(opt_mixed.owns(p) for p in mixed[n_experts:]) < len(dense)
    full = opt_mixed.full_state([(f"e{i}", p) for i, p in enumerate(mixed[:n_experts])], all_ranks=True)
    assert all(torch.equal(full[f"e{i}"]["exp_avg"], plain_mixed.state[p]["exp_avg"])
               for i, p in enumerate(mixed_ref[:n_experts]))


def _worker(scenario: str, rank: int, world: int, workdir: str) -> None:
    _init(rank, world, Path(workdir) / f"store_{scenario}")
    try:
        {"ckpt": _scenario_ckpt, "optim": _scenario_optim}[scenario](rank, world, Path(workdir))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
