#!/usr/bin/env bash
# Set up a virtual environment and run every test: fast unit tests, then end-to-end runs.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install --quiet --disable-pip-version-check torch==2.13.0 -e ".[test]"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q                # unit tests (e2e excluded by default)
python -m pytest -q -m e2e         # end-to-end: Ray + native engine + FSDP trainer on the tiny model
