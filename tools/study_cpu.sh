#!/usr/bin/env bash
# Regenerate the CPU-scale staleness study (docs/study-cpu.md): every setting is a `megapkl compare`
# of the methods a paper contrasts, 5 seeds each (0-4), on configs/study/cpu_staleness.yaml.
# Usage: bash tools/study_cpu.sh [OUT_DIR] [claim ...]   (claims: pkl sis tetpo; default all)
# Runs sequentially; about 125 runs of 15-50 s each on 2 cores. Finished settings are skipped (their
# report.md exists), so an interrupted study resumes where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/study_cpu}"; shift || true
claims=("${@:-pkl sis tetpo}"); claims=(${claims[@]})
PY="${PYTHON:-.venv/bin/python}"
cfg=configs/study/cpu_staleness.yaml
SEEDS=5

run() {  # run NAME METHODS OVERRIDES...
  local name=$1 methods=$2; shift 2
  if [ -f "$out/$name/report.md" ]; then echo "[study] $name: done"; return; fi
  echo "[study] $name: $methods $*"
  "$PY" -m megapkl.cli compare "$cfg" --methods "$methods" --seeds "$SEEDS" --seed-base 0 \
    --out "$out/$name" "$@"
}

for claim in "${claims[@]}"; do
  case "$claim" in
    pkl)    # PKL: PG, GRPO and Proximal KL across controlled staleness k (4 minibatches per batch)
      for k in 0 4 16; do
        run "pkl_k$k" pg,grpo,proximal_kl "rollout.max_staleness=$k"
      done ;;
    sis)    # SIS: token-IS objectives with and without SIS as minibatches per rollout grow (k = 0)
      for n in 1 8; do
        mbs=$(( 32 * 8 / n / 2 ))
        run "sis_n$n" grpo,sis_grpo,dapo,sis_dapo,gspo,sis_gspo "rollout.max_staleness=0" \
          "rollout.minibatches_per_batch=$n" "parallel.micro_batch_size=$mbs"
      done ;;
    tetpo)  # TETPO: uniform staleness, a lag per prompt group drawn from U{1..16}
      run tetpo_uniform16 tetpo,gepo,m2po,grpo "rollout.protocol=uniform_stale" \
        "rollout.max_staleness=16" "rollout.snapshot_pool=32" "reference.mode=behavior" \
        "rollout.minibatches_per_batch=1" "parallel.micro_batch_size=128" ;;
    *) echo "unknown claim $claim (pkl sis tetpo)" >&2; exit 2 ;;
  esac
done
echo "[study] reports under $out/*/report.md"
