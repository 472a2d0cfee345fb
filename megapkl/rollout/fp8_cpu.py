"""The CPU kernel behind `fp8.quantize_block_fp8` for bf16 and fp32 weights on the host.

torch quantizes on a GPU at memory speed, but on CPU its float -> float8 cast is a scalar loop
(about 8x slower than a copy of the same bytes). `fp8_cpu.c` computes the same numbers, bit for bit
(tests/rollout/test_fp8_cpu.py checks this on random, adversarial and every bf16 value), in two
vectorized passes per block row. It is compiled with the system C compiler (`$CC`, else `cc`) on
first use into `$XDG_CACHE_HOME/megapkl` (default `~/.cache/megapkl`), keyed by the source, the
compiler and the CPU's flags so that nodes of a cluster sharing a home directory never load a
library built for another CPU. Without a compiler the torch path runs (same numbers, slower) and one
warning says why. Block rows are split over `torch.get_num_threads()` OpenMP threads: the library
links `libgomp.so.1`, which resolves to the runtime torch already loaded, so both share one pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fp8_cpu.c")
_SYMBOLS = {torch.bfloat16: "megapkl_fp8_quantize_bf16", torch.float32: "megapkl_fp8_quantize_f32"}
_DEQUANT_SYMBOLS = {torch.bfloat16: "megapkl_fp8_dequantize_bf16",
                    torch.float32: "megapkl_fp8_dequantize_f32"}
_PARALLEL_MIN_ELEMENTS = 1 << 16  # below this, one thread: starting the team costs more

_lock = threading.Lock()
_state: dict = {}


def _cpu_id() -> str:
    """The CPU model and flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(sorted(set(keep)))


def _compiler_id(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise OSError(f"'{cc} --version' exited {out.returncode}")
    return out.stdout


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megapkl"


def build(cc: Optional[str] = None) -> Path:
    """Compile the kernel (or find it already compiled); returns the shared library's path.
    Raises OSError / subprocess.CalledProcessError when there is no working compiler."""
    cc = cc or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler '{cc}' on PATH (set CC)")
    src = SOURCE.read_bytes()
    flags = ["-O3", "-march=native", "-fno-trapping-math", "-fPIC", "-shared", "-fopenmp"]
    key = hashlib.sha256(b"\0".join([src, _compiler_id(cc).encode(), _cpu_id().encode(),
                                     " ".join(flags).encode()])).hexdigest()[:20]
    out = cache_dir() / f"fp8_cpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: concurrent ranks never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _why(e: Exception) -> str:
    """One line: the compiler's first error, else the exception."""
    lines = [ln.strip() for ln in (getattr(e, "stderr", None) or "").splitlines()]
    return next((ln for ln in lines if "error" in ln), None) or str(e)


def _load():
    """The loaded library, or None (after one warning) when it cannot be built."""
    with _lock:
        if "lib" not in _state:
            try:
                lib = ctypes.CDLL(str(build()))
                for sym in _SYMBOLS.values():
                    fn = getattr(lib, sym)
                    fn.restype = ctypes.c_int64
                    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 2
                for sym in _DEQUANT_SYMBOLS.values():
                    fn = getattr(lib, sym)
                    fn.restype = None
                    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p,
                                                                              ctypes.c_int64,
                                                                              ctypes.c_void_p]
                _state["lib"] = lib
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("FP8: the CPU quantization kernel could not be built (%s); quantizing "
                            "with torch instead (same numbers, several times slower)", _why(e))
                _state["lib"] = None
        return _state["lib"]


def available() -> bool:
    return _load() is not None


def quantize(weight: Tensor, block: Sequence[int]) -> Optional[tuple[Tensor, Tensor, int]]:
    """(e4m3 q, fp32 scale_inv, bad) for a 2-D bf16/fp32 CPU weight, where bad is -1 or a block
    row holding NaN/Inf; None when the kernel does not apply (other device or dtype, or no
    compiler), and the caller quantizes with torch."""
    if weight.device.type != "cpu" or weight.dtype not in _SYMBOLS or weight.dim() != 2 \
            or weight.numel() == 0:
        return None
    lib = _load()
    if lib is None:
        return None
    weight = weight.contiguous()
    rows, cols = weight.shape
    b0, b1 = int(block[0]), int(block[1])
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-rows // b0), -(-cols // b1), dtype=torch.float32)
    threads = torch.get_num_threads() if weight.numel() >= _PARALLEL_MIN_ELEMENTS else 1
    bad = getattr(lib, _SYMBOLS[weight.dtype])(weight.data_ptr(), rows, cols, b0, b1, threads,
                                               q.data_ptr(), scale.data_ptr())
    if bad == -2:
        raise MemoryError(f"FP8 CPU kernel: no memory for two scratch rows of {cols} elements")
    return q, scale, int(bad)


def dequantize(q: Tensor, scale_inv: Tensor, dtype: torch.dtype, block: Sequence[int]
               ) -> Optional[Tensor]:
    """q * scale_inv per block in `dtype` (bf16 or fp32) for a contiguous e4m3 CPU weight and its
    fp32 scale grid (shapes already checked by the caller); None when the kernel does not apply."""
    if q.device.type != "cpu" or scale_inv.device.type != "cpu" or dtype not in _DEQUANT_SYMBOLS \
            or q.dtype != torch.float8_e4m3fn or scale_inv.dtype != torch.float32 \
            or q.dim() != 2 or q.numel() == 0:
        return None
    lib = _load()
    if lib is None:
        return None
    q, scale_inv = q.contiguous(), scale_inv.contiguous()
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=dtype)
    threads = torch.get_num_threads() if q.numel() >= _PARALLEL_MIN_ELEMENTS else 1
    getattr(lib, _DEQUANT_SYMBOLS[dtype])(q.data_ptr(), rows, cols, int(block[0]), int(block[1]),
                                          scale_inv.data_ptr(), threads, out.data_ptr())
    return out
