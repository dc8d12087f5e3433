"""FSDP trainer checkpoints and offload on CPU (gloo): save/load restores model and optimizer,
checkpoints resume across one and two ranks, sharded ranks offload and onload bitwise."""

import torch

from tests.helpers.training import (
    COMMON, assert_states_close, deterministic, flatten_optim, local_actor, make_args, synthetic_batch,
)


def test_save_then_load_restores_model_and_optimizer(tiny_model_dir, tmp_path, ray_session):
    import ray
    from transformers import AutoModelForCausalLM

    from slime.ray.actor_group import TrainGroup

    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--actor-num-gpus-per-node", 2, "--micro-batch-size", 2)
    batch = synthetic_batch(tiny_model_dir, 8, seed=3)
    refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
    ckpt = tmp_path / "ckpt"
    a = TrainGroup(args)
    b = TrainGroup(args)
    try:
        a.init()
        b.init()
        a.train(0, refs)
        a.save(str(ckpt))
        b.load(str(ckpt))
        sa, oa = a.full_state()
        sb, ob = b.full_state()
        assert_states_close(sb, sa, atol=0)
        fa, fb = flatten_optim(oa), flatten_optim(ob)
        assert len(oa["state"]) == len(sa) - 1  # every parameter once (the tied head shares the embedding)
        assert len(fa) == 3 * len(oa["state"])  # step, exp_avg, exp_avg_sq
        assert all(float(v) == 2.0 for k, v in fa.items() if k.endswith("/step"))  # two steps were taken
        assert_states_close(fb, fa, atol=0)
        assert ob["param_groups"][0]["lr"] == oa["param_groups"][0]["lr"]

        # the Hugging Face export loads with from_pretrained and holds the same weights
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt / "hf"), dtype=torch.float32)
        hsd = hf.state_dict()
        assert_states_close({k: hsd[k] for k in sa}, sa, atol=0)
        assert (ckpt / "hf" / "tokenizer.json").is_file()

        # training resumes exactly
        ma, mb = a.train(1, refs), b.train(1, refs)
        assert deterministic(ma) == deterministic(mb) and "train/loss" in deterministic(ma)
        assert_states_close(b.full_state(optimizer=False)[0], a.full_state(optimizer=False)[0], atol=0)
    finally:
        a.shutdown()
        b.shutdown()


def test_checkpoints_resume_across_one_and_two_ranks(tiny_model_dir, tmp_path, ray_session):
    """One rank trains the plain module, two ranks an FSDP2-sharded one: a checkpoint written by
    either loads exactly into the other (DCP, by parameter name)."""
    import ray

    from slime.ray.actor_group import TrainGroup

    extra = [*COMMON, "--micro-batch-size", 2]
    batch = synthetic_batch(tiny_model_dir, 8, seed=4)
    one = local_actor(make_args(tiny_model_dir, tmp_path, *extra))
    args2 = make_args(tiny_model_dir, tmp_path, *extra, "--actor-num-gpus-per-node", 2)
    two = TrainGroup(args2)

    def same(a, b):
        (sa, oa), (sb, ob) = a, b
        assert_states_close(sb, sa, atol=0)
        assert_states_close(flatten_optim(ob), flatten_optim(oa), atol=0)

    try:
        two.init()
        assert not one.backend.sharded
        one.train(0, batch)
        one.save(str(tmp_path / "from_one"))
        two.load(str(tmp_path / "from_one"))
        same(one.full_state(), two.full_state())

        two.train(1, [ray.put(b) for b in batch.split_for_ranks(args2.dp_size, args2.global_batch_size)])
        two.save(str(tmp_path / "from_two"))
        one.load(str(tmp_path / "from_two"))
        same(two.full_state(), one.full_state())
    finally:
        one.shutdown()
        two.shutdown()


def test_sharded_ranks_offload_and_onload_bitwise(tiny_model_dir, tmp_path, ray_session):
    """Two ranks hold FSDP2 DTensor shards (one rank, as in test_colocate.py, the plain module):
    offload frees them and the optimizer state, onload restores them bit for bit, training goes on."""
    import ray

    from slime.ray.actor_group import TrainGroup

    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--actor-num-gpus-per-node", 2, "--micro-batch-size", 2)
    refs = [ray.put(b) for b in synthetic_batch(tiny_model_dir, 8, seed=6).split_for_ranks(2, args.global_batch_size)]
    group = TrainGroup(args)
    try:
        group.init()
        group.train(0, refs)
        sa, oa = group.full_state()
        stats = group.offload()
        n_params = sum(v.numel() * v.element_size() for k, v in sa.items() if k != "lm_head.weight")
        assert stats["bytes"] >= 3 * n_params  # parameters, exp_avg, exp_avg_sq (+ the reference model)
        back = group.onload()
        assert back["bytes"] == stats["bytes"]
        sb, ob = group.full_state()
        assert_states_close(sb, sa, atol=0)
        assert_states_close(flatten_optim(ob), flatten_optim(oa), atol=0)
        assert group.train(1, refs)["train/grad_norm"] > 0
    finally:
        group.shutdown()
