"""Native CPU kernels (csrc/*.c, one library), compiled on first use with the system C compiler, called
via ctypes: attention (decode and prefill) and the fused elementwise steps of a layer (rotary, SiLU gate).

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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.c")))
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


def build(sources: tuple[Path, ...] = SOURCES, cache: str | None = None) -> Path | None:
    """The shared library compiled from `sources` (cached), or None if it cannot be built here."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: native CPU kernels off")
        return None
    parts = [*(f.read_bytes() for f in sources), " ".join(CFLAGS + LDFLAGS).encode(), _cpu_id().encode(),
             platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out = cache_dir(cache) / f"ringserve-kernels-{key}.so"
    if out.exists():
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    objs = [tmp.with_name(f"{tmp.name}.{f.stem}.o") for f in sources]
    try:
        # Compile and link apart: linking with -ffast-math adds crtfastmath.o, whose constructor
        # turns on flush-to-zero for the whole process the moment the library is loaded.
        for src, obj in zip(sources, objs):
            subprocess.run([cc, *CFLAGS, "-c", "-o", str(obj), str(src)], check=True, capture_output=True,
                           timeout=120)
        subprocess.run([cc, *LDFLAGS, "-o", str(tmp), *map(str, objs), "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        log.warning("building %s failed (%s); native CPU kernels off. %s", out.name, e,
                    err.decode(errors="replace")[-500:])
        tmp.unlink(missing_ok=True)
        return None
    finally:
        for obj in objs:
            obj.unlink(missing_ok=True)
    log.info("built %s", out)
    return out


@dataclass
class SharedKV:
    """Shared prompt prefixes for decode attention: kt [E, H, D, Pcap] (K^T) and v [E, H, Pcap, D] hold
    E prefixes; row b reads its first plen[b] keys from prefix entry[b] ([B] int64 each; plen 0: none)."""
    kt: torch.Tensor
    v: torch.Tensor
    entry: torch.Tensor
    plen: torch.Tensor


class NativeKernels:
    """The library's entry points, for float32 tensors on CPU."""

    def __init__(self, lib_path: Path) -> None:
        lib = ctypes.CDLL(str(lib_path))
        self._decode = lib.decode_attention_f32
        self._decode.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int,
                                 _P, _P, _P, _P, _I]
        self._decode.restype = ctypes.c_int
        self._extend = lib.extend_attention_f32
        self._extend.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]
        self._extend.restype = ctypes.c_int
        self._rope = lib.rope_f32
        self._rope.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_int]
        self._rope.restype = None
        self._silu_mul = lib.silu_mul_f32
        self._silu_mul.argtypes = [_P, _P, _I, _I, ctypes.c_int]
        self._silu_mul.restype = None

    @staticmethod
    def _check_kv(kt_buf: torch.Tensor, v_buf: torch.Tensor, h: int, d: int) -> int:
        # The C code trusts its pointers and sizes: check them here, where a mistake is an exception.
        l_cap = v_buf.shape[2]
        for t in (kt_buf, v_buf):
            assert t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
        assert kt_buf.shape == (kt_buf.shape[0], h, d, l_cap) and v_buf.shape == (kt_buf.shape[0], h, l_cap, d)
        return l_cap

    @staticmethod
    def _scratch(g: int, length: int) -> tuple[torch.Tensor, int]:
        threads = torch.get_num_threads()  # the forward's own threads (set_num_threads / --num-threads)
        return torch.empty(threads * g * length, dtype=torch.float32), threads

    def decode_attention(self, q: torch.Tensor, kt_buf: torch.Tensor, v_buf: torch.Tensor, lens: torch.Tensor,
                         scale: float, shared: SharedKV | None = None) -> torch.Tensor:
        """q: [B, H, G, D] float32; kt_buf: K^T [Bcap, H, D, Lcap] and v_buf: [Bcap, H, Lcap, D], both
        contiguous float32 on CPU; lens: [B] int64 keys per row. Without `shared` a row's keys are its
        own buffer's [0, lens[b]); with it, the first shared.plen[b] come from prefix entry
        shared.entry[b] and the rest from the row's own buffer from index 0. Returns [B, H, G, D]."""
        b, h, g, d = q.shape
        l_cap = self._check_kv(kt_buf, v_buf, h, d)
        assert q.dtype == torch.float32 and kt_buf.shape[0] >= b
        assert lens.shape == (b,) and lens.dtype == torch.int64
        ptrs, p_cap, own = [None] * 4, 0, lens
        if shared is not None:
            p_cap = self._check_kv(shared.kt, shared.v, h, d)
            assert shared.entry.shape == shared.plen.shape == (b,)
            assert shared.entry.dtype == shared.plen.dtype == torch.int64
            has = shared.plen > 0
            assert int(shared.plen.min()) >= 0 and int(shared.plen.max()) <= p_cap
            assert bool(((shared.entry >= 0) & (shared.entry < shared.kt.shape[0]))[has].all())
            own = lens - shared.plen
            entry, plen = shared.entry.contiguous(), shared.plen.contiguous()
            ptrs = [shared.kt.data_ptr(), shared.v.data_ptr(), entry.data_ptr(), plen.data_ptr()]
        assert 1 <= int(own.min()) and int(own.max()) <= l_cap
        q, lens = q.contiguous(), lens.contiguous()
        out = torch.empty_like(q)
        scratch, threads = self._scratch(g, p_cap + l_cap)
        if self._decode(q.data_ptr(), kt_buf.data_ptr(), v_buf.data_ptr(), lens.data_ptr(), out.data_ptr(),
                        scratch.data_ptr(), b, h, g, d, l_cap, scale, threads, *ptrs, p_cap) != 0:
            raise ValueError(f"attention kernel: unsupported group {g} / head_dim {d} (max 16 / 128)")
        return out

    def extend_attention(self, q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor,
                         prefix: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of new tokens after a cached prefix. q: [T, H, G, D] float32, request b's
        tokens at q_start[b]:q_start[b + 1] ([B + 1] int64, q_start[B] = T); kt: K^T [B, H, D, Lcap] and
        v: [B, H, Lcap, D], each request's keys from position 0; prefix: [B] int64 cached keys before
        the new ones. Token i of request b sees keys [0, prefix[b] + i]. Returns [T, H, G, D]."""
        t, h, g, d = q.shape
        b = kt.shape[0]
        l_cap = self._check_kv(kt, v, h, d)
        assert q.dtype == torch.float32
        assert q_start.shape == (b + 1,) and prefix.shape == (b,)
        assert q_start.dtype == prefix.dtype == torch.int64
        n = q_start[1:] - q_start[:-1]
        assert int(q_start[0]) == 0 and int(q_start[-1]) == t and int(n.min()) >= 0
        assert int(prefix.min()) >= 0 and int((prefix + n).max()) <= l_cap
        q, q_start, prefix = q.contiguous(), q_start.contiguous(), prefix.contiguous()
        out = torch.empty_like(q)
        scratch, threads = self._scratch(g, l_cap)
        if self._extend(q.data_ptr(), kt.data_ptr(), v.data_ptr(), q_start.data_ptr(), prefix.data_ptr(),
                        out.data_ptr(), scratch.data_ptr(), b, h, g, d, l_cap, scale, threads) != 0:
            raise ValueError(f"attention kernel: unsupported group {g} / head_dim {d} (max 16 / 128)")
        return out


    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [T, heads, D] in place (HF rotate-half over the first 2 * half dims of each head);
        x's heads and dims contiguous, rows at any stride. positions: [T] int64 contiguous, each below
        len(cos) (the caller checks once per pass); cos, sin: [max_position, half] contiguous."""
        t, heads, d = x.shape
        half = cos.shape[1]
        assert x.dtype == cos.dtype == sin.dtype == torch.float32 and x.device.type == "cpu"
        assert x.stride(2) == 1 and x.stride(1) == d and 2 * half <= d
        assert cos.is_contiguous() and sin.is_contiguous() and sin.shape == cos.shape
        assert positions.shape == (t,) and positions.dtype == torch.int64 and positions.is_contiguous()
        self._rope(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, x.stride(0), heads, d,
                   half, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2 I] float32 contiguous -> silu(gate) * up, [T, I]."""
        t, two_i = gate_up.shape
        assert gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" and two_i % 2 == 0
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(t, two_i // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, torch.get_num_threads())
        return out


def load(cache: str | None = None) -> NativeKernels | None:
    path = build(cache=cache)
    return NativeKernels(path) if path is not None else None
