"""A reference that follows the policy (`--ref-update-interval`) survives save/load
(slime/training/freeze.py `save_reference` / `load_reference`): the resumed run scores with the
saved run's reference, bitwise, and continues exactly as the uninterrupted run (KL included)."""

import pytest
import torch

from slime.training.freeze import REF_STATE
from tests.helpers.training import COMMON, assert_states_close, deterministic, local_actor, make_args, synthetic_batch


def _ref_lps(actor, batch) -> list[torch.Tensor]:
    return actor._no_grad_log_probs(batch, ref=True)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["fsdp", pytest.param("megatron", marks=pytest.mark.slow)])
def test_updated_reference_is_saved_and_resumes_exactly(backend, tiny_model_dir, tmp_path):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--micro-batch-size", 2, "--ref-update-interval", 2,
                     "--train-backend", backend)
    batch = synthetic_batch(tiny_model_dir, 8, seed=21)
    a = local_actor(args)
    b = local_actor(args)  # (megatron: the same process group and parallel state as a)
    try:
        initial = _ref_lps(a, batch)
        a.train(0, batch)  # the reference is still the initial model: checkpoints stay as they were
        a.save(str(tmp_path / "early"))
        assert (tmp_path / "early" / "train_state").is_dir() and not (tmp_path / "early" / REF_STATE).exists()
        a.train(1, batch)  # after rollout 1 the reference becomes the policy
        moved = _ref_lps(a, batch)
        assert not _equal(moved, initial)
        a.train(2, batch)  # the policy moves on; the reference stays the policy after rollout 1
        assert _equal(_ref_lps(a, batch), moved)
        assert not _equal(a._no_grad_log_probs(batch, ref=False), moved)

        a.save(str(tmp_path / "ckpt"))
        assert (tmp_path / "ckpt" / REF_STATE).is_dir()
        assert _equal(_ref_lps(b, batch), initial)  # before loading: the initial reference
        b.load(str(tmp_path / "ckpt"))
        assert _equal(_ref_lps(b, batch), moved)  # fp32, bitwise the saved run's reference

        # the resume continues as the uninterrupted run: rollout 3 (KL against the moved reference,
        # then the reference follows again), rollout 4 (KL against the new one)
        for rollout in (3, 4):
            ma, mb = deterministic(a.train(rollout, batch)), deterministic(b.train(rollout, batch))
            assert ma == mb and ma["train/kl_loss"] > 0, rollout
        assert _equal(_ref_lps(b, batch), _ref_lps(a, batch))
        assert_states_close(b.full_state(optimizer=False)[0], a.full_state(optimizer=False)[0], atol=0)

        # a checkpoint written by the resumed run keeps the reference it loaded / updated
        b.save(str(tmp_path / "again"))
        assert (tmp_path / "again" / REF_STATE).is_dir()
    finally:
        b.shutdown()
        a.shutdown()



def test_sharded_reference_resumes_exactly_on_two_ranks(tiny_model_dir, tmp_path, ray_session):
    """Two FSDP ranks (the reference sharded like the policy): the saved shards load back and the
    resumed group trains as the uninterrupted one, KL included (with the initial reference it would not)."""
    import ray

    from slime.ray.actor_group import TrainGroup

    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--micro-batch-size", 2, "--ref-update-interval", 2,
                     "--actor-num-gpus-per-node", 2)
    batch = synthetic_batch(tiny_model_dir, 8, seed=23)
    refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
    a, b = TrainGroup(args), TrainGroup(args)
    try:
        a.init()
        b.init()
        for rollout in range(3):  # the reference follows the policy after rollout 1
            a.train(rollout, refs)
        a.save(str(tmp_path / "ckpt"))
        assert (tmp_path / "ckpt" / REF_STATE).is_dir()
        b.load(str(tmp_path / "ckpt"))
        ma, mb = deterministic(a.train(3, refs)), deterministic(b.train(3, refs))
        assert ma == mb and ma["train/kl_loss"] > 0
        assert_states_close(b.full_state(optimizer=False)[0], a.full_state(optimizer=False)[0], atol=0)
    finally:
        a.shutdown()
        b.shutdown()
