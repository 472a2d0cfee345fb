"""`megapkl data prepare NAME... --out DIR` and `megapkl data list`."""
from __future__ import annotations

import argparse
import sys


def cmd_data_list(args: argparse.Namespace) -> int:
    from megapkl.data.registry import CORPORA, SOURCES, UNAVAILABLE

    for s in SOURCES.values():
        if s.group == "qa":
            continue
        proto = "greedy pass@1" if s.greedy else f"mean@{s.n_samples}"
        extra = f" ({s.data_files})" if s.data_files else ""
        print(f"{s.name:24s} {s.kind:5s} {s.hf_id}{extra} [{s.split}]"
              + (f"  eval: {proto}" if s.kind == "eval" else ""))
    print("\nthe search agent (SIS 5.1, Search-R1): QA sets (exact match), corpus, index")
    for s in SOURCES.values():
        if s.group != "qa":
            continue
        where = "+".join(s.parts) if s.parts else f"{s.hf_id} {s.config} [{s.split}]"
        rows = f"{s.expected_rows:,} questions" if s.expected_rows else ""
        print(f"{s.name:24s} {s.kind:5s} {where}  {rows}; {s.license}")
    for c in CORPORA.values():
        rows = f"{c.rows:,} passages, " if c.rows else ""
        print(f"{c.name:24s} {'file':5s} {c.hf_id} ({', '.join(c.files)})  {rows}{c.size}; "
              f"{c.license}")
    for name, why in UNAVAILABLE.items():
        print(f"{name:24s} n/a   {why}")
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from megapkl.data.prepare import PrepareError, prepare, prepare_corpus
    from megapkl.data.registry import CORPORA, EVAL_SETS, QA_EVAL_SETS

    groups = {"eval": list(EVAL_SETS), "qa_eval": list(QA_EVAL_SETS)}
    names = [n for a in args.names for n in groups.get(a, [a])]
    if (args.from_file or args.out_name) and len(names) != 1:
        print("megapkl: error: --from-file and --as take one dataset name", file=sys.stderr)
        return 2
    for name in names:
        try:
            if name in CORPORA:
                m = prepare_corpus(name, args.out, from_file=args.from_file,
                                   revision=args.revision)
                rows = f"{m['rows']} passages, " if m["rows"] is not None else ""
                print(f"{name}: {rows}{m['bytes']} bytes -> {args.out}/{m['file']}")
                continue
            m = prepare(name, args.out, from_file=args.from_file, revision=args.revision,
                        keep_ids_file=args.keep_ids, out_name=args.out_name)
        except (PrepareError, ValueError, FileNotFoundError, ImportError) as e:
            print(f"megapkl: error: {name}: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        warn = ""
        if m["expected_rows"] and m["rows"] != m["expected_rows"] and not args.from_file:
            warn = f" (expected {m['expected_rows']}: check the source revision)"
        print(f"{name}: {m['rows']} problems from {m['rows_read']} rows "
              f"({m['duplicates_dropped']} duplicates dropped){warn} -> {args.out}/{m['file']}")
    return 0


def add_subcommands(sub) -> None:
    data = sub.add_parser("data", help="prepare the papers' training and evaluation data")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    lst = dsub.add_parser("list", help="the known datasets, their sources and eval protocols")
    lst.set_defaults(func=cmd_data_list)
    prep = dsub.add_parser("prepare", help="download and convert datasets to prompt/answer JSONL")
    prep.add_argument("names", nargs="+", metavar="NAME", help="dataset names, 'eval' for the math "
                      "evaluation sets or 'qa_eval' for the search agent's (see `megapkl data "
                      "list`)")
    prep.add_argument("--out", required=True, help="output directory (e.g. data/eval)")
    prep.add_argument("--from-file", nargs="+", help="convert a local JSONL/Parquet copy in the "
                      "source's layout instead of downloading (a merged set or a split file: one "
                      "per part, in order)")
    prep.add_argument("--revision", help="Hub revision (commit, tag or branch) to download")
    prep.add_argument("--keep-ids", help="keep only rows whose id is listed in this file")
    prep.add_argument("--as", dest="out_name", help="output file stem (default: the dataset name)")
    prep.set_defaults(func=cmd_data_prepare)
