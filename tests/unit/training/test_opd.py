"""On-policy distillation with the teacher in the trainer (`--use-opd --opd-type fsdp|megatron`,
slime/opd_flags.py, slime/algorithms/opd.py): the teacher's per-token reverse KL enters the
advantages, the flags' bad input, and the student moving toward the teacher."""

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.utils.errors import SlimeConfigError
from slime.utils.tiny_model import build_tiny_model
from tests.helpers.training import TEMPERATURE, local_actor, make_args, synthetic_batch

BATCH = ["--rollout-batch-size", 4, "--n-samples-per-prompt", 2, "--micro-batch-size", 4]
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core missing")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Another model with the student's tokenizer: other weights and another shape (3 layers of 64)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1, hidden_size=64, num_layers=3))


@pytest.fixture(scope="module")
def same_shape_teacher_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("teacher_same_shape"), seed=1))


def hf_log_probs(model_dir, batch):
    """Per-sample log-probs of the response tokens under a plain Hugging Face forward at the rollout
    temperature (the engine's and the trainer's definition)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for toks, r in zip(batch.tokens, batch.response_lengths):
        ids = torch.tensor(toks)
        with torch.no_grad():
            logits = model(ids[None]).logits[0] / TEMPERATURE
        p = len(toks) - r
        out.append(torch.log_softmax(logits, -1)[p - 1: p - 1 + r].gather(-1, ids[p:, None]).squeeze(-1))
    return out


def rollout_of(args, batch):
    """(advantages, old log-probs) of a fresh rank's rollout preparation on `batch`."""
    actor = local_actor(args)
    try:
        ro = actor._policy_rollout(batch, actor._masks(batch), None)
        return ro.advantages, ro.old_lps
    finally:
        actor.shutdown()


@pytest.mark.parametrize("backend,teacher", [
    ("fsdp", "teacher_dir"),
    pytest.param("megatron", "same_shape_teacher_dir", marks=needs_megatron),
])
def test_teacher_reverse_kl_is_subtracted_from_the_advantages(tiny_model_dir, tmp_path, request, backend, teacher):
    teacher = request.getfixturevalue(teacher)
    batch = synthetic_batch(tiny_model_dir, 8, seed=11)
    common = [*BATCH, "--train-backend", backend]
    plain, _ = rollout_of(make_args(tiny_model_dir, tmp_path, *common, "--num-steps-per-rollout", 1), batch)
    coef = 0.5
    args = make_args(tiny_model_dir, tmp_path, *common, "--use-opd", "--opd-type", backend, "--opd-teacher-load",
                     teacher, "--opd-kl-coef", coef)
    distilled, student = rollout_of(args, batch)
    teacher_lps = hf_log_probs(teacher, batch)
    for i in range(len(batch)):
        # the student's log-probs are the trainer's before the update (an extra pass, not the training forward)
        assert student[i] is not None
        expected = plain[i] - coef * (student[i] - teacher_lps[i])
        assert torch.allclose(distilled[i], expected, atol=1e-5), (i, distilled[i], expected)
        assert not torch.allclose(distilled[i], plain[i], atol=1e-3)  # the teacher's signal is really there


def test_a_teacher_equal_to_the_student_changes_nothing(tiny_model_dir, tmp_path):
    batch = synthetic_batch(tiny_model_dir, 8, seed=12)
    base = make_args(tiny_model_dir, tmp_path, *BATCH, "--num-steps-per-rollout", 1)
    opd = make_args(tiny_model_dir, tmp_path, *BATCH, "--use-opd", "--opd-type", "fsdp", "--opd-teacher-load",
                    tiny_model_dir)
    actor = local_actor(opd)
    try:
        m = actor.train(0, batch)
    finally:
        actor.shutdown()
    assert m["train/opd_reverse_kl"] == pytest.approx(0.0, abs=1e-7)
    plain, _ = rollout_of(base, batch)
    distilled, _ = rollout_of(opd, batch)
    for a, b in zip(plain, distilled):
        assert torch.allclose(a, b, atol=1e-6)


