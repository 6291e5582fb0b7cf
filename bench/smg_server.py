"""SGLang's gateway, smg (PyPI `smg`, a Rust binary in a wheel), in front of ringserve schedulers that
serve SGLang's scheduler protocol (`--sglang-grpc-port`). Used by the `smg` bench target and by
tests/e2e/test_smg.py.

smg tokenizes and detokenizes itself: it reads the tokenizer from the directory the worker's
GetModelInfo names (the model directory). Ready means its /readiness reports every worker healthy,
which it does only after it has called the workers' HealthCheck, GetModelInfo and loaded the tokenizer.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

import httpx

from ringserve.process import ServiceProcess, free_port

READY_POLL_S = 0.2


def smg_binary() -> str | None:
    """The `smg` console script of this interpreter's environment (else on PATH), or None."""
    here = Path(sys.executable).parent / "smg"
    return str(here) if here.exists() else shutil.which("smg")


def smg_cmd(workers: list[str], model_dir: str, port: int, host: str = "127.0.0.1",
            health_check_interval_s: int | None = None, shutdown_grace_s: int = 2) -> list[str]:
    """`smg launch` routing to grpc://worker for each worker (HOST:PORT of an --sglang-grpc-port)."""
    binary = smg_binary()
    if binary is None:
        raise FileNotFoundError("smg is not installed (pip install smg==1.13.0)")
    cmd = [binary, "launch", "--worker-urls", *[f"grpc://{w}" for w in workers], "--model-path", model_dir,
           "--host", host, "--port", str(port),
           # its Prometheus port defaults to 29000 on every interface: a free one, so two can run
           "--prometheus-host", host, "--prometheus-port", str(free_port()), "--log-level", "info",
           "--shutdown-grace-period-secs", str(shutdown_grace_s)]
    if health_check_interval_s is not None:
        cmd += ["--health-check-interval-secs", str(health_check_interval_s)]
    return cmd


def readiness(url: str) -> dict:
    """smg's /readiness: {"status", "healthy_workers", "total_workers"} (503 while not ready)."""
    r = httpx.get(f"{url}/readiness", timeout=5)
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}


def wait_ready(proc: ServiceProcess, url: str, timeout: float, workers: int = 1) -> None:
    """Until smg's /readiness counts `workers` healthy workers; raise if smg exits first."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: a bounded wait between two polls of the health endpoint
    while True:
        if not proc.alive():
            raise RuntimeError(f"smg exited before it was ready:\n{proc.output()[-3000:]}")
        try:
            if readiness(url).get("healthy_workers", 0) >= workers:
                return
        except (httpx.HTTPError, ValueError):
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"smg at {url} not ready in {timeout:.0f}s:\n{proc.output()[-3000:]}")
        pause.wait(READY_POLL_S)


def model_id(url: str) -> str:
    """The model name smg serves (the worker's served_model_name: its model directory)."""
    return httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
