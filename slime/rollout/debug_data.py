"""Rollout data on disk for debugging and replay (`--save-debug-rollout-data`, `--load-debug-rollout-data`).

One JSON file per rollout: `{"rollout_id": k, "samples": [Sample as a dict, ...]}` with the
scored samples exactly as generation produced them (tokens, response length, loss mask,
rollout log-probs, reward, status, group index, ...). Loading it gives back the same
Samples, so a replayed rollout trains on exactly the data of the saved one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from slime.types import Sample
from slime.utils.errors import DataError


def rollout_path(template: str, rollout_id: int) -> Path:
    return Path(template.replace("{rollout_id}", str(rollout_id)))


def save_samples(template: str, rollout_id: int, samples: list[Sample]) -> Path:
    path = rollout_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [s.to_dict() for s in samples]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"rollout_id": rollout_id, "samples": rows}, f)
    os.replace(tmp, path)
    return path


def load_samples(template: str, rollout_id: int) -> list[Sample]:
    path = rollout_path(template, rollout_id)
    if not path.is_file():
        raise DataError(f"--load-debug-rollout-data: {path} (rollout {rollout_id}) does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        names = {f.name for f in dataclasses.fields(Sample)}
        samples = []
        for i, row in enumerate(data["samples"]):
            unknown = set(row) - names
            if unknown:
                raise ValueError(f"sample {i} has unknown fields {sorted(unknown)}")
            samples.append(Sample.from_dict(row))
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"--load-debug-rollout-data: {path} is not rollout data written by slime ({e})") from None
    return samples
