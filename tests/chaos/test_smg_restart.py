"""A scheduler behind smg is killed and restarted: smg's readiness follows it down and back up, and
requests through smg succeed again afterwards. Two scheduler starts, so only with -m chaos (make chaos).
"""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from bench.smg_server import model_id, readiness, smg_binary, smg_cmd, wait_ready
from ringserve.process import ServiceProcess, free_port, python_cmd

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.chaos]


def _scheduler(model_dir: str, own: int, port: int) -> ServiceProcess:
    return ServiceProcess("scheduler", python_cmd(
        "services.scheduler", "--model", model_dir, "--port", str(own), "--metrics-port", "-1",
        "--detokenizer", "", "--sglang-grpc-port", str(port), "--max-total-tokens", "4096")).start()


def _complete(url: str, model: str) -> str:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
    r = c.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0)
    return r.choices[0].text


def test_smg_readiness_follows_a_scheduler_restart(model_dir: str) -> None:
    if smg_binary() is None:
        pytest.skip("smg is not installed (requirements-dev.txt: smg==1.13.0)")
    own, port, http_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{http_port}"
    sched = _scheduler(model_dir, own, port)
    smg = None
    try:
        sched.wait_serving(f"127.0.0.1:{port}", timeout=180)
        smg = ServiceProcess("smg", smg_cmd([f"127.0.0.1:{port}"], model_dir, http_port,
                                            health_check_interval_s=1)).start()
        wait_ready(smg, url, timeout=60)
        model = model_id(url)
        before = _complete(url, model)

        sched.signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        pause = threading.Event()
        while readiness(url).get("healthy_workers", 0) and time.monotonic() < deadline:
            pause.wait(0.2)  # smg health-checks every second
        assert readiness(url).get("healthy_workers", 0) == 0, "smg still counts the dead scheduler healthy"

        sched = _scheduler(model_dir, own, port)
        sched.wait_serving(f"127.0.0.1:{port}", timeout=180)
        wait_ready(smg, url, timeout=60)
        assert _complete(url, model) == before  # greedy: the same text from the restarted scheduler
    finally:
        if smg is not None:
            smg.stop()
        sched.stop(timeout=20)
