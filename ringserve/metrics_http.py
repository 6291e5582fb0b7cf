"""Serve Prometheus /metrics on the service's own HTTP port."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger(__name__)


def start_metrics_server(host: str, port: int) -> None:
    """A negative port disables the endpoint; 0 picks a free one."""
    if port < 0:
        return
    start_http_server(port, addr=host)
    log.info("metrics on http://%s:%d/metrics", host, port)
