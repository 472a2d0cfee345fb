"""tools/bench/node_refresh.py on the tiny shape: the three ways of refreshing (leader-only and
per-node `tensor`, leader `distributed`) each refresh their servers, a server of the last node
holds the stored weights bit for bit, and every printed figure is present and finite."""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_node_refresh_prints_the_three_ways_and_their_ratios():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "node_refresh.py"),
                           "--shape", "tiny", "--repeats", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    head, *rows, bits, ratios = [json.loads(line) for line in proc.stdout.splitlines()]
    assert (head["shape"], head["nodes"], head["servers_per_node"]) == ("tiny", 2, 1)
    assert [(r["mode"], r["pushers"], r["servers"]) for r in rows] == [
        ("tensor", 1, 1), ("tensor", 2, 2), ("distributed", 1, 2)]
    for r in rows:
        for key in ("median_s", "min_s", "max_s", "s_per_server", "peak/bucket", "peak/model"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["what"], key, r[key])
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        # each pushing rank reads the stored file once and hands every tensor byte on once
        assert r["read_bytes"] >= head["file_bytes"] and r["handed_bytes"] == head["bytes"], r
        assert r["peak_bytes"] > 0
    # gloo's root writes the whole model to each of the servers; shared memory writes none of it
    assert rows[2]["wrote_bytes"] >= rows[2]["servers"] * head["bytes"]
    assert rows[0]["wrote_bytes"] < head["bytes"]
    assert bits["equal"] is True and bits["tensors"] > 0 and bits["elements"] > 0
    assert set(ratios) == {"b/a_s", "b/c_s"}
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
