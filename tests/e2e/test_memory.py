"""The scheduler's memory accounting through the real processes: /metrics and GetServerInfo of a
running scheduler, and a configuration too large for the machine refused at startup."""

from __future__ import annotations

import re
import subprocess

import grpc
import httpx
import pytest

from ringserve.process import free_port, python_cmd
from ringserve.v1 import api_pb2, api_pb2_grpc
from tests.e2e.stack import running_stack

pytestmark = pytest.mark.e2e
COMPONENTS = ("weights", "kv_pool", "req_to_token", "decode_rows", "shared_prefixes", "radix_cache", "grammar")


def _samples(text: str, name: str) -> dict[str, float]:
    """component -> value of a ringserve:memory_* family (unlabelled: key "")."""
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        comp = re.search(r'component="(\w+)"', m.group(1))
        out[comp.group(1) if comp else ""] = float(m.group(2))
    return out


def test_running_scheduler_reports_its_memory_in_metrics_and_server_info(model_dir: str) -> None:
    with running_stack(model_dir, "--scheduler-args", "--max-total-tokens 8192") as stack:
        stack.generate({"text": "memory", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        text = httpx.get(f"http://127.0.0.1:{stack.ports['sched_metrics']}/metrics", timeout=10).text
        held = _samples(text, "ringserve:memory_bytes")
        bound = _samples(text, "ringserve:memory_bound_bytes")
        assert set(COMPONENTS) <= set(held) and set(held) == set(bound)
        assert held["kv_pool"] == bound["kv_pool"] == 8193 * 4 * 4 * 32 * 4 * 2  # (size + 1) x layers x heads...
        assert _samples(text, "ringserve:memory_accounted_bytes")[""] == sum(held.values())
        assert _samples(text, "ringserve:memory_accounted_bound_bytes")[""] == sum(bound.values())
        rss = _samples(text, "ringserve:memory_rss_bytes")[""]
        assert rss > held["kv_pool"] + held["weights"]
        assert _samples(text, "ringserve:memory_malloc_free_bytes")[""] > 0
        with grpc.insecure_channel(stack.tokenizer) as ch:
            info = api_pb2_grpc.InferenceServiceStub(ch).GetServerInfo(api_pb2.GetServerInfoRequest(), timeout=10)
        (sched,) = info.schedulers
        assert sched.memory_bound_bytes > 0 and sched.rss_bytes > 0
        assert 0 < sched.memory_accounted_bytes <= sched.memory_bound_bytes


@pytest.mark.parametrize("flag", ["--max-total-tokens 1000000000", "--decode-cache-mib 100000000"])
def test_a_configuration_too_large_for_the_machine_fails_at_startup_naming_the_setting(
        model_dir: str, flag: str) -> None:
    cmd = python_cmd("services.scheduler", "--model", model_dir, "--host", "127.0.0.1", "--port", str(free_port()),
                     "--metrics-port", "-1", *flag.split())
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the configuration needs") and f": lower {flag.split()[0]}" in last, last
    assert "Traceback" not in done.stderr
