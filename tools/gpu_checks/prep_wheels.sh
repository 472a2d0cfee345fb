#!/usr/bin/env bash
# Fill tools/gpu_checks/wheels/ (ignored by git) with what run_all.sh installs on a GPU machine that
# has torch but no network: megatron-core (a compiled wheel for that machine's Python), the
# transformers megapkl pins (pure Python) and a regex recent enough for it. Everything else the
# checks import ships with a CUDA torch image (numpy, safetensors, tokenizers, huggingface-hub,
# pyyaml, einops, ...). Run it where pip can reach the registry; PYTHON_VERSION is the GPU
# machine's (default 3.12). About 16 MB in all.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
rm -rf wheels
mkdir -p wheels
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels \
    "megatron-core==0.16.1" "transformers==5.19.0" "regex==2026.11.19"
du -sh wheels
