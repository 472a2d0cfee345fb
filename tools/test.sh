#!/usr/bin/env bash
# Set up ./.venv with the test dependencies and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh test
# Two workers (pytest-xdist): tests/conftest.py runs the Slurm tests one at a time in one worker and
# the server tests one at a time in the other, the rest filling in.
exec .venv/bin/python -m pytest tests -n 2 "$@"
