"""python -m services.scheduler --port 50052 --metrics-port 9092 --model M --detokenizer HOST:PORT"""

from __future__ import annotations

import asyncio
import sys

from ringserve.config import parse_config
from ringserve.logs import setup_logging
from services.scheduler.config import SchedulerServerConfig
from services.scheduler.server import SchedulerServer


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(SchedulerServerConfig, argv, description="ringserve scheduler: batching, KV cache, forward loop")
    setup_logging("scheduler")
    return asyncio.run(SchedulerServer(cfg).serve())


if __name__ == "__main__":
    sys.exit(main())
