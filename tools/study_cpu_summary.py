"""Summarise the CPU staleness study (tools/study_cpu.sh) as the Markdown tables of docs/study-cpu.md.

    python tools/study_cpu_summary.py runs/study_cpu > summary.md

For every setting: each method's final accuracy and area under the accuracy curve with 95%
bootstrap intervals over the seeds (from the setting's summary.json written by `megapkl compare`).
Across settings: each method's change between the least and the most off-policy setting, and the
differences the paper's claim is about, each with its interval (megapkl.analysis.compare_stats).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from megapkl.analysis import compare_stats as st

CLAIMS = {
    "pkl": (["pkl_k0", "pkl_k4", "pkl_k16"], [("proximal_kl", "grpo"), ("proximal_kl", "pg")]),
    "sis": (["sis_n1", "sis_n8"], [("sis_grpo", "grpo"), ("sis_dapo", "dapo"),
                                   ("sis_gspo", "gspo")]),
    "tetpo": (["tetpo_uniform16"], [("tetpo", "grpo"), ("tetpo", "gepo"), ("tetpo", "m2po")]),
}
METRICS = (("final", "final accuracy"), ("auc", "area under the accuracy curve"))


def fmt(iv: st.Interval) -> str:
    return f"{iv.mean:.3f} [{iv.low:.3f}, {iv.high:.3f}]"


def values(summary: dict, metric: str, method: str) -> list[float]:
    return summary["metrics"][metric]["methods"][method]["values"]


def claim_tables(root: Path, settings: list[str], pairs: list[tuple[str, str]]) -> list[str]:
    found = {s: json.loads((root / s / "summary.json").read_text())
             for s in settings if (root / s / "summary.json").exists()}
    if not found:
        return ["(not run)"]
    lines = []
    for metric, title in METRICS:
        methods = next(iter(found.values()))["methods"]
        lines += [f"**{title}** (mean over seeds, 95% bootstrap interval)", "",
                  "| method | " + " | ".join(found) + " |", "|---" * (len(found) + 1) + "|"]
        for m in methods:
            cells = [fmt(st.mean_interval(values(s, metric, m))) for s in found.values()]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
        if len(found) > 1:
            first, last = list(found)[0], list(found)[-1]
            lines += [f"Change from {first} to {last}:", "", "| method | change | resolved |",
                      "|---|---|---|"]
            for m in methods:
                iv = st.difference_interval(values(found[last], metric, m),
                                            values(found[first], metric, m))
                lines.append(f"| {m} | {fmt(iv)} | {'yes' if iv.excludes_zero else 'no'} |")
            lines.append("")
        lines += ["| setting | difference | value | resolved |", "|---|---|---|---|"]
        for name, s in found.items():
            for a, b in pairs:
                if a in s["methods"] and b in s["methods"]:
                    iv = st.difference_interval(values(s, metric, a), values(s, metric, b))
                    lines.append(f"| {name} | {a} - {b} | {fmt(iv)} | "
                                 f"{'yes' if iv.excludes_zero else 'no'} |")
        lines.append("")
    return lines


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "runs/study_cpu")
    for claim, (settings, pairs) in CLAIMS.items():
        print(f"### {claim}\n")
        print("\n".join(claim_tables(root, settings, pairs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
