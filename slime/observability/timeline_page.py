"""One rollout's timeline as a self-contained HTML page and a summary table (docs/timeline.md).

`summarize(header, rows)` reduces the spans of `<output-dir>/timeline/rollout_<N>.jsonl`
(`slime.observability.spans.read_rollout`) to numbers: sample wall times and the tail, time per
span kind, and per engine the requests it served and how long it was busy or idle.
`format_summary` prints them as a table; `render_html` draws the page: one block per engine, its
busy bar on top (idle time is the gaps) and below it one row per sample that engine served first,
each span a bar coloured by kind, on a shared time axis. Inline SVG and CSS: no script, no network.
"""

from __future__ import annotations

import html
import math
import statistics

from slime.observability.spans import ENGINE_KINDS, KINDS

COLORS = {"queued": "#bab0ac", "prefill": "#f28e2b", "decode": "#4e79a7", "generate": "#76b7b2",
          "tool": "#e15759", "env": "#edc948", "reward": "#59a14f", "teacher": "#b07aa1", "wait": "#ff9da7",
          "other": "#e8e8e8"}
BUSY_COLOR = "#333333"
NO_ENGINE = "(engine not reported)"
LABEL_W, PLOT_W, ROW, PITCH, LANE_HEAD, AXIS_H = 230, 1000, 8, 10, 18, 26


def _window(header: dict, rows: list[dict]) -> tuple[float, float]:
    starts = [s["start"] for r in rows for s in r["spans"]] + [header.get("start", math.inf)]
    ends = [s["end"] for r in rows for s in r["spans"]] + [header.get("end", -math.inf)]
    t0, t1 = min(starts), max(ends)
    if not math.isfinite(t0) or not math.isfinite(t1):
        return 0.0, 1.0
    return t0, max(t1, t0 + 1e-6)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _lane(row: dict) -> str:
    return next((s["engine"] for s in row["spans"] if s.get("engine") and s["kind"] in ENGINE_KINDS), NO_ENGINE)


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))] if v else 0.0


def summarize(header: dict, rows: list[dict]) -> dict:
    """The numbers of one rollout's timeline (see the module docstring)."""
    t0, t1 = _window(header, rows)
    wall = t1 - t0
    sample_wall = {}
    for r in rows:
        if r["spans"]:
            sample_wall[r["index"]] = max(s["end"] for s in r["spans"]) - min(s["start"] for s in r["spans"])
    ends = sorted(max(s["end"] for s in r["spans"]) for r in rows if r["spans"])
    kinds = {}
    for k in KINDS:
        d = [s["end"] - s["start"] for r in rows for s in r["spans"] if s["kind"] == k]
        if d:
            kinds[k] = {"count": len(d), "total": sum(d), "mean": statistics.fmean(d), "p50": _pct(d, 0.5),
                        "p95": _pct(d, 0.95), "max": max(d)}
    engines = {e: {"requests": 0, "samples": 0, "intervals": []} for e in header.get("engines", [])}
    for r in rows:
        lane = _lane(r)
        engines.setdefault(lane, {"requests": 0, "samples": 0, "intervals": []})["samples"] += 1
        for s in r["spans"]:
            if s["kind"] in ENGINE_KINDS:
                e = engines.setdefault(s.get("engine") or NO_ENGINE, {"requests": 0, "samples": 0, "intervals": []})
                e["requests"] += s["kind"] != "decode"  # a split call is prefill + decode: one request
                e["intervals"].append((s["start"], s["end"]))
    per_engine = {}
    for name, e in engines.items():
        busy = _union(e["intervals"])
        per_engine[name] = {"requests": e["requests"], "samples": e["samples"], "busy": busy,
                            "busy_pct": 100.0 * busy / wall, "idle": wall - busy}
    slowest = sorted(rows, key=lambda r: -sample_wall.get(r["index"], 0.0))[:5]
    return {
        "rollout_id": header.get("rollout_id"), "start": t0, "wall": wall, "samples": len(rows),
        "trained": sum(bool(r.get("trained")) for r in rows),
        "sample_wall": {"p50": _pct(list(sample_wall.values()), 0.5), "p90": _pct(list(sample_wall.values()), 0.9),
                        "max": max(sample_wall.values(), default=0.0)},
        # the long tail: from the moment 90% of the samples were done to the last one
        "tail": (ends[-1] - ends[max(0, math.floor(0.9 * len(ends)) - 1)]) if ends else 0.0,
        "kinds": kinds, "engines": per_engine,
        "slowest": [{"index": r["index"], "wall": sample_wall.get(r["index"], 0.0),
                     "tokens": r.get("response_length"), "status": r.get("status"),
                     "most": _most(r["spans"])} for r in slowest],
    }


