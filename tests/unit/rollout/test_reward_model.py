"""`--rm-type reward_model --rm-path DIR`: a tiny random LlamaForSequenceClassification scores
samples; each reward equals a direct unbatched `model(**tokenizer(text)).logits[0, 0]` of the same
text (plain prompt + response, or the reward model's chat template), also when several samples of
different lengths are scored together in one right-padded forward; and each refused flag
combination is one line naming the flag. CPU, no engines, no Ray."""

import asyncio
import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from slime.rollout.generate import score
from slime.rollout.rewards import RewardMix, build_reward
from slime.rollout.rewards import reward_model as rm
from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError
from slime.utils.tiny_model import build_tokenizer
from tests.helpers.args import make_args


def build_rm(path, seed=0, num_labels=1, pad=True, chat_template=True, max_position_embeddings=256):
    """A tiny random reward model + the tiny word-level tokenizer, saved to `path`."""
    tokenizer = build_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=max_position_embeddings, num_labels=num_labels,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id if pad else None)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():  # a random score head is ~0 everywhere; make the rewards clearly differ
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_rm(tmp_path_factory.mktemp("rm"))


def direct(path, text, add_special_tokens=True):
    """The unbatched reference: transformers' own forward of one text."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)).logits[0, 0].item()


def score_all(args, samples):
    reward = build_reward(args)

    async def run():
        return await asyncio.gather(*(score(reward, args, s) for s in samples))

    return asyncio.run(run())


@pytest.fixture
def forwards(monkeypatch):
    """The row lengths of every padded forward the reward model runs."""
    seen = []
    original = rm.RewardModel._forward

    def spy(self, rows):
        seen.append([len(r) for r in rows])
        return original(self, rows)

    monkeypatch.setattr(rm.RewardModel, "_forward", spy)
    return seen


PLAIN = [("what is 1 plus 1 ?", " the answer is 2"), ("solve 7 times 8", " 56"),
         ("say hello", " hello world hello world hello world"), ("2 + 2 =", " 4 ."),
         ("repeat the digit 3", " 3 3 3 3 3 3 3 3 3")]


def test_plain_text_batched_equals_unbatched(tiny_model_dir, tmp_path, rm_dir, forwards):
    args = make_args(tiny_model_dir, tmp_path, "--rm-type", "reward_model", "--rm-path", rm_dir)
    samples = score_all(args, [Sample(prompt=p, response=r, index=i) for i, (p, r) in enumerate(PLAIN)])
    assert len(forwards) == 1 and len(forwards[0]) == 5 and len(set(forwards[0])) > 1  # one padded batch
    expected = [direct(rm_dir, p + r) for p, r in PLAIN]
    assert [s.status for s in samples] == [SampleStatus.PENDING] * 5
    assert [s.reward for s in samples] == pytest.approx(expected, abs=1e-5)
    assert max(expected) - min(expected) > 1e-2  # the rewards really differ between samples


def test_chat_prompts_use_the_reward_models_chat_template(tiny_model_dir, tmp_path, rm_dir, forwards):
    args = make_args(tiny_model_dir, tmp_path, "--rm-type", "reward_model", "--rm-path", rm_dir)
    chats = [[{"role": "system", "content": "reply with only the final result"},
              {"role": "user", "content": "what is 3 plus 4 ?"}],
             [{"role": "user", "content": "say yes"}],
             [{"role": "user", "content": "compute 9 minus 2"}]]
    responses = ["7", "yes yes", "the answer is 7 ."]
    samples = score_all(args, [Sample(prompt=c, response=r) for c, r in zip(chats, responses)])
    assert len(forwards) == 1 and len(set(forwards[0])) == 3
    texts = [AutoTokenizer.from_pretrained(rm_dir).apply_chat_template(
        c + [{"role": "assistant", "content": r}], tokenize=False) for c, r in zip(chats, responses)]
    assert texts[1] == "<|im_start|>user\nsay yes<|im_end|>\n<|im_start|>assistant\nyes yes<|im_end|>\n"
    assert [s.reward for s in samples] == pytest.approx([direct(rm_dir, t, False) for t in texts], abs=1e-5)

    # a string prompt under --apply-chat-template is one user message
    args = make_args(tiny_model_dir, tmp_path, "--rm-type", "reward_model", "--rm-path", rm_dir,
                     "--apply-chat-template")
    [s] = score_all(args, [Sample(prompt="say yes", response="yes yes")])
    assert s.reward == pytest.approx(samples[1].reward, abs=1e-6)
    assert abs(s.reward - direct(rm_dir, "say yes" + "yes yes")) > 1e-3  # not the plain text's score


def test_missing_pad_token_id_and_chat_template(tmp_path, forwards):
    """A config without pad_token_id gets the tokenizer's pad: batched rows still score at their last
    token (transformers alone uses the last position when it has no pad id). A chat prompt without a
    chat template fails that sample only, with a message naming --rm-path."""
    path = build_rm(tmp_path / "rm", seed=1, pad=False, chat_template=False)
    assert json.loads((tmp_path / "rm" / "config.json").read_text()).get("pad_token_id") is None
    args = make_args(path, tmp_path, "--rm-type", "reward_model", "--rm-path", path)
    samples = score_all(args, [Sample(prompt=p, response=r) for p, r in PLAIN[:3]]
                        + [Sample(prompt=[{"role": "user", "content": "hi"}], response="yes"),
                           Sample(prompt="", response="")])
    assert len(forwards) == 1 and len(forwards[0]) == 3
    assert [s.reward for s in samples[:3]] == pytest.approx([direct(path, p + r) for p, r in PLAIN[:3]], abs=1e-5)
    assert [s.status for s in samples[3:]] == [SampleStatus.FAILED] * 2 and samples[3].reward is None


def test_long_inputs_keep_their_last_tokens(tiny_model_dir, tmp_path, forwards):
    path = build_rm(tmp_path / "rm", max_position_embeddings=8)
    args = make_args(tiny_model_dir, tmp_path, "--rm-type", "reward_model", "--rm-path", path)
    prompt, response = "what is 1 plus 1 ? the answer is", " 2 plus 0 = 2"
    [s] = score_all(args, [Sample(prompt=prompt, response=response)])
    assert forwards == [[8]]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer(prompt + response)["input_ids"]) == 14
    assert s.reward == pytest.approx(direct(path, "the answer is 2 plus 0 = 2"), abs=1e-5)  # its last 8 tokens


def test_loaded_once_per_directory(tiny_model_dir, tmp_path, rm_dir):
    args = make_args(tiny_model_dir, tmp_path, "--rm-type", "reward_model", "--rm-path", rm_dir)
    score_all(args, [Sample(prompt="say yes", response="yes")])
    model = rm.get_reward_model(rm_dir).model
    score_all(args, [Sample(prompt="say no", response="no")])
    assert rm.get_reward_model(rm_dir + "/").model is model and not model.training


def test_in_several_rewards(tiny_model_dir, tmp_path, rm_dir):
    args = make_args(tiny_model_dir, tmp_path, "--reward-functions", "exact", "reward_model", "--rm-path", rm_dir,
                     "--reward-weights", "1", "0.5")
    reward = build_reward(args)
    assert isinstance(reward, RewardMix) and reward.names == ["exact", "reward_model"]
    samples = score_all(args, [Sample(prompt="2 + 2 =", response="4", label="4"),
                               Sample(prompt="2 + 2 =", response="5 5", label="4")])
    values = [direct(rm_dir, "2 + 2 =4"), direct(rm_dir, "2 + 2 =5 5")]
    assert [s.reward_dict["reward_model"] for s in samples] == pytest.approx(values, abs=1e-5)
    assert [s.reward for s in samples] == pytest.approx([1 + 0.5 * values[0], 0.5 * values[1]], abs=1e-5)


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_rm")
    two = build_rm(root / "two_labels", num_labels=2)
    no_tok = build_rm(root / "no_tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (root / "no_tokenizer" / f).unlink()
    (root / "empty").mkdir()
    return {"two": two, "no_tok": no_tok, "empty": str(root / "empty"), "missing": str(root / "missing")}


@pytest.mark.parametrize("flags, message", [
    (["--rm-type", "reward_model"], "--rm-type reward_model needs --rm-path DIR"),
    (["--reward-functions", "exact", "reward_model"], "--reward-functions reward_model needs --rm-path DIR"),
    (["--rm-path", "{rm}"], "--rm-path is only used by a reward model: pass --rm-type reward_model"),
    (["--rm-type", "math", "--rm-path", "{rm}"], "--rm-path is only used by a reward model"),
    (["--rm-type", "reward_model", "--rm-path", "{missing}"], "--rm-path {missing}: directory does not exist"),
    (["--rm-type", "reward_model", "--rm-path", "{empty}"], "--rm-path {empty}: no config.json"),
    (["--rm-type", "reward_model", "--rm-path", "{causal}"],
     "--rm-path {causal}: architectures ['LlamaForCausalLM'] is not a ...ForSequenceClassification model"),
    (["--reward-functions", "reward_model", "--rm-path", "{two}"], "--rm-path {two}: the model has 2 labels"),
    (["--rm-type", "reward_model", "--rm-path", "{no_tok}"], "--rm-path {no_tok}: no tokenizer"),
])
def test_refused_at_start_up(tiny_model_dir, tmp_path, rm_dir, bad_dirs, flags, message):
    names = dict(bad_dirs, rm=rm_dir, causal=tiny_model_dir)
    with pytest.raises(SlimeConfigError) as e:
        make_args(tiny_model_dir, tmp_path, *[f.format(**names) for f in flags])
    assert str(e.value).startswith(message.format(**names)) and "\n" not in str(e.value)


def test_time_limit_covers_the_load_then_timeouts_fail_only_their_sample(tiny_model_dir, tmp_path):
    path = build_rm(tmp_path / "rm", seed=2)
    args = make_args(tiny_model_dir, tmp_path, "--rm-type", "reward_model", "--rm-path", path, "--rm-timeout", 7)
    reward = build_reward(args)
    assert reward.time_limit(args.rm_timeout) == 7 + rm.LOAD_TIMEOUT_S  # the first calls wait for the load
    [s] = score_all(args, [Sample(prompt="say yes", response="yes")])
    assert reward.time_limit(args.rm_timeout) == 7 and s.reward == pytest.approx(direct(path, "say yes" + "yes"),
                                                                                 abs=1e-5)
    fast = make_args(tiny_model_dir, tmp_path, "--rm-type", "reward_model", "--rm-path", path, "--rm-timeout", 1e-4)
    [late] = score_all(fast, [Sample(prompt="say yes", response="yes")])  # cancelled before its batch runs
    assert late.status == SampleStatus.FAILED and late.reward is None
    [again] = score_all(args, [Sample(prompt="say yes", response="yes")])
    assert again.reward == pytest.approx(s.reward, abs=1e-6)


def test_batches_hold_at_most_max_batch_samples(tiny_model_dir, tmp_path, rm_dir, forwards):
    args = make_args(tiny_model_dir, tmp_path, "--rm-type", "reward_model", "--rm-path", rm_dir)
    pairs = [("say", " yes" * (1 + i % 5)) for i in range(rm.MAX_BATCH + 4)]
    samples = score_all(args, [Sample(prompt=p, response=r) for p, r in pairs])
    assert sorted(len(f) for f in forwards) == [4, rm.MAX_BATCH]
    expected = {r: direct(rm_dir, p + r) for p, r in set(pairs)}
    assert [s.reward for s in samples] == pytest.approx([expected[r] for _, r in pairs], abs=1e-5)
