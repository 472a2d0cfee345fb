"""Importing the pinned sglang on a machine without a GPU.

SGLang's CPU-side modules (argument parsing, request structs, the tensor serializer, the
quantization configs, the weight receiver) import a few packages that are either GPU-only or
optional and irrelevant here. `install()` puts a `sys.meta_path` finder in front of the import
system that answers exactly those top-level packages (`STUBBED`) with stand-in modules; every
other import, sglang's own modules above all, is the real one. A stand-in answers any attribute
with a placeholder class whose instances raise when called, so code that *uses* a stubbed package
fails loudly instead of passing silently.

Why each is stubbed:
- IPython: `sglang.utils` imports `IPython.display` for notebook output at import time.
- soundfile: audio decoding of the OpenAI transcription routes (imported by the HTTP server);
  the real package needs libsndfile and cffi and plays no part in any route megapkl calls.
- torch_memory_saver: a CUDA-only allocator hook (LD_PRELOAD library); with it missing, SGLang
  refuses `--enable-memory-saver` at start, so the adapter choice could not be observed.

Everything else sglang needs on these paths is installed for real (pyproject's `contract` extra).
This module must be imported only in a process of its own (the contract tests' SGLang process):
the finder and SGLang's import-time patches stay for the life of the process.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = frozenset({"IPython", "soundfile", "torch_memory_saver"})
used: set[str] = set()  # stand-in attributes that were looked up (reported by the tests)


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        qual = f"{self.__name__}.{name}"
        used.add(qual)

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{qual} belongs to a package stubbed for the CPU contract tests")

        placeholder = type(name, (), {"__module__": self.__name__, "__call__": refuse})
        setattr(self, name, placeholder)
        return placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        used.add(module.__name__)


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
