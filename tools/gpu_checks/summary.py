"""The one JSON summary of run_all.sh: every check's verdict and the figures (tokens/s, MFU, peak
memory, export and FP8 seconds), from the JSON lines and exit codes the checks left in OUT.

    python tools/gpu_checks/summary.py OUT_DIR [gpu|cpu]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def lines(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                out.append(row)
    return out


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    status = dict(ln.split() for ln in (out / "status.txt").read_text().splitlines() if ln)
    train = next(iter(lines(out / "train.json")), {})
    launch = next(iter(lines(out / "launch.json")), {})
    fp8 = {row.get("check"): row for row in lines(out / "fp8.json")}
    quant, bound = fp8.get("export_quantize", {}), fp8.get("error_bound", {})
    cycle = {row.get("check"): row for row in lines(out / "lifecycle.json")}
    lifecycle = {"checks": cycle}
    notice = next(iter(lines(out / "notice.json")), {})
    threads = next(iter(lines(out / "threads.json")), {})
    verdicts = {
        "train": status.get("train") == "0" and train.get("ok") is True,
        "launch": status.get("launch") == "0" and launch.get("ok") is True,
        "fp8": status.get("fp8") == "0" and bound.get("ok") is True,
        "lifecycle": status.get("lifecycle") == "0" and len(cycle) == 2
        and all(row.get("ok") is True for row in cycle.values()),
        "notice": status.get("notice") == "0" and notice.get("ok") is True,
        "threads": status.get("threads") == "0" and threads.get("ok") is True,
    }
    failed = {name: {"exit": status.get(name),
                     "checks": [k for k, c in res.get("checks", {}).items()
                                if not (c.get("ok") if isinstance(c, dict) else c)],
                     "log_tail": (out / f"{name}.log").read_text(errors="replace")
                     .splitlines()[-5:] if (out / f"{name}.log").exists() else []}
              for name, res in (("train", train), ("launch", launch), ("fp8", bound),
                                ("lifecycle", lifecycle), ("notice", notice),
                                ("threads", threads))
              if not verdicts[name]}
    summary = {
        "ok": all(verdicts.values()), "mode": argv[1] if len(argv) > 1 else "gpu",
        "device": train.get("device"), "verdicts": verdicts,
        "tokens_per_s": train.get("tokens_per_s"), "mfu": train.get("mfu"),
        "update_s": train.get("update_s"), "update_split_s": train.get("update_split_s"),
        "peak_memory_gib": train.get("peak_memory_gib"),
        "weight_export_s": train.get("weight_export_s"), "resume_s": train.get("resume_s"),
        "fp8_export_plus_quantize_s": quant.get("export_plus_quantize_s"),
        "fp8_goal_le_1s": quant.get("goal_export_plus_quantize_le_1s"),
        "update_group_splits": {k: cycle.get("update_group", {}).get(k) for k in (
            "split_count_before", "split_count_after_update_group",
            "split_count_after_control_new_group")},
        "resume_fits_after_free": cycle.get("free_before_resume", {}).get("ok"),
        "notice_mode": notice.get("mode"),
        "notice_left_after_fault_s": notice.get("left_after_fault_s"),
        "thread_devices": {"gpus": threads.get("gpus"), "skipped": threads.get("skipped"),
                           "seen": threads.get("seen")},
        "seconds": {"train": train.get("total_s"), "launch": launch.get("total_s")},
        "failed": failed,
    }
    text = json.dumps(summary)
    (out / "summary.json").write_text(text + "\n")
    print(text, flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
