"""SFT data (`--loss-type sft_loss`): incremental chat-template rendering, the assistant-only loss
mask, the rollout manager's SFT batches, and the flags' validation."""

import json

import pytest

from slime.data import sft
from slime.utils.errors import DataError, SlimeConfigError

CHAT = [
    {"role": "system", "content": "reply with only the answer"},
    {"role": "user", "content": "what is 2 plus 3 ?"},
    {"role": "assistant", "content": "the answer is 5"},
    {"role": "user", "content": "and 2 times 3 ?"},
    {"role": "assistant", "content": "6"},
]


def runs(mask):
    """[start, end) of every run of 1s."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def bpe_tok():
    """A byte-level BPE tokenizer (merges across spaces and newlines, unlike the tiny word-level one)
    with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from slime.utils.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for m in CHAT] * 20 + ["user\nassistant\nsystem\n"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def test_loss_mask_is_exactly_the_assistant_turns_word_level(tiny_tok):
    tokens, mask = sft.tokenize_conversation(tiny_tok, CHAT)
    assert len(tokens) == len(mask)
    # the whole rendering, tokenized at once, gives the same tokens (no re-tokenization drift)
    full = tiny_tok.apply_chat_template(CHAT, tokenize=False)
    assert tokens == tiny_tok(full, add_special_tokens=False)["input_ids"]
    spans = runs(mask)
    assistant = [m["content"] for m in CHAT if m["role"] == "assistant"]
    assert len(spans) == len(assistant)
    for (a, b), content in zip(spans, assistant):
        assert tokens[a:b] == tiny_tok(content, add_special_tokens=False)["input_ids"] + [tiny_tok.eos_token_id]
        assert tiny_tok.decode(tokens[a:b]) == content + " <|im_end|>"  # word-level decode joins with spaces
    # nothing else is masked in: every 1 is inside an assistant turn
    assert sum(mask) == sum(b - a for a, b in spans)


def test_loss_mask_decodes_to_the_assistant_contents_and_end_of_turn_bpe(bpe_tok):
    tokens, mask = sft.tokenize_conversation(bpe_tok, CHAT)
    masked = [bpe_tok.decode(tokens[a:b]) for a, b in runs(mask)]
    assert masked == ["the answer is 5<|im_end|>\n", "6<|im_end|>\n"]
    unmasked = bpe_tok.decode([t for t, m in zip(tokens, mask) if not m])
    assert unmasked == ("<|im_start|>system\nreply with only the answer<|im_end|>\n<|im_start|>user\n"
                        "what is 2 plus 3 ?<|im_end|>\n<|im_start|>assistant\n<|im_start|>user\n"
                        "and 2 times 3 ?<|im_end|>\n<|im_start|>assistant\n")
    assert bpe_tok.decode(tokens) == bpe_tok.apply_chat_template(CHAT, tokenize=False)


def test_tool_turns_are_masked_out(tiny_tok):
    chat = [{"role": "user", "content": "compute 2 plus 3"}, {"role": "assistant", "content": "sum ( 2 , 3 )"},
            {"role": "tool", "content": "5"}, {"role": "assistant", "content": "the answer is 5"}]
    tokens, mask = sft.tokenize_conversation(tiny_tok, chat)
    decoded = [tiny_tok.decode(tokens[a:b]) for a, b in runs(mask)]
    assert decoded == ["sum ( 2 , 3 ) <|im_end|>", "the answer is 5 <|im_end|>"]


def test_bad_conversations_are_data_errors(tiny_tok):
    with pytest.raises(DataError, match="no assistant message"):
        sft.tokenize_conversation(tiny_tok, [{"role": "user", "content": "hello"}], "f.jsonl:3")
    with pytest.raises(DataError, match="starts with an assistant message"):
        sft.tokenize_conversation(tiny_tok, CHAT[2:], "f.jsonl:3")

    class Rewriting:  # a template that drops earlier turns (not prefix-stable)
        chat_template = "x"
        eos_token_id = 0

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return messages[-1]["content"] if messages else ""

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1] * len(text.split())}

    with pytest.raises(DataError, match="f.jsonl:3: the chat template is not prefix-stable"):
        sft.tokenize_conversation(Rewriting(), CHAT, "f.jsonl:3")


def test_load_conversations_names_the_line(tiny_tok, tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": "hello"}) + "\n")
    with pytest.raises(DataError, match=f"{path}:2: field 'messages' must be a list of chat messages"):
        sft.load_conversations(path, tiny_tok, "messages")
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    (conv,) = sft.load_conversations(path, tiny_tok, "messages")
    sample = sft.conversation_sample(conv)
    assert sample.tokens == conv.tokens and sample.response_length == len(conv.tokens) - conv.prompt_length
    assert sample.loss_mask == conv.loss_mask[conv.prompt_length:] and sample.loss_mask[0] == 1


def sft_args(model_dir, tmp_path, *extra):
    from tests.helpers.args import make_args

    data = "".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(4))
    return make_args(model_dir, tmp_path, "--input-key", "messages", "--rollout-batch-size", 2,
                     "--loss-type", "sft_loss", *extra, data=data)


def test_sft_flags(tiny_model_dir, tmp_path):
    args = sft_args(tiny_model_dir, tmp_path)
    assert args.loss_type == "sft_loss" and args.num_engines == 0 and args.rollout_num_gpus == 0
    for extra, message in [
        (["--n-samples-per-prompt", 2, "--global-batch-size", 4],
         "--loss-type sft_loss needs --n-samples-per-prompt 1"),
        (["--eval-prompt-data", tmp_path / "prompts.jsonl"], "--eval-prompt-data needs rollout engines"),
        (["--advantage-estimator", "ppo"], "--advantage-estimator ppo has no effect with --loss-type sft_loss"),
        (["--use-kl-loss", "--kl-loss-coef", 0.1], "--use-kl-loss has no effect with --loss-type sft_loss"),
    ]:
        with pytest.raises(SlimeConfigError) as e:
            sft_args(tiny_model_dir, tmp_path, *extra)
        assert message in str(e.value)


def test_manager_sft_batches_start_no_engines(tiny_model_dir, tmp_path, monkeypatch):
    import ray

    from slime.rollout.manager import RolloutManager

    monkeypatch.setattr(ray, "put", lambda x: x)  # no Ray needed: the batch itself stands for its ref
    args = sft_args(tiny_model_dir, tmp_path)
    m = RolloutManager(args)
    assert m.init() == [] and m.fleet.servers == []
    (batch,), metrics = m.generate(0)
    assert len(batch) == 2 and batch.rewards == [0.0, 0.0]
    assert all(len(lm) == r for lm, r in zip(batch.loss_masks, batch.response_lengths))
    assert metrics["rollout/loss_tokens/mean"] == sum(batch.loss_masks[0])
    assert m.state_dict()["data_source"]["offset"] == 2
