"""Load the Triton kernels so they run under Triton's interpreter on CPU (no GPU needed).

triton.jit decides interpreted vs compiled when a kernel is decorated (when its module is imported),
and the interpreter checks the variable again while a kernel runs (triton imports parts of itself
lazily then). So TRITON_INTERPRET=1 is set around that import and, by conftest.py's autouse fixture,
around each test of this directory only; no other test sees it. Without CUDA only: on a GPU machine
the same tests run the compiled kernels.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = not torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SKIP_REASON = "triton is not installed (requirements-dev.txt pins triton==3.9.0)"


@contextmanager
def interpreted() -> Iterator[None]:
    prev = os.environ.get("TRITON_INTERPRET")
    if INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev


def kernels() -> ModuleType:
    with interpreted():
        from services.scheduler.attention import triton_kernels
    return triton_kernels


def load_copy(path: Path, name: str) -> ModuleType:
    """A kernel module from another file (a mutant of triton_kernels.py), interpreted likewise."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # triton.jit reads each kernel's source through its module
    with interpreted():
        spec.loader.exec_module(mod)
    return mod


if HAS_TRITON:
    kernels()
