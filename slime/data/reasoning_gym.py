"""reasoning-gym tasks as prompt data, scored by each task's own verifier (`--rm-type reasoning_gym`).

Two ways in:
- a data source: `--data-source-path slime.data.reasoning_gym.ReasoningGymDataSource` with a
  `--custom-config-path` YAML holding
      reasoning_gym:
        datasets: {chain_sum: {size: 500, seed: 1}, basic_arithmetic: {size: 500}}
        instruction: "Put the final answer inside <answer></answer>."   # optional
  generates the problems once at start-up (deterministic for the seeds) and serves them like a
  prompt file (epochs, shuffling with --rollout-shuffle, saved state);
- a JSONL export for `--prompt-data` / `--eval-prompt-data`:
      python -m slime.data.reasoning_gym --dataset chain_sum --size 200 --seed 1 --out data.jsonl

Either way each sample's metadata holds `{"reasoning_gym": {"dataset": NAME, "entry": ENTRY}}`,
which the verifier needs; the label is the reference answer.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from transformers import AutoTokenizer

from slime.data.dataset import Prompt, render_prompt
from slime.data.source import RolloutDataSource
from slime.utils.errors import SlimeConfigError

DEFAULT_INSTRUCTION = ""


def make_rows(dataset: str, size: int, seed: int, instruction: str = DEFAULT_INSTRUCTION,
              config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """`size` problems of a reasoning-gym dataset as rows {prompt, label, metadata}."""
    import reasoning_gym  # heavy task library (~1 s to import): only when its data is used

    try:
        ds = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **(config or {}))
    except Exception as e:
        raise SlimeConfigError(f"reasoning_gym dataset {dataset!r}: {type(e).__name__}: {e}") from None
    rows = []
    for entry in ds:
        question = entry["question"] + (f"\n{instruction}" if instruction else "")
        rows.append({"prompt": question, "label": str(entry["answer"]),
                     "metadata": {"reasoning_gym": {"dataset": dataset, "entry": _jsonable(entry)}}})
    return rows


def _jsonable(value):
    """reasoning-gym entries hold tuples and other non-JSON values; checkpoints and JSONL need JSON."""
    return json.loads(json.dumps(value, default=str))


class ReasoningGymDataSource(RolloutDataSource):
    """`--data-source-path slime.data.reasoning_gym.ReasoningGymDataSource` (see the module doc)."""

    def __init__(self, args):
        spec = getattr(args, "reasoning_gym", None)
        if not isinstance(spec, dict) or not isinstance(spec.get("datasets"), dict) or not spec["datasets"]:
            raise SlimeConfigError("ReasoningGymDataSource needs --custom-config-path with a 'reasoning_gym' "
                                   "mapping whose 'datasets' maps dataset names to {size, seed, ...}")
        tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        instruction = spec.get("instruction", DEFAULT_INSTRUCTION)
        prompts = []
        for name, cfg in spec["datasets"].items():
            cfg = dict(cfg or {})
            size, seed = int(cfg.pop("size", 100)), int(cfg.pop("seed", args.rollout_seed))
            for i, row in enumerate(make_rows(name, size, seed, instruction, cfg)):
                text = render_prompt(tokenizer, row["prompt"], args.apply_chat_template,
                                     chat_template_kwargs=args.apply_chat_template_kwargs)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if args.rollout_max_prompt_len is not None and len(ids) > args.rollout_max_prompt_len:
                    continue
                prompts.append(Prompt(row["prompt"], ids, row["label"], row["metadata"], where=f"{name}[{i}]"))
        if not prompts:
            raise SlimeConfigError("ReasoningGymDataSource: no problems (all over --rollout-max-prompt-len?)")
        super().__init__(args, prompts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write reasoning-gym problems as slime prompt JSONL")
    p.add_argument("--dataset", required=True)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows = make_rows(a.dataset, a.size, a.seed, a.instruction)
    with open(a.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} {a.dataset} problems to {a.out}")


if __name__ == "__main__":
    main()
