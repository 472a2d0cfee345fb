"""Print pyproject.toml's dependencies at their declared lower bounds, one `name==version` a line:
the constraints of the lower-bound environment tools/test_bounds.sh builds and runs. Every
dependency must declare its lowest version (`>=` or `==`): a range with no lower bound cannot be
tested at its bound, so it is refused here."""
from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$")


def lower_bounds(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """name -> its lowest admitted version, from [project].dependencies."""
    out = {}
    for text in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        name, spec = REQ.match(text).groups()
        found = [v for op, v in re.findall(r"(==|>=)\s*([0-9][\w.]*)", spec)]
        if not found:
            raise SystemExit(f"{pyproject}: dependency '{text}' declares no lower bound (>= or "
                             "==): the lowest version a user may keep must be the one tested")
        out[name.lower()] = found[0]
    return out


if __name__ == "__main__":
    for name, version in lower_bounds().items():
        print(f"{name}=={version}")
    sys.exit(0)