def test_pure_distillation_moves_the_student_toward_the_teacher(tiny_model_dir, teacher_dir, tmp_path):
    """Rewards all equal (GRPO advantages 0): only the teacher's signal trains. Over a few steps
    on the same samples the student's log-probs of those tokens approach the teacher's."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=13)
    batch.rewards = [0.0] * len(batch)
    teacher_lps = torch.cat(hf_log_probs(teacher_dir, batch))
    args = make_args(tiny_model_dir, tmp_path, *BATCH, "--use-opd", "--opd-type", "fsdp", "--opd-teacher-load",
                     teacher_dir, "--lr", 3e-3, "--clip-grad", 0)
    actor = local_actor(args)
    kls = []
    try:
        for step in range(6):
            kls.append(actor.train(step, batch)["train/opd_reverse_kl"])
        save = tmp_path / "student"
        actor.backend._write_hf(save, actor.backend.full_state(optimizer=False)[0])
    finally:
        actor.shutdown()
    before = (torch.cat(hf_log_probs(tiny_model_dir, batch)) - teacher_lps).abs().mean()
    after = (torch.cat(hf_log_probs(str(save), batch)) - teacher_lps).abs().mean()
    assert after < 0.7 * before, (float(before), float(after))
    assert abs(kls[-1]) < abs(kls[0])


@pytest.mark.parametrize("flags,message", [
    (["--opd-type", "fsdp"], "--opd-type is an on-policy distillation flag: add --use-opd"),
    (["--opd-kl-coef", 0.5], "--opd-kl-coef is an on-policy distillation flag: add --use-opd"),
    (["--use-opd"], "--use-opd needs --opd-type: fsdp"),
    (["--use-opd", "--opd-type", "sglang"], "--opd-type sglang: a served teacher needs extra served models"),
    (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron loads the teacher in the megatron trainer, but "
                                              "this run trains with --train-backend fsdp"),
    (["--use-opd", "--opd-type", "fsdp"], "--opd-type fsdp needs --opd-teacher-load DIR"),
    (["--use-opd", "--opd-type", "fsdp", "--opd-teacher-load", "TINY", "--opd-kl-coef", 0],
     "--opd-kl-coef must be > 0"),
    (["--use-opd", "--opd-type", "fsdp", "--opd-teacher-load", "/nonexistent/teacher"],
     "--opd-teacher-load: directory /nonexistent/teacher does not exist"),
])
def test_opd_flag_errors(tiny_model_dir, tmp_path, flags, message):
    flags = [tiny_model_dir if f == "TINY" else f for f in flags]
    with pytest.raises(SlimeConfigError, match=message.replace("(", r"\(")):
        make_args(tiny_model_dir, tmp_path, *flags)


def test_a_teacher_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    other = tmp_path / "other_tokenizer"
    other.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (other / name).write_text(open(f"{tiny_model_dir}/{name}").read())
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: same size, another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SlimeConfigError, match="--opd-teacher-load .*: its tokenizer differs from --hf-checkpoint's"):
        make_args(tiny_model_dir, tmp_path, "--use-opd", "--opd-type", "fsdp", "--opd-teacher-load", str(other))
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 3
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimeConfigError, match="the teacher must score the same tokens"):
        make_args(tiny_model_dir, tmp_path, "--use-opd", "--opd-type", "fsdp", "--opd-teacher-load", str(other))


@needs_megatron
def test_megatron_teacher_must_have_the_students_shape(tiny_model_dir, teacher_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, *BATCH, "--train-backend", "megatron", "--use-opd", "--opd-type",
                     "megatron", "--opd-teacher-load", teacher_dir)
    with pytest.raises(SlimeConfigError, match="hidden_size is 64, the student's 128; the megatron backend loads"):
        local_actor(args)
