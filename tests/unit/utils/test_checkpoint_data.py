"""slime.utils.checkpoint_data: checkpoints load as data; a file carrying a code-running pickle is
refused with one line naming it, before its code runs."""

import os
import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from slime.utils.checkpoint_data import (
    CheckpointRefused, dcp_to_dict, load_tensors_file, rng_states, set_rng_states,
)


class _RunsCode:
    """Unpickling this runs os.system: what a crafted checkpoint could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_rng_states_are_plain_data_and_resume_the_same_numbers(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    torch.save(rng_states(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_states(load_tensors_file(tmp_path / "rng.pt"))
    got = (random.random(), np.random.standard_normal(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_a_pt_file_that_runs_code_is_refused(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "rng_actor_rank0.pt"
    torch.save({"torch": torch.zeros(2), "x": _RunsCode(marker)}, path)
    with pytest.raises(CheckpointRefused, match=rf"{path}: refused: it holds Python objects other than tensors"):
        load_tensors_file(path)
    assert not marker.exists()


def _dcp_dir(tmp_path, state):
    out = tmp_path / "train_state"
    dcp.save(state, checkpoint_id=str(out), no_dist=True)
    return out


def test_dcp_loads_as_data(tmp_path):
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), betas=(0.9, 0.99))
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": m.state_dict(), "optim": opt.state_dict(), "bf16": torch.ones(2, dtype=torch.bfloat16)}
    got = dcp_to_dict(_dcp_dir(tmp_path, state))
    assert torch.equal(got["model"]["weight"], m.weight) and got["bf16"].dtype == torch.bfloat16
    assert got["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    saved = got["optim"]["state"]["0"]  # DCP names the plain state dict's entries by string
    assert torch.equal(saved["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]) and saved["exp_avg"].abs().sum() > 0


def test_dcp_metadata_or_entry_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    # an entry: DCP pickles non-tensor values into its data file
    bad_entry = _dcp_dir(tmp_path / "a", {"w": torch.zeros(2), "extra": _RunsCode(marker)})
    with pytest.raises(CheckpointRefused, match=rf"{bad_entry}: DCP entry 'extra': refused: .*posix.system"):
        dcp_to_dict(bad_entry)
    # the metadata file itself
    bad_meta = _dcp_dir(tmp_path / "b", {"w": torch.zeros(2)})
    (bad_meta / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointRefused, match=r"\.metadata: refused: .*'posix.system' is not a DCP metadata"):
        dcp_to_dict(bad_meta)
    assert not marker.exists()
