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


# Citations: "docs/spec.md section 4.1", "sections 2, 5", "sections 1-2", "section 6" (on a docs page:
# that page), and a document named without its path or extension ("SPEC section 7", "ARCHITECTURE.md")
CODE = [p for p in (*REPO.glob("megapkl/**/*.py"), *REPO.glob("tests/**/*.py"),
                   *REPO.glob("tools/**/*.py"), *REPO.glob("configs/**/*.yaml"))
        if p != Path(__file__).resolve()]  # this file's examples cite what does not exist
CITE = re.compile(r"(\S+)\s+(?:sections?|§)\s*(\d+(?:\.\d+)*(?:(?:\s*,\s*|\s*-\s*|\s+and\s+)"
                  r"\d+(?:\.\d+)*)*)")
PAPERS = {"PKL", "SIS", "TETPO"}  # the papers' own sections: outside the repository
UPPER_DOC = re.compile(r"(?<![\w/.-])([A-Z][A-Z_-]+\.md)\b")
DOC_PATH = re.compile(r"(?<![\w/.$-])(docs/[\w./-]+\.md)")


def _prose(path: Path) -> str:
    """The file's text as one line, comment markers dropped, so a citation wrapped over two
    comment or docstring lines reads as one."""
    return " ".join(line.strip().lstrip("#").strip() for line in path.read_text().splitlines())


def _numbers(text: str) -> list[str]:
    out = []
    for part in re.split(r"\s*,\s*|\s+and\s+", text):
        lo, _, hi = part.partition("-")
        lo, hi = lo.strip(), hi.strip()
        out += [str(n) for n in range(int(lo), int(hi) + 1)] if hi else [lo]
    return out


def _headings(page: Path) -> set[str]:
    return {m.group(1) for m in re.finditer(r"(?m)^#{1,6}\s+(\d+(?:\.\d+)*)[.\s]", page.read_text())}


def citation_problems(path: Path) -> list[str]:
    text, rel, bad = _prose(path), path.relative_to(REPO) if REPO in path.parents else path, []
    for name in UPPER_DOC.findall(text) + DOC_PATH.findall(text):
        if not any(p.is_file() for p in (REPO / name, REPO / "docs" / name, path.parent / name)):
            bad.append(f"{rel}: cites {name}, which is not in the repository")
    for m in CITE.finditer(text):
        word, nums = m.group(1).strip("(`'\",;:"), _numbers(m.group(2))
        if word.endswith(".md"):
            page = REPO / word if "/" in word else REPO / "docs" / word
        elif path.suffix == ".md" and not word[:1].isupper():
            page = path  # "the terms of section 6": this page's own section
        elif word in PAPERS:
            continue
        else:
            bad.append(f"{rel}: '{m.group(0)}' cites a section of no file of the repository")
            continue
        if not page.is_file():
            bad.append(f"{rel}: '{m.group(0)}' cites {word}, which is not in the repository")
            continue
        missing = [n for n in nums if n not in _headings(page)]
        if missing:
            bad.append(f"{rel}: '{m.group(0)}': {page.relative_to(REPO)} has no section "
                       f"{', '.join(missing)}")
    return bad


def test_every_citation_names_a_file_and_section_that_exist():
    bad = [p for f in CODE + DOCS if f.exists() for p in citation_problems(f)]
    assert not bad, "citations of files or sections that do not exist:\n" + "\n".join(bad)


def test_the_citation_check_fails_on_what_does_not_exist(tmp_path):
    probe = tmp_path / "probe.py"
    cases = {"SPEC section 7": "no file", "see ARCHITECTURE.md": "ARCHITECTURE.md",
             "docs/spec.md section 99": "no section 99", "docs/nowhere.md": "docs/nowhere.md",
             "docs/spec.md\n# section 4.1 and docs/spec.md sections 1-2, 12": None}
    for text, said in cases.items():
        probe.write_text(f"# {text}\n")
        found = citation_problems(probe)
        assert (said in " ".join(found)) if said else not found, (text, found)
