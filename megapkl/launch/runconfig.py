"""The launcher's only door to run configs (megapkl.config): load, resolve, dump, reload.

Everything the launcher needs from a run config goes through `prepare_run`, so a change of the
config package touches this file alone. No torch import.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from megapkl.config.typed import ConfigError


@dataclass
class PreparedRun:
    """A validated run config and what the launcher takes from it."""

    cfg: Any  # megapkl.config.RunConfig (resolved)
    config_path: str  # the file given (display form)
    overrides: list[str]
    name: str
    run_dir: Path  # absolute
    resolved_yaml: str  # what <run_dir>/config.yaml will hold
    slurm_explicit: dict[str, Any]  # slurm: keys the files/overrides set explicitly (not defaults)


def prepare_run(config: str | os.PathLike, overrides: Iterable[str] = (),
                cwd: Optional[str | os.PathLike] = None, tokenizes: bool = True) -> PreparedRun:
    """Load and validate `config` with `overrides` (errors: megapkl.config.ConfigError), the
    files it reads from the submit directory (model.hf_checkpoint) included."""
    from megapkl.config.loader import dump_config, load_config, merged_mapping

    overrides = list(overrides)
    cfg = load_config(config, overrides, workdir=cwd if cwd is not None else Path.cwd(),
                      tokenizes=tokenizes)
    merged, _ = merged_mapping(config, overrides)
    slurm = merged.get("slurm") or {}
    cfg = absolute_paths(cfg, Path(cwd) if cwd is not None else Path.cwd())
    return PreparedRun(cfg=cfg, config_path=str(config), overrides=overrides, name=cfg.name,
                       run_dir=Path(cfg.run_dir), resolved_yaml=dump_config(cfg),
                       slurm_explicit=dict(slurm) if isinstance(slurm, dict) else {})


def absolute_paths(cfg: Any, base: str | os.PathLike) -> Any:
    """`cfg` with run_dir and checkpoint.dir made absolute against `base` (the submit
    directory, which every task chdirs to). The resolved config.yaml then names the very
    directories the launcher lays out, so the trainer's metrics.jsonl, checkpoints and
    config.yaml land in <run_dir> wherever the config is reloaded."""
    def absolute(path: str) -> str:
        p = Path(path).expanduser()
        return str((p if p.is_absolute() else Path(base) / p).resolve())

    run_dir, ckpt_dir = absolute(cfg.run_dir), absolute(cfg.checkpoint.dir)
    if run_dir == cfg.run_dir and ckpt_dir == cfg.checkpoint.dir:
        return cfg
    return dataclasses.replace(cfg, run_dir=run_dir,
                               checkpoint=dataclasses.replace(cfg.checkpoint, dir=ckpt_dir))


def config_error(prep: PreparedRun, message: str, key: str, *related: str) -> ConfigError:
    """A launcher rule's refusal of `key`, naming the file and line that set it (or a related
    key), as the config's own rules name them."""
    from megapkl.config.loader import locate

    return locate(ConfigError(message, key=key, source=prep.config_path, related=related),
                  prep.config_path, prep.overrides)


def load_resolved(path: str | os.PathLike, *, resume: bool = False) -> Any:
    """Reload the resolved config a launcher wrote (in the job). `resume` sets
    checkpoint.resume when it was false (a requeued job continues from the latest checkpoint)."""
    from megapkl.config.loader import load_config

    cfg = load_config(path)
    if resume and cfg.checkpoint.resume is False:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    return cfg


__all__ = ["ConfigError", "PreparedRun", "absolute_paths", "config_error", "prepare_run",
           "load_resolved"]
