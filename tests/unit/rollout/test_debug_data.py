import pytest

from slime.rollout.debug_data import load_samples, save_samples
from slime.types import Sample, SampleStatus
from slime.utils.errors import DataError


def test_samples_round_trip_exactly(tmp_path):
    samples = [
        Sample(prompt=[{"role": "user", "content": "parity of 4 7"}], label="1", metadata={"k": [1, 2]}, index=0,
               group_index=0, tokens=[2, 5, 9, 51, 3], response="1", response_length=2, loss_mask=[1, 1],
               rollout_log_probs=[-0.1234567890123, -2.5], reward=1.0, status=SampleStatus.COMPLETED,
               weight_version=3),
        Sample(prompt="x", index=1, group_index=0, tokens=[7], status=SampleStatus.FAILED),
    ]
    path = save_samples(str(tmp_path / "d" / "rollout_{rollout_id}.json"), 5, samples)
    assert path.name == "rollout_5.json"
    assert load_samples(str(tmp_path / "d" / "rollout_{rollout_id}.json"), 5) == samples


def test_missing_or_foreign_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=r"rollout_2\.json \(rollout 2\) does not exist"):
        load_samples(str(tmp_path / "rollout_{rollout_id}.json"), 2)
    (tmp_path / "rollout_0.json").write_text('{"samples": [{"nope": 1, "status": "completed"}]}')
    with pytest.raises(DataError, match="is not rollout data written by slime"):
        load_samples(str(tmp_path / "rollout_{rollout_id}.json"), 0)
