"""python -m services.scheduler --port 50052 --metrics-port 9092 --model M --detokenizer HOST:PORT

The OpenMP wait is set here, after the flags are parsed and before anything imports torch: libgomp
(torch's OpenMP runtime) reads it once, when it loads.

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
import sys
from dataclasses import replace

from ringserve import grpc_server
from ringserve.config import parse_config
from ringserve.logs import setup_logging
from services.scheduler.config import SchedulerServerConfig

SPIN_COUNT = "30000000"


def set_openmp_wait(decode_threads: int | None, num_threads: int | None) -> None:
    """decode_threads, num_threads: the scheduler's flags (None: every thread torch would use)."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    threads = num_threads or len(os.sched_getaffinity(0))
    if decode_threads is not None and decode_threads < threads:
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(SchedulerServerConfig, argv, description="ringserve scheduler: batching, KV cache, forward loop")
    set_openmp_wait(cfg.decode_threads, cfg.num_threads)
    # These load torch, and libgomp with it, which reads the OpenMP settings once: after the line above.
    from ringserve.model_source import architectures, exit_on_model_error, require_files, resolve_model
    from services.scheduler.memory import MemoryBudgetError, configure_malloc
    from services.scheduler.models import check_architectures
    from services.scheduler.server import SchedulerServer

    with exit_on_model_error():  # a model that cannot be served: one line, before anything starts
        path = require_files(resolve_model(cfg.model, prepare=True), cfg.model, "config.json", "tokenizer.json")
        check_architectures(architectures(path), cfg.model)
    setup_logging("scheduler")
    configure_malloc()
    try:
        return grpc_server.run(SchedulerServer(replace(cfg, model=str(path))).serve())
    except MemoryBudgetError as e:  # the configuration cannot fit: one line, before an OOM kill could come
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
