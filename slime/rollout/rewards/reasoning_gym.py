"""`--rm-type reasoning_gym`: each task's own verifier from the `reasoning-gym` package.

The sample's metadata holds `{"reasoning_gym": {"dataset": NAME, "entry": ENTRY}}` (written by
`slime.data.reasoning_gym`, both its data source and its JSONL export); the answer is the text in
the response's last `<answer>...</answer>` block, or the whole response when there is none, and
the dataset's `score_answer(answer, entry)` gives the reward (1.0 right, partial credit where the
task defines it, 0.0 wrong).
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def _scorer(name: str):
    import reasoning_gym  # heavy task library (~1 s to import): only for --rm-type reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def extract_answer(response: str) -> str:
    from reasoning_gym.utils import extract_answer as rg_extract  # heavy: see _scorer

    found = rg_extract(response)
    return found if found is not None else response.strip()


def reasoning_gym_reward(args, sample) -> float:
    task = (sample.metadata or {}).get("reasoning_gym")
    if not isinstance(task, dict) or "dataset" not in task or "entry" not in task:
        raise ValueError("--rm-type reasoning_gym: the sample's metadata has no 'reasoning_gym' "
                         "{dataset, entry} (make the data with slime.data.reasoning_gym)")
    return float(_scorer(task["dataset"])(answer=extract_answer(sample.response), entry=task["entry"]))
