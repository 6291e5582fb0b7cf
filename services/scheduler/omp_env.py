"""The scheduler's OpenMP wait, set before torch is imported: libgomp (torch's OpenMP runtime) reads it
once, when it loads. `python -m services.scheduler` calls `apply` right after parsing its flags and
only then imports the modules that load torch.

GOMP_SPINCOUNT=30000000: a forward thread that reaches the end of a parallel region spins this many
times for the next one before it sleeps; on the development Xeon that is ~0.4 s of spinning (libgomp's
default, 300,000, is ~4 ms). Between two decode steps the engine thread runs Python for a few
milliseconds (results, outputs, the next batch) while the gateway, tokenizer and detokenizer stream the
step's tokens; with the default the other forward threads went to sleep in that gap, and waking them
for the next step's first region is slow on a loaded (virtual) machine. An idle scheduler still sleeps,
~0.4 s after its last step.

Only where decode steps use every thread prefill does: with fewer (--decode-threads, which the
launcher sets for a small model, ringserve/cpu_layout.py) a worker left spinning after each prefill
holds a core that the decode thread or the services need (the 4.5M test model served A 2,718 -> 2,112
out tok/s with it). A value in the environment is kept: GOMP_SPINCOUNT itself, or OMP_WAIT_POLICY
(libgomp then uses that policy's own spin count).
"""

from __future__ import annotations

import os

SPIN_COUNT = "30000000"


def apply(decode_threads: int | None, num_threads: int | None) -> None:
    """decode_threads, num_threads: the scheduler's flags (None: every thread torch would use)."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    threads = num_threads or len(os.sched_getaffinity(0))
    if decode_threads is not None and decode_threads < threads:
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
