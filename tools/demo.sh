#!/usr/bin/env bash
# Set up ./.venv and run the CPU demo (tiny model, embedded rollout engine, Proximal KL).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh test
exec .venv/bin/megapkl demo "$@"
