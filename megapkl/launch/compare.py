"""`megapkl compare --profile P`: the method x seed grid of `megapkl.analysis.compare` as Slurm job
arrays, one `megapkl sweep` over `seed` per method, so the runs land in exactly the directories a
local comparison uses (`<out>/<method>/seed-<s>/`) and the same analysis reads them."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


def slurm_runner(profile: str, *, parallelism: Optional[int] = None, dry_run: bool = False,
                 if_exists: str = "resume", wait: Callable[[list[Any]], int] | None = None
                 ) -> Callable[[str, Sequence[Any]], list[Any]]:
    """A runner for `megapkl.analysis.compare.compare` that submits one array per method and waits."""
    from megapkl.launch.sweep import sweep

    def run(config: str, arms: Sequence[Any]) -> list[Any]:
        by_method: dict[str, list[Any]] = {}
        for a in arms:
            by_method.setdefault(a.method, []).append(a)
        submissions = []
        for method, group in by_method.items():
            first = group[0]
            # the arm's own overrides minus what the sweep sets per element (seed, name, run_dir)
            shared = [o for o in first.overrides
                      if not o.startswith(("seed=", "name=", "run_dir="))]
            base_name = _value(first.overrides, "name").rsplit("-seed-", 1)[0]
            sub = sweep(config, profile, [f"seed={','.join(str(a.seed) for a in group)}"],
                        [*shared, f"name={base_name}", f"run_dir={first.run_dir.parent}"],
                        parallelism=parallelism, if_exists=if_exists, dry_run=dry_run)
            for arm, el in zip(group, sub.elements):
                if el.run_dir.resolve() != arm.run_dir.resolve():
                    raise RuntimeError(f"sweep element {el.label} runs in {el.run_dir}, expected "
                                       f"{arm.run_dir}")
            submissions.append(sub)
        if not dry_run and wait is not None:
            rc = wait([j for s in submissions for j in s.jobs])
            if rc:
                raise RuntimeError("some comparison jobs failed (see `megapkl status` / `logs`)")
        return submissions

    return run


def _value(overrides: Sequence[str], key: str) -> str:
    for o in reversed(overrides):
        if o.startswith(key + "="):
            return o.split("=", 1)[1]
    raise KeyError(key)