def _most(spans: list[dict]) -> str:
    by: dict[str, float] = {}
    for s in spans:
        by[s["kind"]] = by.get(s["kind"], 0.0) + s["end"] - s["start"]
    return max(by, key=by.get) if by else "-"


def format_summary(sm: dict) -> str:
    """`summarize`'s numbers as plain-text tables."""
    lines = [f"rollout {sm['rollout_id']}: {sm['samples']} samples ({sm['trained']} trained), wall {sm['wall']:.2f} s; "
             f"sample wall p50 {sm['sample_wall']['p50']:.2f} s, p90 {sm['sample_wall']['p90']:.2f} s, "
             f"max {sm['sample_wall']['max']:.2f} s; tail (last 10% of samples) {sm['tail']:.2f} s", ""]
    lines.append(f"{'span':<10}{'count':>7}{'total_s':>10}{'mean_s':>9}{'p50_s':>9}{'p95_s':>9}{'max_s':>9}")
    for k, v in sm["kinds"].items():
        lines.append(f"{k:<10}{v['count']:>7}{v['total']:>10.2f}{v['mean']:>9.3f}{v['p50']:>9.3f}{v['p95']:>9.3f}"
                     f"{v['max']:>9.3f}")
    lines += ["", f"{'engine':<32}{'requests':>9}{'samples':>9}{'busy_s':>9}{'busy%':>7}{'idle_s':>9}"]
    for name, e in sm["engines"].items():
        lines.append(f"{name:<32}{e['requests']:>9}{e['samples']:>9}{e['busy']:>9.2f}{e['busy_pct']:>7.1f}"
                     f"{e['idle']:>9.2f}")
    lines += ["", f"{'slowest sample':<16}{'wall_s':>8}{'tokens':>8}  {'status':<10}most time in"]
    for s in sm["slowest"]:
        lines.append(f"{s['index']:<16}{s['wall']:>8.2f}{s['tokens'] if s['tokens'] is not None else '-':>8}  "
                     f"{str(s['status']):<10}{s['most']}")
    return "\n".join(lines)


def _ticks(wall: float) -> list[float]:
    raw = wall / 8
    step = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 5, 10):
        if m * step >= raw:
            step *= m
            break
    return [i * step for i in range(int(wall / step) + 1)]


def _span_title(r: dict, s: dict) -> str:
    extra = "".join(f", {k} {s[k]}" for k in ("name", "engine", "weight_version", "tokens") if k in s)
    return f"sample {r['index']} (group {r.get('group_index')}): {s['kind']} {s['end'] - s['start']:.3f} s{extra}"


