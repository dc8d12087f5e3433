"""tools/compare_metrics.py: value-by-value comparison of two metrics.jsonl, timings aside."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("compare_metrics", ROOT / "tools" / "compare_metrics.py")
compare_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_metrics)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_timings_are_ignored_values_are_listed_and_misaligned_keys_fail(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [{"rollout_id": 0, "train/loss": 1.5, "perf/train_time": 3.0, "memory/rss": 1}])
    b = _write(tmp_path / "b.jsonl", [{"rollout_id": 0, "train/loss": 1.5, "perf/train_time": 9.0, "memory/rss": 2}])
    assert compare_metrics.main([a, b]) == 0
    assert capsys.readouterr().out.strip() == "1 records, 2 values compared, 0 differ"
    c = _write(tmp_path / "c.jsonl", [{"rollout_id": 0, "train/loss": 1.25}])
    assert compare_metrics.main([a, c]) == 0
    assert "0 train/loss 1.5 1.25" in capsys.readouterr().out
    d = _write(tmp_path / "d.jsonl", [{"rollout_id": 0, "train/kl": 0.0}])
    assert compare_metrics.main([a, d]) == 1
    assert "keys only on one side: ['train/kl', 'train/loss']" in capsys.readouterr().out
