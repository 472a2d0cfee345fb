"""tools/bench/weight_sync.py on the tiny shape: every mode pushes from both sources, each row pairs
its timed passes with memory copies, and every printed figure is present and finite."""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_weight_sync_bench_prints_every_mode_and_source_against_its_own_copies():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "weight_sync.py"),
                           "--shape", "tiny", "--repeats", "2", "--fp8", "off"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    head, copy, *rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert head["shape"] == "tiny" and head["repeats"] == 2 and head["bytes"] > 0
    assert copy["what"] == "memory copy" and copy["ratio"] == 1.0
    assert [r["what"] for r in rows] == [f"sync {m} {s}" for m in ("tensor", "distributed", "disk")
                                         for s in ("stored", "memory")]
    for r in [copy] + rows:
        for key in ("median_s", "min_s", "max_s", "GB/s", "copy_median_s", "ratio", "cpu_s"):
            assert math.isfinite(r[key]) and r[key] >= 0, (r["what"], key, r[key])
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert math.isclose(r["ratio"], r["median_s"] / r["copy_median_s"], rel_tol=0.02)
