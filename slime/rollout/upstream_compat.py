"""Adapters that give original slime's built-in functions this project's flag signatures
(docs/custom_rollout.md). Reached through the path aliases of `slime.utils.slime_paths`, e.g.
`--custom-generate-function-path slime.rollout.sglang_rollout.generate` loads `generate` here.
"""

from __future__ import annotations

import logging
import time

from slime.rollout.api import context
from slime.rollout.generate import generate as _generate
from slime.types import Sample
from slime.utils.errors import SlimeConfigError

logger = logging.getLogger(__name__)

SFT_PATH = "slime.rollout.sft_rollout.generate_rollout"


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """`--custom-generate-function-path`: original slime's `sglang_rollout.generate`, one engine
    call continuing the sample: this project's default generation, through the rollout's engines."""
    return await _generate(context().engines, sample, sampling_params)


def sft_rollout(args, rollout_id: int, data_source, evaluation: bool = False) -> list[list[Sample]]:
    """`--rollout-function-path`: original slime's `sft_rollout.generate_rollout`, the next
    `--rollout-batch-size` conversations, tokenized with their loss masks. Here that is what
    `--loss-type sft_loss` does by itself (its data source renders the chat data; the run then never
    calls this function); any other run is refused."""
    if args.loss_type != "sft_loss":
        raise SlimeConfigError(f"--rollout-function-path {SFT_PATH}: SFT here is --loss-type sft_loss; add it")
    if evaluation:
        raise SlimeConfigError(f"--rollout-function-path {SFT_PATH}: SFT has no evaluation rollout")
    return data_source.get_samples(args.rollout_batch_size)


def sleep_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """`--rollout-function-path`: original slime's `sleep_rollout.sleep`, for profiling: the engines
    come up and the rollout waits forever (logging every hour), leaving them to manual requests
    (cut by --stage-timeout)."""
    hours = 0
    while True:
        time.sleep(3600)
        hours += 1
        logger.info("rollout %d sleeping for %d hour(s)", rollout_id, hours)


def pop_first(args, buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """`--buffer-filter-path`: original slime's `data_source.pop_first`, the oldest buffered groups
    first (the built-in data source's default, and it removes what is picked)."""
    return list(buffer[:num_groups])
