"""ringserve's four services via `python -m ringserve.launcher`, on free ports.

The launcher starts detokenizer -> scheduler -> tokenizer -> gateway, each once the previous is
SERVING, and copies their output with a `[name]` prefix; the gateway's readiness line reaching
that output means all four are up. Stopping the launcher's process group stops them all.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.server_proc import Server
from ringserve.process import READY_LINE, free_port


@dataclass
class Ringserve:
    server: Server
    gateway_url: str
    grpc_target: str
    scheduler_metrics: str  # its /metrics: the step profile


FAIL_MARKERS = ("Error while finding module specification", "ModuleNotFoundError", "startup stopped:")


def start_ringserve(model: Path, timeout: float = 300, extra: Sequence[str] = ()) -> Ringserve:
    ports = {k: free_port() for k in ("gateway", "tokenizer", "scheduler", "detokenizer")}
    sched_metrics = free_port()
    host = "127.0.0.1"
    cmd = [sys.executable, "-m", "ringserve.launcher", "--model", str(model), "--host", host, "--no-restart",
           "--startup-timeout-s", str(int(timeout)),
           *[a for k, p in ports.items() for a in (f"--{k}-port", str(p))],
           # the scheduler's metrics give the step profile; the others are not read
           "--tokenizer-metrics-port", "-1", "--scheduler-metrics-port", str(sched_metrics),
           "--detokenizer-metrics-port", "-1",
           *extra]
    gateway = f"http://{host}:{ports['gateway']}"
    # A service that cannot even be imported fails the start at once instead of after the timeout.
    srv = Server(f"ringserve-{model.name}", cmd, READY_LINE, health_url=f"{gateway}/health",
                 fail_markers=FAIL_MARKERS, stop_timeout=70)
    try:
        srv.start(timeout)
    except BaseException:
        srv.stop()
        raise
    return Ringserve(srv, gateway, f"{host}:{ports['tokenizer']}", f"http://{host}:{sched_metrics}/metrics")
