"""The MoE routing hook (slime.utils.moe_routing) and its trainer side (slime.training.moe) on tiny
random Hugging Face MoE models: what is recorded is what the experts received, replaying it is
bitwise the same forward, forced experts are used exactly (with gradients to the router), the
load-balancing loss equals Hugging Face's, and the layouts of packed and padded forwards round-trip."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.training.moe import TrainRouting, per_sample, replay_rows
from slime.utils.moe_routing import RoutingHook, decode, encode, expert_usage, load_balancing_loss, routers
from slime.utils.tiny_model import build_tiny_model, build_tiny_moe_model

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


@pytest.fixture(scope="module", params=FAMILIES)
def moe_dir(request, tmp_path_factory):
    return build_tiny_moe_model(tmp_path_factory.mktemp(request.param), seed=0, family=request.param)


@pytest.fixture
def moe(moe_dir):
    """A fresh model per test (a RoutingHook is installed once per model)."""
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)


def _experts_received(model):
    """Patch every experts module to keep the expert ids it is given (per call, in layer order)."""
    seen = []
    for r in routers(model):
        block = next(m for m in model.modules() if getattr(m, "gate", None) is r)
        experts = block.experts
        orig = experts.forward

        def spy(hidden, top_k_index, top_k_weights, _orig=orig):
            seen.append(top_k_index.clone())
            return _orig(hidden, top_k_index, top_k_weights)

        experts.forward = spy
    return seen


def test_record_replay_and_forced_experts(moe):
    hook = RoutingHook(moe)
    assert (hook.num_layers, hook.top_k, hook.num_experts) == (2, 2, 4)
    seen = _experts_received(moe)
    ids = torch.randint(4, 60, (2, 7), generator=torch.Generator().manual_seed(1))
    with hook.recording() as rec:
        base = moe(ids, use_cache=False).logits
    idx = rec.indices()
    assert idx.shape == (14, 2, 2) and idx.dtype == torch.int32
    assert torch.equal(torch.stack(seen, 1).int(), idx)  # recorded = what the experts got
    seen.clear()
    with hook.replaying(idx) as again:
        same = moe(ids, use_cache=False).logits
    assert torch.equal(same, base)  # replaying the router's own choice changes nothing, bitwise
    assert torch.equal(again.indices(), idx)
    forced = (idx + 1) % 4
    forced[3] = -1  # token 3 keeps the router's own experts
    seen.clear()
    with hook.replaying(forced) as rec2:
        out = moe(ids, use_cache=False).logits
        loss = out.sum()
    expect = forced.clone()
    expect[3] = idx[3]
    assert torch.equal(rec2.indices(), expect) and torch.equal(torch.stack(seen, 1).int(), expect)
    assert not torch.equal(out, base)
    loss.backward()  # the forced experts' weights come from the router's probabilities: it gets gradients
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(moe))
    with pytest.raises(ValueError, match=r"routing replay needs experts of shape \[tokens, 2 MoE layers, top-k 2\]"):
        with hook.replaying(idx[:, :1]):
            pass


def test_load_balancing_loss_equals_hugging_faces(moe):
    hook = RoutingHook(moe)
    ids = torch.randint(4, 60, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    coef = moe.config.router_aux_loss_coef
    for attention in (None, mask):
        with hook.recording() as rec:
            out = moe(ids, attention_mask=attention, use_cache=False, output_router_logits=True)
        keep = None if attention is None else attention.reshape(-1).bool()
        ours = load_balancing_loss(rec.logits(), rec.indices(), hook.num_experts, keep)
        assert float(ours) == pytest.approx(float(out.aux_loss), rel=1e-5, abs=1e-6), (attention, coef)


def test_dense_model_has_no_routers(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    routing = TrainRouting(model, aux_coef=0.01)
    assert not routing.enabled and routers(model) == []
    with routing.forward(None, [3], packed=True) as rec:
        assert rec is None
    assert routing.take_metrics() == {}


@pytest.mark.parametrize("packed", [True, False])
def test_replay_rows_layout_round_trip(packed):
    lens = [4, 2, 5]
    routed = [torch.randint(0, 4, (n - 1, 2, 2), dtype=torch.int32) for n in lens]
    routed[1] = None
    rows = replay_rows(routed, lens, packed, width=None if packed else 5, num_layers=2, top_k=2)
    assert rows.shape == ((11 if packed else 15), 2, 2)
    back = per_sample(rows, lens, packed, width=None if packed else 5)
    assert torch.equal(back[0], routed[0]) and torch.equal(back[2], routed[2])
    assert (back[1] == -1).all()  # nothing recorded: the router's own choice
    assert (rows[3] == -1).all()  # sample 0's last token (row 3 in both layouts) has no recorded experts


def test_train_routing_usage_and_aux(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_moe_model(tmp_path / "m", seed=3), dtype=torch.float32)
    routing = TrainRouting(model, aux_coef=0.5)
    ids = torch.randint(4, 60, (1, 9), generator=torch.Generator().manual_seed(3))
    with routing.forward(None, [4, 5], packed=True) as rec:
        model(ids, use_cache=False)
    aux = routing.training_forward(rec, [4, 5], packed=True)
    assert float(aux) == pytest.approx(0.5 * float(load_balancing_loss(rec.logits(), rec.indices(), 4)))
    with pytest.raises(RuntimeError, match="a RoutingHook is already installed on this model"):
        RoutingHook(model)
    usage = expert_usage(rec.indices(), 4)
    metrics = routing.take_metrics()
    for layer in range(2):
        assert metrics[f"moe/layer_{layer}/max_load"] == pytest.approx(float(usage[layer].max()) * 4)
        assert metrics[f"moe/layer_{layer}/experts_used"] == float((usage[layer] > 0).sum())
    assert routing.take_metrics() == {}


def test_encode_decode_round_trip():
    x = torch.randint(0, 8, (5, 3, 2), dtype=torch.int32)
    assert torch.equal(decode(encode(x), 3, 2), x)
    with pytest.raises(ValueError, match="are not rows of 3 layers x top-k 4"):
        decode(encode(x), 3, 4)


def test_tiny_llama_unchanged_by_the_moe_builder(tmp_path):
    """build_tiny_moe_model writes the same tokenizer as the dense tiny model."""
    dense = build_tiny_model(tmp_path / "d")
    sparse = build_tiny_moe_model(tmp_path / "s")
    assert (dense / "tokenizer.json").read_text() == (sparse / "tokenizer.json").read_text()
