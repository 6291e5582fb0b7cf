"""Native CPU kernels (csrc/*.c), compiled on first use with the system C compiler, called via ctypes.

Plain C over raw pointers: no torch headers, so a build takes about a second, and no Python
extension ABI to match. `load()` returns None when there is no compiler (a slim image) or the build
fails, and callers keep their torch path. Builds are cached by source, flags and CPU (they use
-march=native), written under a temporary name and renamed, so concurrent schedulers never load a
half-written library. ctypes releases the GIL for the call.
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LDFLAGS = ["-shared", "-fopenmp"]
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir(configured: str | None = None) -> Path:
    """`configured` (--kernel-cache), else ~/.cache/ringserve/kernels; a temp dir if not writable."""
    path = Path(configured) if configured else Path.home() / ".cache" / "ringserve" / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:
        return Path(tempfile.gettempdir())


def build(source: Path = SOURCE, cache: str | None = None) -> Path | None:
    """The compiled shared library for `source` (cached), or None if it cannot be built here."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: native CPU kernels off")
        return None
    parts = [source.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), _cpu_id().encode(), platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out = cache_dir(cache) / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    obj = tmp.with_suffix(".o")
    try:
        # Compile and link apart: linking with -ffast-math adds crtfastmath.o, whose constructor
        # turns on flush-to-zero for the whole process the moment the library is loaded.
        subprocess.run([cc, *CFLAGS, "-c", "-o", str(obj), str(source)], check=True, capture_output=True,
                       timeout=120)
        subprocess.run([cc, *LDFLAGS, "-o", str(tmp), str(obj), "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        log.warning("building %s failed (%s); native CPU kernels off. %s", source.name, e,
                    err.decode(errors="replace")[-500:])
        tmp.unlink(missing_ok=True)
        return None
    finally:
        obj.unlink(missing_ok=True)
    log.info("built %s", out)
    return out


class NativeDecodeAttention:
    """Fused decode attention over the dense decode cache (float32, CPU)."""

    def __init__(self, lib_path: Path) -> None:
        self._fn = ctypes.CDLL(str(lib_path)).decode_attention_f32
        self._fn.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]
        self._fn.restype = ctypes.c_int

    def __call__(self, q: torch.Tensor, kt_buf: torch.Tensor, v_buf: torch.Tensor, lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """q: [B, H, G, D] float32; kt_buf: K^T [Bcap, H, D, Lcap] and v_buf: [Bcap, H, Lcap, D], both
        contiguous float32 on CPU; lens: [B] int64 keys per row, in [1, Lcap]. Returns [B, H, G, D]."""
        b, h, g, d = q.shape
        l_cap = v_buf.shape[2]
        # The C code trusts its pointers and sizes: check them here, where a mistake is an exception.
        for t in (q, kt_buf, v_buf):
            assert t.dtype == torch.float32 and t.device.type == "cpu"
        assert kt_buf.is_contiguous() and v_buf.is_contiguous()
        assert kt_buf.shape == (kt_buf.shape[0], h, d, l_cap) and v_buf.shape == (kt_buf.shape[0], h, l_cap, d)
        assert kt_buf.shape[0] >= b and lens.shape == (b,) and lens.dtype == torch.int64
        assert 1 <= int(lens.min()) and int(lens.max()) <= l_cap
        q = q.contiguous()
        lens = lens.contiguous()
        out = torch.empty_like(q)
        threads = torch.get_num_threads()  # the forward's own threads (set_num_threads / --num-threads)
        scratch = torch.empty(threads * g * l_cap, dtype=torch.float32)
        if self._fn(q.data_ptr(), kt_buf.data_ptr(), v_buf.data_ptr(), lens.data_ptr(), out.data_ptr(),
                    scratch.data_ptr(), b, h, g, d, l_cap, scale, threads) != 0:
            raise ValueError(f"decode attention kernel: unsupported group {g} / head_dim {d} (max 16 / 128)")
        return out


def load_decode_attention(cache: str | None = None) -> NativeDecodeAttention | None:
    path = build(cache=cache)
    return NativeDecodeAttention(path) if path is not None else None
