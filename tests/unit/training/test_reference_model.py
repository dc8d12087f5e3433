"""The KL reference model of the FSDP backend: sharded like the policy (each of two ranks holds
half of it) with log-probs identical to one unsharded copy, and `--ref-load` for a reference other
than `--hf-checkpoint` (same vocabulary, checked before anything starts)."""

from __future__ import annotations

import json
import shutil

import pytest
import ray
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from slime.training.backend import MicroBatch
from slime.training.fsdp.backend import FSDPBackend
from slime.utils.errors import SlimeConfigError
from slime.utils.net import LOOPBACK, free_port
from tests.helpers.args import make_args

TOKENS = [[5, 9, 11, 3, 7, 2], [4, 8, 15, 16, 23, 42, 1], [6, 6, 6, 6]]
LENGTHS = [3, 4, 2]


def _reference(args, rank: int, world: int, port: int):
    """(reference log-probs of TOKENS, this rank's reference parameter elements, all of them)."""
    be = FSDPBackend(args, rank, world, LOOPBACK, port, with_ref=True)
    try:
        lp, _ = be.forward_logprobs(MicroBatch(TOKENS, LENGTHS), ref=True)
        params = list(be.ref_model.parameters())
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        return lp, local, sum(p.numel() for p in params)
    finally:
        be.close()


_remote_reference = ray.remote(num_cpus=0, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})(_reference)


def test_two_ranks_hold_half_the_reference_each_and_score_it_identically(tiny_model_dir, tmp_path, ray_session):
    args = make_args(tiny_model_dir, tmp_path, "--use-kl-loss", "--actor-num-gpus-per-node", 2,
                     "--rollout-batch-size", 2)
    port = free_port()
    sharded = ray.get([_remote_reference.remote(args, r, 2, port) for r in range(2)])
    # the unsharded copy in an actor too: this pytest worker's torch state (threads) is what earlier tests left
    alone, alone_local, total = ray.get(_remote_reference.remote(make_args(tiny_model_dir, tmp_path, "--use-kl-loss"),
                                                                 0, 1, free_port()))
    assert alone_local == total
    for lp, local, all_ in sharded:
        assert all_ == total and local <= total // 2 + 64  # half of every tensor (row-split, rounded up)
        assert torch.equal(lp, alone)  # fp32: the same numbers as the unsharded copy


def test_ref_load_scores_with_another_checkpoint(tiny_model_dir, tmp_path):
    other = tmp_path / "other_ref"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(other)
    args = make_args(tiny_model_dir, tmp_path, "--use-kl-loss", "--ref-load", str(other))
    be = FSDPBackend(args, 0, 1, LOOPBACK, free_port(), with_ref=True)
    try:
        mb = MicroBatch(TOKENS, LENGTHS)
        ref, _ = be.forward_logprobs(mb, ref=True)
        policy, _ = be.forward_logprobs(mb)
    finally:
        be.close()
    expected = []
    for toks, r in zip(TOKENS, LENGTHS):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([toks])).logits[0].float(), -1)
        expected += [logp[i - 1, toks[i]] for i in range(len(toks) - r, len(toks))]
    torch.testing.assert_close(ref, torch.stack(expected), atol=1e-5, rtol=1e-5)
    assert (ref - policy).abs().max() > 1e-3  # the policy is still --hf-checkpoint


def test_bad_ref_load_is_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(SlimeConfigError, match=f"--ref-load: directory {tmp_path}/nope does not exist"):
        make_args(tiny_model_dir, tmp_path, "--ref-load", str(tmp_path / "nope"))
    other = tmp_path / "other_vocab"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 7
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimeConfigError) as e:
        make_args(tiny_model_dir, tmp_path, "--ref-load", str(other))
    assert str(e.value) == (f"--ref-load {other}: vocabulary of {config['vocab_size']} tokens, but --hf-checkpoint "
                            f"{tiny_model_dir} has {config['vocab_size'] - 7}; the reference must score the same tokens")
