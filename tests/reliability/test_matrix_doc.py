"""docs/reliability.md: at least 30 rows, each citing a test, and every test it cites exists (file,
function, case)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITE = re.compile(r"`([\w/]+\.py)?::(\w+)(?:\[([\w-]+)\])?`|`\[([\w-]+)\]`")


def _rows():
    text = (ROOT / "docs" / "reliability.md").read_text()
    return [ln for ln in text.splitlines() if re.match(r"^\| \d+[a-z]? \|", ln)]


def test_matrix_has_thirty_rows_each_citing_a_test():
    """A row without a test is a claim nobody checks: every row cites at least one."""
    rows = _rows()
    assert len(rows) >= 30
    for row in rows:
        last = row.rstrip(" |").rsplit("|", 1)[-1]
        assert CITE.search(last) and "::" in last, f"no test cited: {row[:60]}"


def test_every_cited_test_exists():
    for row in _rows():
        cell = row.rstrip(" |").rsplit("|", 1)[-1]
        current = None
        for m in CITE.finditer(cell):
            path, func, case, bare_case = m.groups()
            current = path or current
            assert current, row
            source = (ROOT / "tests" / current).read_text()
            if func:
                assert re.search(rf"^def {func}\(", source, re.M), f"{current}::{func} ({row[:8]})"
            case = case or bare_case
            if case:
                assert f'("{case}"' in source, f"{current} case {case}"
