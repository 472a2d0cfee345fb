#!/usr/bin/env bash
# The lowest versions pyproject.toml admits, proven by a short run on them (CI runs this beside the
# test suite, which runs on the newest: tools/setup_env.sh). A virtual environment with every
# dependency at its declared lower bound (tools/lower_bounds.py: torch 2.13.0, numpy 2.0.0, ...)
# runs what the training path calls into:
#   - `megapkl demo` for 3 updates (and `--lookup`, multi-turn, for 2): two gloo ranks,
#     megatron-core, the embedded engine, the collective timeouts, checkpoint, TensorBoard-free
#     metrics and the plots;
#   - the math reward (math-verify in its worker process) and `megapkl compare`'s statistics;
#   - with a Slurm cluster here (sinfo answers): `megapkl submit` of the demo through submitit.
# torch comes from local disk only (pip's find-links: never a download of torch or NVIDIA
# libraries); without the torch 2.13.0 wheel there, this stops and says so. The environment is
# kept in .bench-venvs/lower (MEGAPKL_LOWER_VENV) and rebuilt when the bounds change;
# `--build-only` builds (or checks) it and runs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VENV="${MEGAPKL_LOWER_VENV:-.bench-venvs/lower}"
PY="${PYTHON:-python3}"
bounds="$("$PY" tools/lower_bounds.py)"
torch_pin="$(grep '^torch==' <<<"$bounds")"
PIP=(-m pip install --quiet --disable-pip-version-check)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.bounds" 2>/dev/null)" != "$bounds" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # torch alone from the disk (--no-index: its wheel or nothing), then its own dependencies and
  # megapkl's from the index with torch already satisfied
  if ! "$VENV/bin/python" "${PIP[@]}" --no-index --no-deps "$torch_pin"; then
    echo "test_bounds: $torch_pin is not on this machine's disk (pip's find-links); it is never" \
         "downloaded here (a registry's torch is a CUDA build with NVIDIA libraries)" >&2
    exit 1
  fi
  "$VENV/bin/python" "${PIP[@]}" -c <(echo "$bounds") "$torch_pin" -e .
  echo "$bounds" > "$VENV/.bounds"
fi
"$VENV/bin/python" - "$bounds" <<'EOF'
import importlib.metadata as md, sys
want = dict(line.split("==") for line in sys.argv[1].splitlines())
have = {d.metadata["Name"].lower(): d.version for d in md.distributions()}
wrong = {n: have.get(n) for n, v in want.items() if have.get(n, "").split("+")[0] != v}
nvidia = sorted(n for n in have if n.startswith("nvidia-"))
assert not wrong, f"not at the declared lower bound: {wrong}"
assert not nvidia, f"NVIDIA libraries in the lower-bound environment: {nvidia}"
print("lower bounds installed:", ", ".join(f"{n} {v}" for n, v in want.items()))
EOF
if [ "${1:-}" = "--build-only" ]; then  # .ci/run builds it beside the main environment
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
repo="$PWD"
cd "$work"
"$repo/$VENV/bin/megapkl" demo train.steps=3 logging.progress_bar=false > demo.log 2>&1 \
  || { tail -20 demo.log; echo "test_bounds: megapkl demo failed on the lower bounds" >&2; exit 1; }
grep -q "saved checkpoint runs/cpu_demo_proximal_kl/checkpoints/step_00000003" demo.log
# the multi-turn demo: turns over one KV cache, the tool's observations, their masks
"$repo/$VENV/bin/megapkl" demo --lookup train.steps=2 logging.progress_bar=false > lookup.log 2>&1 \
  || { tail -20 lookup.log; echo "test_bounds: megapkl demo --lookup failed on the lower bounds" >&2; exit 1; }
grep -q "saved checkpoint runs/cpu_lookup/checkpoints/step_00000002" lookup.log
"$repo/$VENV/bin/python" - <<'EOF'
from megapkl.analysis import compare_stats as st
from megapkl.rollout.bounded_verify import BoundedVerifier

v = BoundedVerifier(timeout_s=5)
try:
    assert v.score(r"so the answer is \boxed{\frac{1}{2}}", "0.5").correct
    assert not v.score(r"\boxed{3}", "0.5").correct
finally:
    v.close()
t = st.paired_t([0.5, 0.6, 0.7, 0.8], [0.4, 0.45, 0.6, 0.6])
assert 0 < t.diff and t.low < t.diff < t.high and 0 < t.p < 1
assert st.reach_summary([10.0, None, 30.0], [50.0] * 3)["reached"] == 2
print("math reward and compare statistics: ok")
EOF
if command -v sinfo >/dev/null && sinfo >/dev/null 2>&1; then
  "$repo/$VENV/bin/megapkl" submit "$repo/configs/demo/cpu_demo.yaml" --profile local_cpu \
    train.steps=2 logging.progress_bar=false "run_dir=$work/runs/slurm_demo" --wait > submit.log 2>&1 \
    || { tail -20 submit.log; echo "test_bounds: megapkl submit failed on the lower bounds" >&2; exit 1; }
  test "$(wc -l < "$work/runs/slurm_demo/metrics.jsonl")" -eq 2
  echo "megapkl submit on Slurm (submitit $(grep '^submitit==' <<<"$bounds" | cut -d= -f3)): ok"
elif [ "${MEGAPKL_REQUIRE_SLURM:-0}" = "1" ]; then
  echo "test_bounds: MEGAPKL_REQUIRE_SLURM=1 but sinfo does not answer" >&2
  exit 1
fi
echo "test_bounds: the declared lower bounds ran ($(( $(date +%s) - start )) s)"
