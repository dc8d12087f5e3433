"""Fixtures shared by the engine tests."""

import pytest
import torch


@pytest.fixture(scope="session")
def sharp_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its matrices scaled x8: peaked distributions, so greedy output
    varies token to token (the raw random model repeats one token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("sharp_model")
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    m.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


@pytest.fixture
def adapter(tmp_path):
    """(adapter url, FakeVllm, AdapterState) served from a background event loop (tests/helpers/fake_vllm.py)."""
    from tests.helpers.fake_vllm import serve_adapter

    with serve_adapter(tmp_path) as served:
        yield served
