"""A search agent in the style of Search-R1: a custom generate function with a local BM25 retriever.

    --custom-generate-function-path examples/search_r1/generate.py:generate
    --custom-rm-path examples/search_r1/reward.py:reward --reward-key score
    --custom-config-path examples/search_r1/config_tags.yaml      (or config_tiny.yaml)

One assistant turn grows by model text and retrieved documents, as in Search-R1: the model writes
`<search> query </search>` (generation stops there), the retriever's top passages are appended as
`<information> ... </information>` (environment tokens, loss mask 0, tokenized on their own and
appended, never re-tokenizing what came before), and the model continues until it writes
`<answer> ... </answer>`, ends its turn, runs out of `search_max_turns` model turns, or reaches
--rollout-max-response-len response tokens. The model's own tokens are trained on (mask 1).

Config keys (--custom-config-path YAML):
- `call_format`: `tags` (real models: the Search-R1 tags above) or `plain` (the tiny test model,
  whose word-level vocabulary has no `<search>`: the model writes `question <words> ?`, generation
  stops at `?`, the words are the query and the passages come back after the word `result`; the
  answer is the text of the last turn);
- `search_top_k` (passages per search, default 3), `search_max_turns` (default --max-turns),
  `corpus_path` (JSONL of {id, title, text}; default the corpus.jsonl next to this file).

The searches whose passages were shown are kept in `sample.metadata["queries"]` and counted in
`["searches"]` (logged by reward.py).
"""

from __future__ import annotations

import re
import sys
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from retriever import BM25, CORPUS, format_passages, load_corpus  # noqa: E402

from slime.rollout.api import context, continue_sample  # noqa: E402
from slime.types import SampleStatus  # noqa: E402

FORMATS = {
    "tags": {"stop": ["</search>", "</answer>"], "call": re.compile(r"<search>(.*?)</search>\s*$", re.DOTALL)},
    "plain": {"stop": ["?"], "call": re.compile(r"\bquestion\b(.*?)\?\s*$", re.DOTALL)},
}


@lru_cache(maxsize=4)
def retriever(path: str) -> BM25:
    return BM25(load_corpus(path))


def information(fmt: str, passages: list[dict]) -> str:
    if fmt == "tags":
        return f"\n\n<information>{format_passages(passages)}</information>\n\n"
    return " result " + " ".join(p["text"] for p in passages) + " . "


def search_query(fmt: str, text: str) -> str | None:
    """The query of a turn that ends in a search call, else None."""
    m = FORMATS[fmt]["call"].search(text)
    return m.group(1).strip() if m else None


async def generate(args, sample, sampling_params):
    fmt = getattr(args, "call_format", "tags")
    if fmt not in FORMATS:
        raise ValueError(f"call_format must be one of {sorted(FORMATS)}, got {fmt!r}")
    tokenizer = context().tokenizer
    bm25 = retriever(str(getattr(args, "corpus_path", None) or CORPUS))
    top_k = int(getattr(args, "search_top_k", 3))
    max_turns = int(getattr(args, "search_max_turns", None) or args.max_turns)
    budget = sampling_params.get("max_new_tokens", args.rollout_max_response_len)
    stop = list(sampling_params.get("stop") or []) + FORMATS[fmt]["stop"]
    turns, queries, text = 0, [], ""
    while turns < max_turns:
        left = budget - sample.response_length
        if left <= 0:
            sample.status = SampleStatus.TRUNCATED
            break
        params = {**sampling_params, "max_new_tokens": left, "stop": stop, "no_stop_trim": True}
        if params.get("sampling_seed") is not None:
            params["sampling_seed"] = int(params["sampling_seed"]) + turns
        out = await continue_sample(sample, params)
        turns += 1
        text = out.text
        query = search_query(fmt, text) if out.finish_reason == "stop" else None
        if query is None or turns == max_turns:
            break
        ids = tokenizer(information(fmt, bm25.search(query, top_k)), add_special_tokens=False)["input_ids"]
        if sample.response_length + len(ids) >= budget:  # no room for the passages and an answer
            sample.status = SampleStatus.TRUNCATED
            break
        sample.append_env_tokens(ids)
        queries.append(query)
    sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=False)
    sample.metadata = {**sample.metadata, "turns": turns, "searches": len(queries), "queries": queries,
                       "last_turn": text}
    return sample
