"""The software and machine a run's numbers came from, as one JSON-able record.

On CPU a run is deterministic within one environment but not across them: another torch build,
BLAS, CPU instruction set or thread count changes the floating-point order of reductions, and a
training run amplifies those last-bit differences into different per-seed values. A study records
this beside each run so that a re-run can tell "different environment" from "different code".
"""
from __future__ import annotations

import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

PACKAGES = ("torch", "numpy", "megatron-core", "transformers", "scipy")
# SIMD extensions that decide which kernels MKL / oneDNN / torch dispatch to
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, Optional[str]]:
    """Installed distribution versions (None: not installed)."""
    out: dict[str, Optional[str]] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_info(text: str) -> dict:
    """CPU model and the SIMD flags of SIMD_FLAGS it has, from /proc/cpuinfo's text (the first
    processor's block; every core of a machine reports the same)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's value
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name"), "simd": [f for f in SIMD_FLAGS if f in flags]}


def torch_build() -> dict:
    """torch's version, build commit, CUDA / cuDNN it was built with, the CPU kernels it uses
    and its BLAS."""
    import torch

    info = {"version": torch.__version__, "git": torch.version.git_version,
            "cuda": torch.version.cuda, "debug": bool(torch.version.debug),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "mkl": torch.backends.mkl.is_available()}
    shown = torch.__config__.show()  # "... Build settings: BLAS_INFO=mkl, ..., CUDNN_VERSION=9.2, ..."
    for name, key in (("blas", "BLAS_INFO"), ("cudnn", "CUDNN_VERSION")):
        found = re.search(rf"\b{key}=([^,\s]*)", shown)
        info[name] = found.group(1) if found else None
    return info


def environment(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> dict:
    """Python, the packages of PACKAGES, torch's build, the CPU and the thread settings."""
    import torch

    path = Path(cpuinfo)
    cpu = cpu_info(path.read_text()) if path.is_file() else {"model": None, "simd": []}
    return {"python": platform.python_version(), "implementation": sys.implementation.name,
            "platform": platform.platform(), "packages": package_versions(),
            "torch": torch_build(), "cpu": {**cpu, "logical_cpus": os.cpu_count()},
            "threads": {"torch": torch.get_num_threads(),
                        **{v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}}}
