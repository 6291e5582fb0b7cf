"""Start the whole stack (four real processes through the launcher) for end-to-end tests."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from ringserve.process import ServiceProcess, free_port, python_cmd


@dataclass
class Stack:
    launcher: ServiceProcess
    gateway_url: str
    tokenizer: str
    scheduler: str
    detokenizer: str
    ports: dict[str, int]

    def generate(self, body: dict, timeout: float = 60) -> dict:
        r = httpx.post(f"{self.gateway_url}/generate", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def timeline(self, last: int = 80) -> str:
        """The launcher's recent lines without per-request ones: what to read when a fault test fails."""
        events = [line for line in self.launcher.tail if "rid=" not in line]
        return "".join(events[-last:])

    def service_pid(self, module: str) -> int:
        """The pid of a service child, found by its command line and port."""
        port = str(self.ports[module.rsplit(".", 1)[-1]])
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in argv]
            if module in args and port in args:
                return int(entry.name)
        raise LookupError(f"no process for {module} on port {port}")


@contextmanager
def running_stack(model: str, *extra: str, env: dict[str, str] | None = None,
                  timeout: float = 300) -> Iterator[Stack]:
    ports = {name: free_port() for name in ("gateway", "tokenizer", "scheduler", "detokenizer",
                                            "tok_metrics", "sched_metrics", "detok_metrics")}
    cmd = python_cmd(
        "ringserve.launcher", "--model", model, "--host", "127.0.0.1",
        "--gateway-port", str(ports["gateway"]), "--tokenizer-port", str(ports["tokenizer"]),
        "--scheduler-port", str(ports["scheduler"]), "--detokenizer-port", str(ports["detokenizer"]),
        "--tokenizer-metrics-port", str(ports["tok_metrics"]),
        "--scheduler-metrics-port", str(ports["sched_metrics"]),
        "--detokenizer-metrics-port", str(ports["detok_metrics"]), *extra)
    launcher = ServiceProcess("launcher", cmd, env={**(env or {}), "RINGSERVE_LOG_LEVEL": "INFO"})
    launcher.start()
    try:
        # The gateway's readiness line is forwarded through the launcher's output; the gateway
        # starts only after the other three are SERVING, so this is the whole stack's readiness.
        launcher.wait_ready_line(timeout)
        launcher.wait_output("ringserve is serving", timeout)  # the launcher's banner, after all four
        yield Stack(launcher, f"http://127.0.0.1:{ports['gateway']}", f"127.0.0.1:{ports['tokenizer']}",
                    f"127.0.0.1:{ports['scheduler']}", f"127.0.0.1:{ports['detokenizer']}", ports)
    finally:
        code = launcher.stop(timeout=60)
        if os.environ.get("RINGSERVE_TEST_DUMP"):
            print(launcher.output())
        assert code is not None


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """Parse `data:` lines of a server-sent event stream; yields dicts, or "[DONE]"."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        yield data if data == "[DONE]" else json.loads(data)