def render_html(header: dict, rows: list[dict], title: str = "") -> str:
    """The self-contained page (see the module docstring)."""
    sm = summarize(header, rows)
    t0, wall = sm["start"], sm["wall"]

    def x(t: float) -> float:
        return LABEL_W + (t - t0) / wall * PLOT_W

    lanes: dict[str, list[dict]] = {e: [] for e in sm["engines"]}
    for r in rows:
        lanes.setdefault(_lane(r), []).append(r)
    busy: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        for s in r["spans"]:
            if s["kind"] in ENGINE_KINDS:
                busy.setdefault(s.get("engine") or NO_ENGINE, []).append((s["start"], s["end"]))
    parts, y = [], AXIS_H
    for name, members in lanes.items():
        e = sm["engines"].get(name, {"busy_pct": 0.0, "requests": 0})
        parts.append(f'<text x="4" y="{y + 12}" class="lane">{html.escape(name)}</text>'
                     f'<text x="{LABEL_W - 6}" y="{y + 12}" class="pct">{e["busy_pct"]:.0f}% busy</text>')
        parts.append(f'<rect x="{LABEL_W}" y="{y + 3}" width="{PLOT_W}" height="10" fill="#f4f4f4"/>')
        for a, b in busy.get(name, []):  # every call it served (samples listed under another engine too)
            parts.append(_rect(x(a), y + 3, x(b) - x(a), 10, BUSY_COLOR, None))
        y += LANE_HEAD
        for r in sorted(members, key=lambda r: min((s["start"] for s in r["spans"]), default=0.0)):
            parts.append(f'<text x="{LABEL_W - 6}" y="{y + ROW}" class="row">#{r["index"]}'
                         f'{"" if r.get("trained", True) else " (dropped)"}</text>')
            for s in r["spans"]:
                parts.append(_rect(x(s["start"]), y, x(s["end"]) - x(s["start"]), ROW,
                                   COLORS.get(s["kind"], "#999999"), _span_title(r, s)))
            y += PITCH
        y += 6
    height = y + 4
    grid = []
    for t in _ticks(wall):
        grid.append(f'<line x1="{x(t0 + t):.1f}" y1="{AXIS_H - 6}" x2="{x(t0 + t):.1f}" y2="{height}" class="grid"/>'
                    f'<text x="{x(t0 + t):.1f}" y="{AXIS_H - 10}" class="tick">{t:g} s</text>')
    legend = "".join(f'<span class="key"><span class="sw" style="background:{c}"></span>{k}</span>'
                     for k, c in [*COLORS.items(), ("engine busy", BUSY_COLOR)])
    heading = html.escape(title or f"rollout {sm['rollout_id']}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>slime timeline: {heading}</title>
<style>
body {{ font: 13px sans-serif; margin: 16px; color: #222; background: #fff; }}
h1 {{ font-size: 18px; margin: 0 0 6px; }}
.key {{ margin-right: 14px; white-space: nowrap; }}
.sw {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -2px; }}
svg text {{ font: 11px sans-serif; fill: #555; }}
svg .row, svg .pct {{ text-anchor: end; font-size: 8px; fill: #666; }}
svg .pct {{ font-size: 10px; }}
svg .lane {{ font-weight: bold; }}
svg .tick {{ text-anchor: middle; }}
svg .grid {{ stroke: #ddd; stroke-width: 1; }}
pre {{ background: #f7f7f7; padding: 8px; overflow-x: auto; }}
</style></head><body>
<h1>{heading}</h1>
<p>{sm['samples']} samples, wall {wall:.2f} s, {len(lanes)} engine lane(s). One row per sample under the engine
that served its first call; the dark bar on each engine's line is when it was working (gaps: idle).
Hover a bar for its sample, kind, duration, engine and weight version.</p>
<div class="legend">{legend}</div>
<svg xmlns="http://www.w3.org/2000/svg" width="{LABEL_W + PLOT_W + 10}" height="{height}" shape-rendering="crispEdges">
{''.join(grid)}
{''.join(parts)}
</svg>
<h2>Summary</h2>
<pre>{html.escape(format_summary(sm))}</pre>
</body></html>
"""


def _rect(x: float, y: float, w: float, h: float, color: str, title: str | None) -> str:
    w = max(w, 0.5)
    tip = f"<title>{html.escape(title)}</title>" if title else ""
    return f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{h}" fill="{color}">{tip}</rect>'
