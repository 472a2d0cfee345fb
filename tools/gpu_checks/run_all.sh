#!/usr/bin/env bash
# The GPU checks in one command, on one GPU, in under 11 minutes, without network:
#   tools/gpu_checks/run_all.sh          # GPU: installs tools/gpu_checks/wheels/*.whl first
#   tools/gpu_checks/run_all.sh --cpu    # the same scripts and code paths on CPU (gloo, tiny)
# 1. train_gpu.py: bf16 train steps of a Qwen3-1.7B-shaped model through the trainer (NCCL, world
#    size 1), the final checkpoint, a resume from it; tokens/s, MFU, peak memory, export seconds;
# 2. launch_gpu.py: `megapkl train` under torchrun, SIGTERM mid-run (the stop-signal path:
#    checkpoint and exit), resume to the end;
# 3. fp8_gpu.py: block-FP8 quantization of a Qwen3-8B-shaped export on the GPU (goal <= 1 s);
# 4. lifecycle_gpu.py: the weight-update group does not split a device-bound default group, and
#    the trainer's cached blocks are freed before a colocated server resumes;
# 5. notice_gpu.py: a rank failing outside an agreement ends its peer's NCCL collective through
#    the failure notice's abort (two processes, on one GPU or two), one line on both;
# 6. threads_gpu.py: work on megapkl's threads lands on the rank's GPU (needs two GPUs to tell).
# Each check's JSON and log land in $OUT (default $TMPDIR/megapkl_gpu_checks); the last line
# printed is one JSON summary (also summary.json). Exit status 1 when a check failed.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-${TMPDIR:-/tmp}/megapkl_gpu_checks}"
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR/status.txt"
if [ "${1:-}" = "--cpu" ]; then
  MODE=cpu
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  TRAIN=(--device cpu --tiny --steps 2 --resume-steps 1)
  LAUNCH=(--device cpu --steps 20 --timeout 300)  # long enough that SIGTERM lands mid-run
  FP8=(--device cpu --small --repeats 1)
  LIFECYCLE=(--device cpu)
  NOTICE=(--device cpu)
  THREADS=(--device cpu)
  LIMITS=(900 900 300 120 180 120)
else
  MODE=gpu
  WHEELS="$ROOT/tools/gpu_checks/wheels"
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "no wheels in $WHEELS: run tools/gpu_checks/prep_wheels.sh where pip reaches the" \
         "registry, and bring the folder along (README.md)" >&2
    exit 2
  fi
  SITE="${TMPDIR:-/tmp}/megapkl_gpu_site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl || exit 2
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  TRAIN=(--steps 4 --resume-steps 1)  # each 1.7B checkpoint save took 78 s on an H200's disk
  LAUNCH=(--steps 30 --timeout 60)
  FP8=()
  LIFECYCLE=()
  NOTICE=()
  THREADS=()
  LIMITS=(330 100 60 40 90 45)   # 11 min at most, the installation above in the margin
fi
export PYTHONUNBUFFERED=1

check() {  # name, time limit (s), script and arguments
  local name="$1" limit="$2"
  shift 2
  timeout "$limit" "$PY" "$@" >"$OUT_DIR/$name.json" 2>"$OUT_DIR/$name.log"
  echo "$name $?" >>"$OUT_DIR/status.txt"
}
check train "${LIMITS[0]}" tools/gpu_checks/train_gpu.py "${TRAIN[@]}"
check launch "${LIMITS[1]}" tools/gpu_checks/launch_gpu.py "${LAUNCH[@]}"
check fp8 "${LIMITS[2]}" tools/gpu_checks/fp8_gpu.py "${FP8[@]}"
check lifecycle "${LIMITS[3]}" tools/gpu_checks/lifecycle_gpu.py "${LIFECYCLE[@]}"
check notice "${LIMITS[4]}" tools/gpu_checks/notice_gpu.py "${NOTICE[@]}"
check threads "${LIMITS[5]}" tools/gpu_checks/threads_gpu.py "${THREADS[@]}"
exec "$PY" tools/gpu_checks/summary.py "$OUT_DIR" "$MODE"
