#!/usr/bin/env bash
# Set up ./.venv with the test dependencies and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh test
# Two workers (pytest-xdist): tests/conftest.py keeps the tests that start servers or use Slurm
# together in one of them.
exec .venv/bin/python -m pytest tests -n 2 "$@"
