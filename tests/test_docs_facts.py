"""The docs held to the code where a test can hold them: every repository path they name exists,
and the counts they state are the counts the code has."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "slurm" / "README.md", REPO / "slurm" / "sbatch_template.sh",
        REPO / "configs" / "experiments" / "README.md", REPO / "tools" / "gpu_checks" / "README.md",
        *sorted((REPO / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.$-])((?:configs|tools|slurm|megapkl|tests|docs)/[\w./-]+"
                  r"\.(?:yaml|py|sh|md|json))")


def test_every_repository_path_the_docs_name_exists():
    missing = [f"{doc.relative_to(REPO)}:{i}: {path}"
               for doc in DOCS if doc.exists()
               for i, line in enumerate(doc.read_text().splitlines(), 1)
               for path in PATH.findall(line) if not (REPO / path).exists()]
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(missing)


def test_the_partition_layout_counts_in_the_docs_are_the_tests():
    # read from the test's source: importing it would start its distributed harness
    tree = ast.parse((REPO / "tests" / "parallel" / "test_partition_model.py").read_text())
    value = {t.id: ast.literal_eval(node.value) for node in tree.body
             if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
             and t.id in ("LAYOUTS", "SUBSET", "MOE_CASES")}
    LAYOUTS, SUBSET, MOE_CASES = value["LAYOUTS"], value["SUBSET"], value["MOE_CASES"]
    moe = sum(1 for v in LAYOUTS.values() if len(v) > 5 and v[5].get("ep", 1) > 1)
    subset = sum(1 for v in LAYOUTS.values() if len(v) > 5) - moe
    every = len(LAYOUTS) - subset - moe
    text = " ".join((REPO / "docs" / "parallelism.md").read_text().split())
    said = (f"over {len(LAYOUTS)} layouts against one process: {every} layouts", f"; {subset} with",
            f"a subset of {len(SUBSET)} objectives", f"with {len(MOE_CASES)} objectives")
    assert all(s in text for s in said), [s for s in said if s not in text]


# ---- docs/experiments.md and configs/experiments/README.md, held to the code

EXPERIMENTS = REPO / "docs" / "experiments.md"


def _flat(path: Path) -> str:
    return " ".join(path.read_text().split())


def _commands(path: Path) -> list[str]:
    """Every `megapkl submit|sweep ...` line of a doc, backslash continuations joined."""
    text = path.read_text().replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines()
            if line.strip().startswith(("megapkl submit", "megapkl sweep"))]


def test_commands_with_a_container_profile_name_paths_it_mounts():
    """A documented submit or sweep whose profile runs the job in a container gives paths under
    its mounts (the launcher refuses others: megapkl.launch.submit.check_mounts)."""
    import shlex

    from megapkl.launch.profile import load_profile
    from megapkl.launch.submit import container_paths

    checked = 0
    for doc in (EXPERIMENTS, REPO / "configs" / "experiments" / "README.md"):
        for command in _commands(doc):
            words = shlex.split(command.split(" # ")[0])
            mounts = container_paths(load_profile(words[words.index("--profile") + 1]))
            if not mounts:
                continue
            paths = [w.split("=", 1)[1] for w in words if "=/" in w]
            assert paths, command
            for p in map(Path, paths):
                assert any(p == m or m in p.parents for m in mounts), (doc.name, command)
                checked += 1
    assert checked  # the README's h200 sweep at least


def test_the_h200_paths_in_the_prose_are_under_its_mounts():
    from megapkl.launch.profile import load_profile
    from megapkl.launch.submit import container_paths

    mounts = container_paths(load_profile("h200"))
    assert sorted(map(str, mounts)) == ["/home", "/shared"]
    text = _flat(EXPERIMENTS)
    assert "mounts `/shared` and `/home`" in text
    assert "With `--profile h200` download the checkpoint under `/shared`" in text
    assert "`model.hf_checkpoint=/shared/models/Qwen3-1.7B-Base`" in text


def test_the_eval_server_sizes_are_the_codes():
    """docs/experiments.md's figures for `megapkl eval` on one machine, from the code that places
    and sizes it (megapkl.analysis.eval_cli, megapkl.models.sizes)."""
    from megapkl.analysis.eval_cli import GIB, _fleet, one_gpu_bytes
    from megapkl.config import load_config

    runs = REPO / "configs" / "experiments"
    big = load_config(runs / "pkl_periodic" / "qwen3_32b_pkl.yaml")
    moe = load_config(runs / "sis_math" / "qwen3_30b_a3b_dapo_sis_r3.yaml")
    sg = big.rollout.sglang
    beside = _fleet(big, 8).overrides  # 8 GPUs: this process on GPU 0, servers after it
    assert f"rollout.sglang.num_engines={(8 - 1) // sg.tp}" in beside
    text = _flat(EXPERIMENTS)
    assert (f"a 32B run's replica has {sg.num_engines} servers of {sg.tp} GPUs: "
            f"{(8 - 1) // sg.tp} of them fits beside this process on an 8-GPU machine") in text
    b = {k: f"{v / GIB:.1f}" for k, v in one_gpu_bytes(big, learner=False, dedicated=False).items()}
    m = {k: f"{v / GIB:.1f}" for k, v in one_gpu_bytes(moe, learner=False, dedicated=False).items()}
    assert big.rollout.fp8 and not moe.rollout.fp8
    assert (f"32B ({b['weights']} GiB of bf16 weights plus a {b['engine copy']} GiB FP8 engine "
            "copy)") in text
    assert (f"30B-A3B ({m['weights']} GiB of weights plus a {m['engine copy']} GiB engine copy: "
            "its runs roll out in BF16)") in text
    for row in (b, m):  # refused on one 80 GB GPU, as the doc says
        assert sum(map(float, row.values())) > 79.6


def test_the_run_directory_rule_is_the_codes():
    """What makes a run directory hold a run, and the --if-exists choices of train and submit."""
    from megapkl.cli import build_parser
    from megapkl.train.local import RUN_RECORDS

    text = _flat(EXPERIMENTS)
    named = "(" + ", ".join(f"`{r}`" for r in ("config.yaml", "metrics.jsonl", "launch.json",
                                                 "events.jsonl", "result.json")) + ", `checkpoints/step_*`)"
    assert sorted(RUN_RECORDS) == sorted(("config.yaml", "metrics.jsonl", "launch.json",
                                          "events.jsonl", "result.json"))
    assert named in text
    parser = build_parser()
    for command in ("train", "submit"):
        action = next(a for a in parser._subparsers._group_actions[0].choices[command]._actions
                      if "--if-exists" in a.option_strings)
        assert action.default == "error"
        assert f"`--if-exists {'|'.join(action.choices)}` (default `error`: refuse)" in text
    assert "`megapkl train CONFIG`" in text


def test_what_validate_needs_is_what_it_checks(tmp_path):
    """The list "What `config validate` and `submit` need before a submit" names what
    megapkl.config.local_files refuses."""
    from megapkl.config import load_config
    from megapkl.config.local_files import (EVAL_ANSWER_KEY, EVAL_PROMPT_KEY, TOKENIZER_FILES,
                                            check_local_files, weights_problem)

    text = _flat(EXPERIMENTS)
    assert " or ".join(f"`{f}`" for f in TOKENIZER_FILES) in text
    assert "holding `config.json` and `*.safetensors` weights" in text
    assert "`pytorch_model*.bin` checkpoint is refused" in text
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "ckpt" / "pytorch_model.bin").write_text("")
    assert "only pytorch_model.bin" in weights_problem(tmp_path / "ckpt")
    cfg = load_config(REPO / "configs" / "demo" / "cpu_demo.yaml")
    assert (cfg.data.prompt_key, cfg.data.answer_key) == (EVAL_PROMPT_KEY, EVAL_ANSWER_KEY)
    assert (f"`data.prompt_key` field (`{EVAL_PROMPT_KEY}`) is a non-empty string and whose "
            f"`data.answer_key` field (`{EVAL_ANSWER_KEY}`) is a string or a number") in text
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "", "answer": 1}\n')
    problems = []
    cfg = load_config(REPO / "configs" / "demo" / "cpu_demo.yaml",
                      [f"data.train_path={bad}", "data.synthetic=null", "reward.type=math",
                       "eval.every=0", "eval.at_start=false", f"model.tokenizer={tmp_path / 'ckpt'}"])
    check_local_files(cfg, tmp_path, lambda msg, key, *rel: problems.append((key, msg)))
    assert any(k == "data.train_path" and f"{bad}:1" in m for k, m in problems), problems
