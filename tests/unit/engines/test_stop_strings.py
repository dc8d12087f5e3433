"""Stop strings in the native engine (slime.engines.native.requests.Request): matched on the text the
newest token adds, decoded from a few tokens, not the whole output at every token; the same finish,
token and trimmed text as matching on the whole decoded output."""

import random

import pytest
from transformers import AutoTokenizer

from slime.engines.native.requests import Request
from slime.engines.protocol import parse_sampling_params


class CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, ids, **kw):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)


def _generate(tokenizer, ids, stop):
    """Feed `ids` one token at a time until the request finishes: (tokens fed, finish, text)."""
    out = {}
    r = Request("r", [1, 2], parse_sampling_params({"max_new_tokens": len(ids) + 1, "stop": stop}),
                callback=lambda res, err: out.update(res=res, err=err))
    for t in ids:
        r.add_token(t, set(), 10**9, tokenizer)
        if r.finish is not None:
            break
    r.complete(r.finish or {"type": "length"}, "0", tokenizer)
    return len(r.output_ids), out["res"].finish_reason, out["res"].text


def _whole_output(tok, ids, stop):
    """The rule on the whole decoded output at every token (what the engine did before)."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stop if s in text]
        if hits:
            k, s = min(hits)
            return n, {"type": "stop", "matched": s}, text[:k]
    return len(ids), {"type": "length"}, tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(6))
def test_same_finish_as_matching_the_whole_output(tiny_model_dir, seed):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(seed)
    ids = [rng.randrange(5, tok.vocab_size) for _ in range(120)]
    full = tok.decode(ids, skip_special_tokens=True)
    a = rng.randrange(20, len(full) - 12)
    stop = ["@@never@@", full[a : a + rng.randrange(1, 8)], full[a + 3 : a + 5]]  # overlapping candidates
    n, finish, text = _generate(tok, ids, stop)
    assert (n, finish, text) == _whole_output(tok, ids, stop)
    assert finish["type"] == "stop"


def test_each_token_decodes_a_few_tokens_not_the_output(tiny_model_dir):
    tok = CountingTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))
    rng = random.Random(0)
    ids = [rng.randrange(5, tok.tok.vocab_size) for _ in range(600)]
    n, finish, _ = _generate(tok, ids, ["@@never@@"])
    assert n == 600 and finish["type"] == "length"
    assert tok.longest == 600  # the one whole decode: the result's text at the end
    tok.longest = 0
    r = Request("r", [1], parse_sampling_params({"max_new_tokens": 1000, "stop": ["@@never@@"]}),
                callback=lambda *a: None)
    for t in ids:
        r.add_token(t, set(), 10**9, tok)
    assert tok.longest <= 4, tok.longest  # while generating: the newest token and its context


def _byte_level_tokenizer():
    """A small byte-level BPE: characters outside its merges are split into byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["the answer is here and there", "stop words end it"] * 20,
                          trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t)


def test_multi_byte_characters_match_once_whole():
    tok = _byte_level_tokenizer()
    text = "the answer — Straße 日本語 🚀 is here"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))  # characters span tokens
    for stop in ("日本", "🚀", "ße 日"):
        n, finish, out = _generate(tok, ids, [stop])
        first = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
        assert (n, finish, out) == (first, {"type": "stop", "matched": stop}, text[: text.find(stop)])
