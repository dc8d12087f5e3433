"""On-policy distillation (`--use-opd`, slime/opd_flags.py, slime/algorithms/opd.py), trainer side:
with the teacher in the trainer (`--opd-type fsdp|megatron`) or served (`--opd-type sglang`, its
log-probs in the batch) the teacher's per-token reverse KL enters the advantages, the two modes agree
at temperature 1, the flags' bad input, and the student moving toward the teacher."""

import importlib.util
import json
import re
import shutil
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.algorithms.opd import served_teacher_log_probs
from slime.argument_checks import check_opd_teacher
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
    (["--opd-teacher-model", "t"], "--opd-teacher-model is an on-policy distillation flag: add --use-opd"),
    (["--use-opd", "--opd-type", "sglang"], "--opd-teacher-model teacher: --opd-type sglang needs a frozen served "
                                            "model of that name (update_weights: false); this run serves only the "
                                            "policy (actor): no --sglang-config; add the teacher to --sglang-config"),
    (["--use-opd", "--opd-type", "fsdp", "--opd-teacher-load", "TINY", "--opd-teacher-model", "t"],
     "--opd-teacher-model names a served teacher (--opd-type sglang); with --opd-type fsdp the teacher is "
     "--opd-teacher-load"),
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
    with pytest.raises(SlimeConfigError, match=re.escape(message)):
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


# ---- a served teacher (--opd-type sglang): its log-probs come with the batch -----------------------


def served_config(tmp_path, teacher_dir, name="teacher", teacher_extra=""):
    cfg = tmp_path / f"served_{name}.yaml"
    cfg.write_text(textwrap.dedent(f"""
        sglang:
          - name: actor
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
          - name: {name}
            model_path: {teacher_dir}
            update_weights: false
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
        {teacher_extra}"""))
    return str(cfg)


def served_args(tiny_model_dir, tmp_path, teacher, *extra):
    return make_args(tiny_model_dir, tmp_path, *BATCH, "--sglang-config", served_config(tmp_path, teacher),
                     "--use-opd", "--opd-type", "sglang", *extra)


def test_served_teacher_mode_sets_the_flags_and_loads_no_teacher(tiny_model_dir, teacher_dir, tmp_path):
    args = served_args(tiny_model_dir, tmp_path, teacher_dir)
    assert (args.opd_served, args.opd_in_trainer, args.opd_teacher_model) == (True, False, "teacher")
    actor = local_actor(args)
    try:
        assert actor.use_opd and actor.backend.teacher_model is None
    finally:
        actor.shutdown()


def test_served_teacher_log_probs_are_subtracted_from_the_advantages(tiny_model_dir, teacher_dir, tmp_path):
    batch = synthetic_batch(tiny_model_dir, 8, seed=14)
    batch.loss_masks[3] = [0] * batch.response_lengths[3]  # a failed sample: the teacher did not score it
    plain, _ = rollout_of(make_args(tiny_model_dir, tmp_path, *BATCH, "--num-steps-per-rollout", 1), batch)
    teacher_lps = hf_log_probs(teacher_dir, batch)
    batch.teacher_log_probs = [t.tolist() for t in teacher_lps]
    batch.teacher_log_probs[3] = None
    coef = 0.5
    distilled, student = rollout_of(served_args(tiny_model_dir, tmp_path, teacher_dir, "--opd-kl-coef", coef), batch)
    for i in range(len(batch)):
        # the student's side is the trainer's log-probs before the update, as with the trainer's teacher
        assert student[i] is not None
        teacher = student[i] if i == 3 else torch.tensor(batch.teacher_log_probs[i])  # no teacher: no penalty
        expected = plain[i] - coef * (student[i] - teacher)
        assert torch.allclose(distilled[i], expected, atol=1e-6), (i, distilled[i], expected)
        if i != 3:
            assert not torch.allclose(distilled[i], plain[i], atol=1e-3)


def test_served_and_trainer_teachers_agree_at_temperature_1(tiny_model_dir, teacher_dir, tmp_path):
    """The served teacher's log-probs are at temperature 1 (SGLang's prompt log-probs), the trainer's
    teacher scores at the rollout temperature: at --rollout-temperature 1 a batch carrying the
    log-probs the trainer's teacher computes gives the trainer mode's advantages."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=15)
    t1 = ["--rollout-temperature", 1]
    in_trainer, _ = rollout_of(make_args(tiny_model_dir, tmp_path, *BATCH, *t1, "--use-opd", "--opd-type", "fsdp",
                                         "--opd-teacher-load", teacher_dir), batch)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    batch.teacher_log_probs = []
    for toks, r in zip(batch.tokens, batch.response_lengths):  # a plain forward at T = 1, as the engine scores
        ids = torch.tensor(toks)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        batch.teacher_log_probs.append(lp[len(toks) - r - 1: -1].gather(-1, ids[len(toks) - r:, None])[:, 0].tolist())
    served, _ = rollout_of(served_args(tiny_model_dir, tmp_path, teacher_dir, *t1), batch)
    for a, b in zip(in_trainer, served):
        assert torch.allclose(a, b, atol=1e-5), (a, b)


def test_served_teacher_reverse_kl_is_logged(tiny_model_dir, tmp_path):
    """The batch carries the student's own log-probs at the rollout temperature: the logged reverse KL is 0."""
    batch = synthetic_batch(tiny_model_dir, 8, seed=16)
    batch.teacher_log_probs = [t.tolist() for t in hf_log_probs(tiny_model_dir, batch)]
    actor = local_actor(served_args(tiny_model_dir, tmp_path, tiny_model_dir))
    try:
        m = actor.train(0, batch)
    finally:
        actor.shutdown()
    assert m["train/opd_reverse_kl"] == pytest.approx(0.0, abs=1e-6)


