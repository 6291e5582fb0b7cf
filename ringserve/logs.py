"""One log line per event: time, level, service, message (with rid=... where there is one)."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(service: str, level: str | None = None) -> logging.Logger:
    level = (level or os.environ.get("RINGSERVE_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return logging.getLogger(service)
