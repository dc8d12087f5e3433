"""Prompts for the OpenAI-agent example: arithmetic questions with integer labels.

    python examples/openai_agent/make_data.py OUT_DIR            # the quickstart's task (real models)
    python examples/openai_agent/make_data.py OUT_DIR --tiny     # the tiny model's word-level questions

Real models get the quickstart task (`examples/tasks.py`: "State the final answer to the following
arithmetic problem: 7 - 4 ="); the tiny model gets `what is 3 plus 4 ?` questions
(`examples/tool_use/make_data.py`, plain format). Rows are `{"prompt": [messages], "label": str}`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1]


def make_data(out_dir: str | Path, tiny: bool = False, n_train: int = 256, n_eval: int = 16,
              seed: int = 0) -> tuple[Path, Path]:
    if tiny:
        spec = importlib.util.spec_from_file_location("tool_use_make_data", EXAMPLES / "tool_use" / "make_data.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.make_data(out_dir, "plain", n_train, n_eval, seed)
    sys.path.insert(0, str(EXAMPLES))
    from tasks import make_quickstart_task

    return make_quickstart_task(out_dir, n_train=n_train, n_eval=n_eval, seed=seed)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--n-train", type=int, default=256)
    p.add_argument("--n-eval", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for path in make_data(a.out_dir, a.tiny, a.n_train, a.n_eval, a.seed):
        print(path)