def test_served_teacher_log_probs_must_cover_every_trained_token():
    student = [torch.zeros(3), torch.zeros(2)]
    masks = [torch.ones(3), torch.zeros(2)]
    out = served_teacher_log_probs([[-1.0, -2.0, -3.0], None], student, masks)
    assert out[0].tolist() == [-1.0, -2.0, -3.0] and out[1].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="--opd-type sglang: sample 0 has no teacher log-probs for 3 response tokens"):
        served_teacher_log_probs([None, None], student, masks)
    with pytest.raises(ValueError, match="sample 1 has 1 teacher log-probs for 2 response tokens"):
        served_teacher_log_probs([[-1.0] * 3, [-1.0]], student, masks)
    with pytest.raises(ValueError, match="the batch carries no samples' teacher log-probs for 2 samples"):
        served_teacher_log_probs(None, student, masks)


def test_served_teacher_flag_errors(tiny_model_dir, teacher_dir, tmp_path):
    def fails(message, *flags):
        with pytest.raises(SlimeConfigError, match=re.escape(message)):
            make_args(tiny_model_dir, tmp_path, *flags)

    cfg = served_config(tmp_path, teacher_dir, name="judge")
    fails(f"--opd-teacher-model teacher: --opd-type sglang needs a frozen served model of that name (update_weights: "
          f"false); --sglang-config {cfg} serves judge beside the policy (actor); add the teacher to --sglang-config "
          "(docs/served_models.md) or pass --opd-teacher-model NAME", "--sglang-config", cfg, "--use-opd",
          "--opd-type", "sglang")
    fails("--opd-teacher-model actor: --opd-type sglang needs a frozen served model", "--sglang-config", cfg,
          "--use-opd", "--opd-type", "sglang", "--opd-teacher-model", "actor")
    only_policy = tmp_path / "only_policy.yaml"
    only_policy.write_text("sglang:\n  - name: actor\n    server_groups: [{worker_type: regular, num_gpus: 1}]\n")
    fails(f"--sglang-config {only_policy} serves only the policy (actor); add the teacher", "--sglang-config",
          only_policy, "--use-opd", "--opd-type", "sglang")
    fails("--opd-teacher-load is the teacher loaded in the trainer (--opd-type fsdp); with --opd-type sglang the "
          "teacher is the served model --opd-teacher-model (judge): leave --opd-teacher-load out",
          "--sglang-config", cfg, "--use-opd", "--opd-type", "sglang", "--opd-teacher-model", "judge",
          "--opd-teacher-load", teacher_dir)
    fails("--opd-kl-coef must be > 0", "--sglang-config", cfg, "--use-opd", "--opd-type", "sglang",
          "--opd-teacher-model", "judge", "--opd-kl-coef", -1)
    args = make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg, "--use-opd", "--opd-type", "sglang",
                     "--opd-teacher-model", "judge")
    assert args.opd_served and args.opd_teacher_model == "judge"


def _other_tokenizer(tiny_model_dir, where):
    """The tiny model with two tokens' ids swapped: same vocabulary size, another tokenizer."""
    where.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(f"{tiny_model_dir}/{name}", where / name)
    tok = json.loads((where / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (where / "tokenizer.json").write_text(json.dumps(tok))
    return str(where)


def test_a_served_teacher_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    other = _other_tokenizer(tiny_model_dir, tmp_path / "other_tokenizer")
    flags = ["--sglang-config", served_config(tmp_path, other), "--use-opd", "--opd-type", "sglang"]
    message = f"--opd-teacher-model teacher (its --sglang-config model_path) {other}: its tokenizer differs from "
    with pytest.raises(SlimeConfigError, match=re.escape(message + "--hf-checkpoint's")):
        # parsing runs check_opd_teacher once slime.arguments calls it; calling it again raises the same line
        check_opd_teacher(make_args(tiny_model_dir, tmp_path, *flags))


def _arguments_check_the_served_teacher() -> bool:
    import inspect

    import slime.arguments

    return "check_opd_teacher" in inspect.getsource(slime.arguments)


@pytest.mark.skipif(not _arguments_check_the_served_teacher(),
                    reason="slime.arguments does not call check_opd_teacher yet")
def test_parsing_refuses_a_served_teacher_with_another_tokenizer(tiny_model_dir, tmp_path):
    other = _other_tokenizer(tiny_model_dir, tmp_path / "other_tokenizer")
    with pytest.raises(SlimeConfigError, match="its tokenizer differs from --hf-checkpoint's"):
        make_args(tiny_model_dir, tmp_path, "--sglang-config", served_config(tmp_path, other), "--use-opd",
                  "--opd-type", "sglang")
