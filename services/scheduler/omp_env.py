"""The scheduler's OpenMP wait, set before torch is imported: libgomp (torch's OpenMP runtime) reads it
once, when it loads. `services/scheduler/__init__.py` calls `apply`, so `python -m services.scheduler`
takes it before any module imports torch.

GOMP_SPINCOUNT=30000000: a forward thread that reaches the end of a parallel region spins this many
times for the next one before it sleeps; on the development Xeon that is ~0.4 s of spinning (libgomp's
default, 300,000, is ~4 ms). Between two decode steps the engine thread runs Python for a few
milliseconds (results, outputs, the next batch) while the gateway, tokenizer and detokenizer stream the
step's tokens; with the default the other forward threads went to sleep in that gap, and waking them
for the next step's first region is slow on a loaded (virtual) machine. An idle scheduler still sleeps,
~0.4 s after its last step; OMP_WAIT_POLICY=ACTIVE (which never does) measured the same under load.

A value in the environment is kept: GOMP_SPINCOUNT itself, or OMP_WAIT_POLICY (libgomp then uses that
policy's own spin count).
"""

from __future__ import annotations

import os

SPIN_COUNT = "30000000"


def apply() -> None:
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
