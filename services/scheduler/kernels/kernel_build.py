"""Compiling the native CPU kernels (csrc/*.c, one library) with the system C compiler, cached.

Plain C over raw pointers: no torch headers, so a build takes about a second, and no Python
extension ABI to match. Builds are cached by source, flags and CPU (they use -march=native), written
under a temporary name and renamed, so concurrent schedulers never load a half-written library.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.c")))
# -mprefer-vector-width=512: GCC's tuning for recent Intel CPUs keeps loops it vectorizes at 256 bits
# even where AVX-512 is there (two 512-bit FMA units on a Xeon); the attention loops run ~15 % faster
# at 512. Without AVX-512 it changes nothing.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC"]
LDFLAGS = ["-shared", "-fopenmp"]
# attention.c alone takes 100-110 s on the 2-core machine (a specialization per head shape, KV kind and
# path): past the old 120 s limit when the machine is slow, which left a process without native kernels.
BUILD_TIMEOUT_S = 600


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
    log.info("compiling the native CPU kernels into %s (a minute or two; once per source change)", out.name)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    objs = [tmp.with_name(f"{tmp.name}.{f.stem}.o") for f in sources]
    try:
        # Compile and link apart: linking with -ffast-math adds crtfastmath.o, whose constructor
        # turns on flush-to-zero for the whole process the moment the library is loaded.
        for src, obj in zip(sources, objs):
            subprocess.run([cc, *CFLAGS, "-c", "-o", str(obj), str(src)], check=True, capture_output=True,
                           timeout=BUILD_TIMEOUT_S)
        subprocess.run([cc, *LDFLAGS, "-o", str(tmp), *map(str, objs), "-lm"], check=True, capture_output=True,
                       timeout=BUILD_TIMEOUT_S)
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
