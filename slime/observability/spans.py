"""Per-sample timeline spans: where each sample's wall time went (docs/timeline.md).

A span is a plain dict kept in `Sample.spans` (so it travels with the sample: rollout dumps,
checkpoints, partial-rollout buffers)::

    {"kind": "decode", "start": 1733.52, "end": 1734.10,          # seconds since the epoch
     "engine": "http://127.0.0.1:30001", "weight_version": 3,      # engine calls (when known)
     "name": "search", "tokens": 42, ...}                           # optional attributes

Kinds (`KINDS`): `queued` (from sending a request until the engine started its prefill: the
client's concurrency cap, the router, HTTP, the engine's waiting queue), `prefill`, `decode`
(first token until the response arrived), `generate` (one engine call whose engine did not report
a prefill/decode split), `tool`, `env` (environment or agent code between model calls), `reward`,
`teacher` (the served OPD teacher's scoring), `wait` (a sample done, waiting for its group's
`--group-rm` reward) and `other` (rollout code between recorded spans, filled in by
`close_sample` so a sample's spans cover its whole wall time).

Custom code records its own work with `sample_span`:

    from slime.observability.spans import sample_span

    with sample_span(sample, "tool", name="search"):
        result = await search(query)

Where rollout writes them: `<output-dir>/timeline/rollout_<N>.jsonl` (`write_rollout`), read by
`python -m slime.timeline RUN_DIR --rollout N`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

KINDS = ("queued", "prefill", "decode", "generate", "tool", "env", "reward", "teacher", "wait", "other")
ENGINE_KINDS = ("prefill", "decode", "generate")  # the spans an engine works on a request
GAP_TOLERANCE_S = 1e-3  # gaps shorter than this are not filled with an `other` span
TIMELINE_DIR = "timeline"


def add_span(sample, kind: str, start: float, end: float, **attrs: Any) -> dict:
    """Append one span to `sample.spans` (attributes that are None are left out); returns it."""
    span = {"kind": kind, "start": round(float(start), 6), "end": round(float(max(end, start)), 6)}  # microseconds
    span.update({k: v for k, v in attrs.items() if v is not None})
    sample.spans.append(span)
    return span


@contextlib.contextmanager
def sample_span(sample, kind: str, name: str | None = None, **attrs: Any) -> Iterator[dict]:
    """Record the time the `with` block takes as a span of `sample` (also when it raises). Yields the
    attributes dict: keys set on it inside the block (e.g. `attrs["ok"] = False`) land on the span.
    Works around `await`s in async code."""
    extra = dict(attrs, name=name)
    start = time.time()
    try:
        yield extra
    finally:
        add_span(sample, kind, start, time.time(), **extra)


def add_engine_call(sample, start: float, end: float, timing: dict | None = None, engine: str | None = None,
                    weight_version: int | None = None, tokens: int | None = None) -> list[dict]:
    """Spans of one engine call the client saw from `start` to `end` (time.time()).

    With the engine's `timing` (meta_info `queue_time`, `prefill_time`, `e2e_latency` in seconds: the
    native engine reports them) the window is split into queued, prefill and decode, laid out back
    from `end`: decode = e2e - queue - prefill ends when the response arrived, prefill before it, and
    queued is the rest of the window (client cap, router, HTTP and the engine's queue). Without them
    (SGLang, the vLLM adapter, a stand-in) the call is one `generate` span; nothing is made up."""
    attrs = {"engine": engine, "weight_version": weight_version}
    timing = timing or {}
    if not all(isinstance(timing.get(k), (int, float)) for k in ("queue_time", "prefill_time", "e2e_latency")):
        return [add_span(sample, "generate", start, end, tokens=tokens, **attrs)]
    decode = max(0.0, timing["e2e_latency"] - timing["queue_time"] - timing["prefill_time"])
    decode_start = max(start, end - decode)
    prefill_start = max(start, decode_start - max(0.0, timing["prefill_time"]))
    out = []
    if prefill_start > start:
        out.append(add_span(sample, "queued", start, prefill_start, engine=engine))
    out.append(add_span(sample, "prefill", prefill_start, decode_start, **attrs))
    out.append(add_span(sample, "decode", decode_start, end, tokens=tokens, **attrs))
    return out


def close_sample(sample, start: float, end: float, tolerance: float = GAP_TOLERANCE_S) -> None:
    """Fill the gaps of more than `tolerance` s between `sample`'s spans in its window [start, end]
    with `other` spans, so that its spans cover the whole window. Spans that ended before `start`
    (an earlier rollout of a partial-rollout sample) are left as they are."""
    inside = sorted((s for s in sample.spans if s["end"] > start), key=lambda s: s["start"])
    t = start
    gaps = []
    for s in inside:
        if s["start"] - t > tolerance:
            gaps.append((t, s["start"]))
        t = max(t, s["end"])
    if end - t > tolerance:
        gaps.append((t, end))
    for a, b in gaps:
        add_span(sample, "other", a, b)
    sample.spans.sort(key=lambda s: s["start"])


def coverage(spans: list[dict], start: float, end: float) -> tuple[float, float]:
    """(total gap, total overlap) in seconds of `spans` over the window [start, end]."""
    gap = overlap = 0.0
    t = start
    for s in sorted(spans, key=lambda s: s["start"]):
        a, b = max(s["start"], start), min(s["end"], end)
        if b <= a:
            continue
        if a > t:
            gap += a - t
        else:
            overlap += min(t, b) - a
        t = max(t, b)
    return gap + max(0.0, end - t), overlap


# ---------------------------------------------------------------------------------- files
def rollout_path(output_dir: str | Path, rollout_id: int) -> Path:
    return Path(output_dir) / TIMELINE_DIR / f"rollout_{rollout_id}.jsonl"


def sample_row(sample, trained: bool) -> dict:
    return {"index": sample.index, "group_index": sample.group_index, "status": getattr(sample.status, "value",
                                                                                         sample.status),
            "reward": sample.reward, "response_length": sample.response_length,
            "weight_versions": list(sample.weight_versions), "trained": trained, "spans": sample.spans}


def write_rollout(output_dir: str | Path, rollout_id: int, samples: list, trained: list,
                  engines: list[str], start: float, end: float) -> Path:
    """`<output-dir>/timeline/rollout_<N>.jsonl`: a header line `{"rollout_id", "start", "end",
    "engines"}` (the rollout's window and every engine URL, idle ones too), then one line per sample
    generated in the rollout (`samples`; those also in `trained` have `"trained": true`):
    index, group_index, status, reward, response_length, weight_versions, spans. Written atomically."""
    path = rollout_path(output_dir, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {id(s) for s in trained}
    seen: set[int] = set()
    rows = []
    for s in list(samples) + list(trained):  # trained samples not generated now (buffer) are listed too
        if id(s) not in seen:
            seen.add(id(s))
            rows.append(sample_row(s, id(s) in kept))
    header = {"rollout_id": rollout_id, "start": start, "end": end, "engines": list(engines)}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in [header, *rows]:
            f.write(json.dumps(row, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_rollout(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, sample rows) of a file `write_rollout` wrote; ValueError naming the line when malformed."""
    path = Path(path)
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} is empty")
    rows = []
    for lineno, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
    header, samples = rows[0], rows[1:]
    if "rollout_id" not in header or any("spans" not in r for r in samples):
        raise ValueError(f"{path} is not a slime timeline file (header and per-sample spans expected)")
    return header, samples
