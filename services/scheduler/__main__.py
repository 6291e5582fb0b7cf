"""python -m services.scheduler --port 50052 --metrics-port 9092 --model M --detokenizer HOST:PORT"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace

from ringserve.config import parse_config
from ringserve.logs import setup_logging
from services.scheduler import omp_env
from services.scheduler.config import SchedulerServerConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(SchedulerServerConfig, argv, description="ringserve scheduler: batching, KV cache, forward loop")
    omp_env.apply(cfg.decode_threads, cfg.num_threads)
    # These load torch, and libgomp with it, which reads the OpenMP settings once: after `apply`.
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
        return asyncio.run(SchedulerServer(replace(cfg, model=str(path))).serve())
    except MemoryBudgetError as e:  # the configuration cannot fit: one line, before an OOM kill could come
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
