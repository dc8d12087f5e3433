"""Frozen parameters and a reference that follows the policy (slime/training/freeze.py;
`--freeze-params-name-list`, `--ref-update-interval` in slime/off_policy_flags.py)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.arguments import Args, build_parser
from slime.off_policy_flags import add_off_policy_flags, validate_off_policy
from slime.training.freeze import copy_policy_into_reference, freeze_parameters, ref_update_due
from slime.utils.errors import SlimeConfigError
from slime.utils.net import free_port

ROOT = Path(__file__).resolve().parents[3]


def tiny(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def flags(model_dir, *argv):
    """Args from the real parser (the off-policy flags added when slime.arguments lacks them), with
    what slime.arguments.validate derives first, then `validate_off_policy`."""
    p = build_parser()
    if "--tis-mode" not in p._option_string_actions:
        add_off_policy_flags(p)
    args = p.parse_args(["--hf-checkpoint", model_dir, "--rollout-batch-size", "1", *map(str, argv)],
                        namespace=Args())
    args.num_steps_per_rollout = args.num_steps_per_rollout or 1
    args.loss_type = args.loss_type or "policy_loss"
    args.lora = args.lora_rank is not None or args.lora_adapter_path is not None
    validate_off_policy(args)
    return args


# ---------------------------------------------------------------- freezing


def test_freeze_parameters_by_regex(tiny_model_dir):
    model = tiny(tiny_model_dir)
    names = [n for n, _ in model.named_parameters()]
    frozen = freeze_parameters(model, ["embed_tokens", r"layers\.0\.self_attn\.(q|k)_proj"])
    assert frozen == [n for n in names if "embed_tokens" in n or n.startswith(("model.layers.0.self_attn.q_proj",
                                                                               "model.layers.0.self_attn.k_proj"))]
    assert "model.embed_tokens.weight" in frozen and "model.layers.0.self_attn.q_proj.weight" in frozen
    assert "model.layers.0.self_attn.v_proj.weight" not in frozen and "model.layers.1.self_attn.q_proj.weight" \
        not in frozen
    for n, p in model.named_parameters():
        assert p.requires_grad == (n not in frozen), n
    # an optimizer over the trainable parameters leaves the frozen ones as they were
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss.backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen), n


def test_freeze_parameters_errors_name_the_pattern(tiny_model_dir):
    model = tiny(tiny_model_dir)
    with pytest.raises(SlimeConfigError, match=r"--freeze-params-name-list 'no_such_layer' matches no parameter; "
                                               r"the names look like model\.embed_tokens\.weight"):
        freeze_parameters(model, ["embed_tokens", "no_such_layer"])
    with pytest.raises(SlimeConfigError, match=r"--freeze-params-name-list '\(': not a regular expression"):
        freeze_parameters(model, ["("])
    with pytest.raises(SlimeConfigError, match="matches every parameter: nothing would train"):
        freeze_parameters(model, ["."])
    assert all(p.requires_grad for p in model.parameters())  # an error freezes nothing


def test_freeze_flags(tiny_model_dir):
    args = flags(tiny_model_dir, "--freeze-params-name-list", "embed_tokens", r"layers\.0\.")
    assert args.freeze_params_name_list == ["embed_tokens", r"layers\.0\."]
    for argv, message in [
        (["--freeze-params-name-list", "nope"], "--freeze-params-name-list 'nope' matches no parameter"),
        (["--freeze-params-name-list", "[a-"], "--freeze-params-name-list '[a-': not a regular expression"),
        (["--freeze-params-name-list", "weight"], "--freeze-params-name-list matches every parameter"),
        (["--freeze-params-name-list", "embed", "--lora-rank", 4],
         "--freeze-params-name-list with LoRA: LoRA already trains only the adapters"),
        (["--freeze-params-name-list", "[a-", "--train-backend", "megatron"], "not a regular expression"),
    ]:
        with pytest.raises(SlimeConfigError) as e:
            flags(tiny_model_dir, *argv)
        assert message in str(e.value) and "\n" not in str(e.value), argv
    # megatron-core names are matched when the model is built, not against the HF checkpoint's
    assert flags(tiny_model_dir, "--freeze-params-name-list", "output_layer", "--train-backend", "megatron")


# ---------------------------------------------------------------- the reference follows the policy


def test_ref_update_due_every_interval_rollouts():
    assert [ref_update_due(i, 2) for i in range(6)] == [False, True, False, True, False, True]
    assert [ref_update_due(i, 3) for i in range(6)] == [False, False, True, False, False, True]
    assert all(ref_update_due(i, 1) for i in range(4))
    assert not any(ref_update_due(i, None) for i in range(4)) and not ref_update_due(0, 0)


def test_copy_policy_into_reference_by_name_in_place(tiny_model_dir):
    policy, ref = tiny(tiny_model_dir), tiny(tiny_model_dir)
    ref.requires_grad_(False)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    storage = {n: p.data_ptr() for n, p in ref.named_parameters()}
    assert copy_policy_into_reference(policy, ref) == len(storage)
    for (n, p), (m, r) in zip(policy.named_parameters(), ref.named_parameters()):
        assert n == m and torch.equal(p, r) and r.data_ptr() == storage[n] and not r.requires_grad
    # the reference scores like the policy now
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(policy(ids).logits, ref(ids).logits)


def test_copy_policy_into_reference_refuses_other_models():
    a, b = torch.nn.Sequential(torch.nn.Linear(2, 3)), torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(),
                                                                           torch.nn.Linear(3, 1))
    with pytest.raises(ValueError, match="only in the reference"):
        copy_policy_into_reference(a, b)
    with pytest.raises(ValueError, match=r"0.weight: policy shape \(3, 2\) vs reference \(4, 2\)"):
        copy_policy_into_reference(a, torch.nn.Sequential(torch.nn.Linear(2, 4)))


SHARDED = textwrap.dedent("""
    import datetime, sys
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from slime.training.freeze import copy_policy_into_reference, freeze_parameters
    from slime.utils.dist import init_process_group

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    init_process_group("cpu", rank, 2, "127.0.0.1", port, datetime.timedelta(seconds=60))

    def model(seed):  # uneven rows over 2 ranks: 5 -> 3 + 2, 3 -> 2 + 1
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3))

    def shard(m):  # as the fsdp backend: each layer, then the root, on a mesh of its own
        mesh = init_device_mesh("cpu", (2,))
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    def full(m):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in m.named_parameters()}

    def local(p):
        return p.to_local() if isinstance(p, DTensor) else p

    for pol_sharded, ref_sharded in ((True, True), (False, True), (True, False)):
        pol, ref = model(1), model(2)
        pol, ref = (shard(pol) if pol_sharded else pol), (shard(ref) if ref_sharded else ref)
        if ref_sharded:
            assert [tuple(local(p).shape) for p in ref.parameters()] == (
                [(3, 3), (3,), (2, 5), (2,)] if rank == 0 else [(2, 3), (2,), (1, 5), (1,)])
        want, ptrs = full(pol), [local(p).data_ptr() for p in ref.parameters()]
        assert not all(torch.equal(want[n], v) for n, v in full(ref).items())
        copy_policy_into_reference(pol, ref)
        got = full(ref)
        assert all(torch.equal(want[n], got[n]) for n in want), (pol_sharded, ref_sharded)
        assert ptrs == [local(p).data_ptr() for p in ref.parameters()], "copied in place"

    # a frozen parameter stays frozen through fully_shard, and trains nothing
    m = model(3)
    assert freeze_parameters(m, [r"^0\\."]) == ["0.weight", "0.bias"]
    shard(m)
    assert [p.requires_grad for p in m.parameters()] == [False, False, True, True]
    before = full(m)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1)
    m(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    after = full(m)
    assert [torch.equal(before[n], after[n]) for n in before] == [True, True, False, False]
    print("ok", rank)
""")


def test_copy_and_freeze_under_fsdp2_on_two_ranks(tmp_path):
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED)
    port = free_port("127.0.0.1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {r}" in out, out[-3000:]


def test_ref_update_flags(tiny_model_dir):
    args = flags(tiny_model_dir, "--ref-update-interval", 2, "--use-kl-loss", "--kl-loss-coef", 0.1)
    assert args.ref_update_interval == 2
    assert flags(tiny_model_dir, "--ref-update-interval", 1, "--advantage-estimator", "ppo", "--kl-coef", 0.1)
    for argv, message in [
        (["--ref-update-interval", 0, "--use-kl-loss", "--kl-loss-coef", 0.1], "--ref-update-interval must be >= 1"),
        (["--ref-update-interval", 2], "--ref-update-interval updates the KL reference model, which this run does "
                                       "not have"),
        (["--ref-update-interval", 2, "--use-kl-loss"], "which this run does not have"),  # --kl-loss-coef 0
        (["--ref-update-interval", 2, "--use-kl-loss", "--kl-loss-coef", 0.1, "--lora-rank", 4],
         "--ref-update-interval with LoRA: the reference is the base with the adapter switched off"),
    ]:
        with pytest.raises(SlimeConfigError) as e:
            flags(tiny_model_dir, *argv)
        assert message in str(e.value) and "\n" not in str(e.value), argv
