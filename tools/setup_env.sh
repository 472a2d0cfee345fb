#!/usr/bin/env bash
# Create ./.venv and install megapkl with the CPU build of torch. Idempotent; safe to re-run.
# Usage: bash tools/setup_env.sh [extra]   (extra: "test" installs the test dependencies too)
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# The CPU wheel of torch lies on local disk on our machines; asking for it by exact version keeps
# pip from resolving a multi-GB CUDA build. Skip when a torch is already installed.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" "torch==${MEGAPKL_TORCH_VERSION:-2.13.0}"
fi
if [ -n "$extra" ]; then
  "${PIP[@]}" -e ".[$extra]"
else
  "${PIP[@]}" -e .
fi
