#!/usr/bin/env bash
# The rollout timeline page in a real browser: writes a small timeline (two engines, one of them idle
# at the end, a tool call, a long-tail sample), renders it with `python -m slime.timeline`, takes a
# headless Chromium screenshot and checks that the bars are on it (pixels of the span colours, the
# engine busy bar). Chromium: the Debian package (`apt-get install -y chromium`); without it this
# prints why and exits 0 (skipped). Usage: bash scripts/check_timeline_html.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

BROWSER=
for b in chromium chromium-browser google-chrome; do
  if command -v "$b" >/dev/null 2>&1; then BROWSER=$b; break; fi
done
if [ -z "$BROWSER" ]; then
  echo "SKIPPED: no chromium on PATH (Debian: apt-get install -y chromium); the timeline page was not checked"
  exit 0
fi

WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK"
"$PY" - "$WORK" <<'EOF'
import sys

from slime.observability import spans
from slime.types import Sample

work = sys.argv[1]
t0 = 1000.0
samples = []
for i in range(6):
    s = Sample(index=i, group_index=i // 2, response_length=20 + i)
    engine = "http://127.0.0.1:30001" if i % 2 == 0 else "http://127.0.0.1:30002"
    start = t0 + 0.2 * i
    long = 6.0 if i == 5 else 0.0  # the long tail
    spans.add_engine_call(s, start, start + 2.0 + long, {"queue_time": 0.3, "prefill_time": 0.4,
                                                         "e2e_latency": 1.9 + long}, engine=engine, weight_version=3)
    spans.add_span(s, "tool", start + 2.0 + long, start + 3.0 + long, name="search")
    spans.add_span(s, "reward", start + 3.0 + long, start + 3.5 + long)
    samples.append(s)
spans.write_rollout(work, 0, samples, samples, ["http://127.0.0.1:30001", "http://127.0.0.1:30002",
                                                "http://127.0.0.1:30003"], t0, t0 + 10.5)
EOF
"$PY" -m slime.timeline "$WORK" --rollout 0
PAGE="$WORK/timeline/rollout_0.html"
PNG="$WORK/timeline/rollout_0.png"
# a profile of its own (no first-run state in the user's), no GPU, no network; --no-sandbox only as root
EXTRA=()
[ "$(id -u)" = 0 ] && EXTRA+=(--no-sandbox)
timeout 120 "$BROWSER" --headless --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
  --user-data-dir="$WORK/chromium-profile" --window-size=1300,700 "${EXTRA[@]}" \
  --screenshot="$PNG" "file://$(cd "$(dirname "$PAGE")" && pwd)/$(basename "$PAGE")" >"$WORK/chromium.log" 2>&1 \
  || { echo "FAILED: chromium did not take the screenshot (log: $WORK/chromium.log)"; tail -20 "$WORK/chromium.log"; exit 1; }
[ -s "$PNG" ] || { echo "FAILED: no screenshot at $PNG (log: $WORK/chromium.log)"; exit 1; }

"$PY" - "$PNG" <<'EOF'
import sys

from PIL import Image

from slime.observability.timeline_page import BUSY_COLOR, COLORS

img = Image.open(sys.argv[1]).convert("RGB")
counts = {rgb: n for n, rgb in img.getcolors(maxcolors=img.size[0] * img.size[1])}


def pixels(hex_color: str, tol: int = 4) -> int:
    want = tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return sum(n for rgb, n in counts.items() if all(abs(a - b) <= tol for a, b in zip(rgb, want)))


bad = []
for name, color in [("queued", COLORS["queued"]), ("prefill", COLORS["prefill"]), ("decode", COLORS["decode"]),
                    ("tool", COLORS["tool"]), ("reward", COLORS["reward"]), ("engine busy", BUSY_COLOR)]:
    n = pixels(color)
    print(f"{name:<12} {color}  {n:>6} pixels")
    if n < 150:  # a legend swatch alone is 144 pixels: the bars must be there too
        bad.append(name)
if bad:
    sys.exit(f"FAILED: the screenshot {sys.argv[1]} ({img.size[0]}x{img.size[1]}) lacks the bars of {bad}")
print(f"OK: {sys.argv[1]} shows the timeline bars")
EOF
