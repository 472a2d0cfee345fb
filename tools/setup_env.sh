#!/usr/bin/env bash
# Create ./.venv and install megapkl with torch 2.14.1 (on x86_64 its CUDA 13 build, NVIDIA libraries
# included; it runs on CPU) and torchvision 0.29.1. Idempotent; safe to re-run.
# Usage: bash tools/setup_env.sh [extra]   (extra: "test" installs the test dependencies too)
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch 2.14.1 is the GPU stack's (sglang 0.5.23 pins it) and runs on CPU; torchvision 0.29.1 is its
# pair (SGLang's request structs import it). Both lie on local disk on our machines; asking for them by
# exact version keeps pip from resolving anything else. Skip when that torch is already installed.
TORCH="${MEGAPKL_TORCH_VERSION:-2.14.1}"
if [ "$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$TORCH" ]; then
  "${PIP[@]}" "torch==$TORCH" "torchvision==${MEGAPKL_TORCHVISION_VERSION:-0.29.1}"
fi
if [ -n "$extra" ]; then
  "${PIP[@]}" -e ".[$extra]"
else
  "${PIP[@]}" -e .
fi
# The test environment holds the pinned sglang (the `gpu` extra's), without its dependencies: the
# contract tests (tests/contract/) run its CPU-side code against what megapkl produces. The wheel is
# fetched once into a cache (MEGAPKL_WHEEL_CACHE, default ~/.cache/megapkl/wheels), so no test
# downloads anything; the CPU packages its modules import come with the `contract` extra.
if [ "$extra" = "test" ]; then
  SGLANG="$(sed -n 's/.*"sglang==\([^"]*\)".*/\1/p' pyproject.toml | head -n1)"
  if [ "$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null)" != "$SGLANG" ]; then
    CACHE="${MEGAPKL_WHEEL_CACHE:-$HOME/.cache/megapkl/wheels}"
    mkdir -p "$CACHE"
    if ! ls "$CACHE"/sglang-"$SGLANG"-*.whl >/dev/null 2>&1; then
      .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: "sglang==$SGLANG" -d "$CACHE"
    fi
    "${PIP[@]}" --no-deps "$(ls "$CACHE"/sglang-"$SGLANG"-*.whl | head -n1)"
  fi
fi
