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
