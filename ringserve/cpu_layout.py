"""How the launcher shares a CPU-only machine between the scheduler's forward and the I/O services.

The forward runs on OpenMP threads that meet at a barrier after every kernel: when one of them
loses its core to the gateway, tokenizer or detokenizer (which wake up at every decode step to
stream its tokens), the whole step waits for it. So the launcher keeps a few cores for those three
(pins them there) and has the scheduler run decode steps on the other cores; prefill steps, long
and GEMM-bound, still use every core (the services have little to do while a prompt is prefilled).
vLLM's CPU backend does the same by default (on a 2-core machine: its OpenMP threads on core 0,
core 1 kept for its API server).

How many cores that takes depends on the model. The services spend about the same CPU per streamed
token whatever the model (~130 us on the development machines), while the forward's cost per token
grows with the model's size: for a model of a few million parameters the two are alike, and keeping
one core in eight for the services (at least one) pays; for a real model (the default, 135M
parameters) the forward is nearly all of it, so a kept core mostly idles while decode waits on
compute (on 2 cores, decode unpinned on both served the default model 13-17 % more output tok/s on
benchmark workloads B and C than decode on one, and the same on A). So a model of 50M parameters or
more gets one core in 64 for the services, none on fewer.
With a GPU the forward does not run on these threads, so nothing is pinned.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and ROCm's control devices
CORES_PER_IO_CORE = 8  # auto, a small model: one core for the I/O services per this many, at least one
LARGE_MODEL_PARAMS = 50_000_000  # auto: from this size on, a model's forward dominates a token's CPU
CORES_PER_IO_CORE_LARGE = 64  # auto, a larger model: one core per this many, none on fewer


@dataclass(frozen=True)
class CpuLayout:
    io_cpus: frozenset[int]  # where the gateway, tokenizer and detokenizer run
    decode_threads: int      # the scheduler's --decode-threads


def scheduler_on_cpu(scheduler_args: str) -> bool:
    """The scheduler's device as it will pick it: --device, else RINGSERVE_DEVICE, else CUDA if present."""
    args = shlex.split(scheduler_args)
    device = os.environ.get("RINGSERVE_DEVICE", "")
    for i, a in enumerate(args):
        if a == "--device" and i + 1 < len(args):
            device = args[i + 1]
        elif a.startswith("--device="):
            device = a.split("=", 1)[1]
    if device:
        return device == "cpu"
    return not any(Path(f).exists() for f in GPU_DEVICE_FILES)


def plan(io_cores: int, on_cpu: bool, cpus: set[int] | None = None,
         model_params: int | None = None) -> CpuLayout | None:
    """The layout for `io_cores` (-1: auto, by the model's parameter count; unknown counts as small),
    or None when nothing should be pinned."""
    cpus = set(os.sched_getaffinity(0)) if cpus is None else cpus
    if io_cores == 0 or not on_cpu or len(cpus) < 2:
        return None
    if io_cores > 0:
        n = min(io_cores, len(cpus) - 1)
    elif model_params is not None and model_params >= LARGE_MODEL_PARAMS:
        n = len(cpus) // CORES_PER_IO_CORE_LARGE
    else:
        n = max(1, len(cpus) // CORES_PER_IO_CORE)
    if n == 0:
        return None
    ordered = sorted(cpus)
    return CpuLayout(io_cpus=frozenset(ordered[-n:]), decode_threads=len(cpus) - n)
