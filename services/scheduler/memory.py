"""The scheduler's memory: what holds it, each holder's bound, and whether the bounds fit the machine.

Every buffer that grows with the load has a bound set by a flag (or derived from one), so the sum of
the bounds is the most the scheduler can hold besides its runtime (interpreter, torch, libraries):

| component        | holds                                          | bound set by                           |
|------------------|------------------------------------------------|----------------------------------------|
| weights          | parameters and their packed copies (oneDNN, AMX tiles) | --model, --dtype               |
| kv_pool          | per-layer K/V of every pool slot               | --max-total-tokens (else from memory)  |
| req_to_token     | slot table, one row per running request        | --max-running-requests x context       |
| radix_cache      | the cached prefixes' slot ids (int64 each)     | the KV pool's size                     |
| decode_rows      | CPU decode's dense per-request K/V copies      | --decode-cache-mib                     |
| shared_prefixes  | CPU decode's shared-prefix K/V copies          | a quarter of --decode-cache-mib        |
| grammar          | compiled grammars (LRU) and the mask buffer    | --grammar-cache-mib, --max-running-requests |
| cuda_cached      | torch's CUDA caching allocator's unused blocks | returned (empty_cache) when idle       |

glibc's free bytes (`malloc_free_bytes`) are reported beside, not summed: `malloc_trim` returns their
pages to the OS when idle, but glibc keeps counting them until they are reused, so the figure is an
upper bound on what the allocator holds.

`check_fits` runs at startup, after the weights are loaded and before the pools are allocated: if the
runtime so far plus the bounds still to be allocated exceed the memory the process may use (the
cgroup's limit, MemAvailable), it raises MemoryBudgetError naming the setting to lower, instead of an
OOM kill later. Bytes the decode caches have reserved but not written are counted as held: the bound
is what a full batch touches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)
MIB = 1 << 20
# The runtime's own growth after startup (Python objects of requests in flight, gRPC buffers, torch's
# per-thread scratch for the largest prefill) is not a buffer with a bound; this margin covers it in
# the startup check (measured: under 200 MiB at 256 running requests on the tiny and the real model).
RUNTIME_HEADROOM = 256 * MIB


class MemoryItem(NamedTuple):
    name: str
    used_bytes: int    # held now
    bound_bytes: int   # the most it can hold
    setting: str       # what sets the bound


class MemoryBudgetError(RuntimeError):
    """The configuration's bounds do not fit the memory the process may use."""


def total(items: list[MemoryItem]) -> tuple[int, int]:
    """(used, bound) summed over items."""
    return sum(i.used_bytes for i in items), sum(i.bound_bytes for i in items)


# -- the process and the machine -------------------------------------------------------------------

def rss_bytes() -> int:
    """This process's resident set (VmRSS)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _cgroup_room() -> int | None:
    """Bytes the cgroup (v2, else v1) still allows, or None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            usage = int(Path("/sys/fs/cgroup", usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 reports "no limit" as a huge number
            return None
        return int(limit) - usage
    return None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def room_bytes() -> tuple[int | None, str]:
    """Bytes this process may still grow by, and where that figure comes from; (None, "") if unknown."""
    found = [(b, what) for b, what in ((_cgroup_room(), "the cgroup memory limit"),
                                        (_mem_available(), "MemAvailable")) if b is not None]
    return min(found) if found else (None, "")


# -- glibc malloc ----------------------------------------------------------------------------------

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "mallinfo2") and hasattr(lib, "malloc_trim") else None


_LIBC = _libc()
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
# glibc gives each thread that allocates concurrently its own arena (up to 8 per core); the scheduler's
# engine, gRPC, OpenMP and grammar threads then keep freed memory in several heaps that are trimmed
# separately. Two bound that.
MALLOC_ARENAS = 2
# A forward allocates its activations afresh each step (torch's CPU allocator is malloc). Above glibc's
# mmap threshold (128 KiB at first) each is a new mapping whose pages fault in as they are first written
# and go back to the OS when freed, so every step paid the faults again: on a 2-core Xeon with AMX, a
# 512-token prefill of SmolLM2-135M took 610 against 445 ms with this, and a 64-request decode step 131
# against 122 ms. Up to 32 MiB (glibc's highest threshold) they now come from the heap, whose freed
# pages stay for the next step (trimmed from its top only past TRIM_THRESHOLD); `malloc_trim` returns
# them once the engine is idle.
MMAP_THRESHOLD = 32 * MIB
TRIM_THRESHOLD = 1 << 30


def malloc_free_bytes() -> int:
    """Bytes glibc holds in its arenas that nothing uses (freed, not yet returned); 0 without glibc."""
    if _LIBC is None:
        return 0
    _LIBC.mallinfo2.restype = _MallInfo2
    return int(_LIBC.mallinfo2().fordblks)


def malloc_trim() -> None:
    """Return the arenas' free pages to the OS (glibc; a no-op elsewhere)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(ctypes.c_size_t(0))


def configure_malloc(arenas: int = MALLOC_ARENAS) -> None:
    """glibc malloc for a forward loop: at most `arenas` arenas, and blocks up to MMAP_THRESHOLD from
    the heap, kept when freed. Call before the threads start; each setting given in the environment
    (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_) wins. A no-op without glibc."""
    if _LIBC is None:
        return
    for env, param, value in (("MALLOC_ARENA_MAX", M_ARENA_MAX, arenas),
                              ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                              ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if env not in os.environ:
            _LIBC.mallopt(ctypes.c_int(param), ctypes.c_int(value))


# -- the startup check -----------------------------------------------------------------------------

class Bound(NamedTuple):
    """Memory a setting will allocate, for the startup check."""
    bytes: int
    what: str     # the holder, as the error lists it
    lower: str    # the setting(s) that shrink it


def check_fits(to_allocate: list[Bound], room_and_source: tuple[int | None, str],
               headroom: int = RUNTIME_HEADROOM) -> None:
    """Raise MemoryBudgetError when the bounds not yet allocated plus headroom exceed the room left
    (bytes, where that figure comes from: room_bytes() for host memory); the message names the
    setting that shrinks the largest. Logs the figures either way."""
    room, source = room_and_source
    need = sum(b.bytes for b in to_allocate) + headroom
    parts = ", ".join(f"{b.what} {b.bytes / MIB:.0f} MiB" for b in to_allocate)
    if room is None:
        log.info("memory check: %.0f MiB to allocate (%s), room unknown", need / MIB, parts)
        return
    log.info("memory check: %.0f MiB to allocate (%s; runtime headroom %.0f MiB), %.0f MiB free by %s",
             need / MIB, parts, headroom / MIB, room / MIB, source)
    if need > room:
        lower = max(to_allocate, key=lambda b: b.bytes).lower if to_allocate else "the model"
        raise MemoryBudgetError(
            f"the configuration needs {need / MIB:.0f} MiB more memory ({parts}; runtime headroom "
            f"{headroom / MIB:.0f} MiB) but {source} leaves {room / MIB:.0f} MiB: lower {lower}")
