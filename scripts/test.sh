#!/usr/bin/env bash
# Set up a virtual environment and run every test: fast unit tests, then end-to-end runs.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install --quiet --disable-pip-version-check torch==2.13.0 -e ".[test]"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q                   # fast unit tests (e2e and slow excluded by default)
python -m pytest -q -m "e2e or slow"  # end-to-end runs (Ray + native engine + FSDP trainer) and slow tests
