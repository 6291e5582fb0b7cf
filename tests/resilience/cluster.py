"""Start the services one by one as real processes (any number of tokenizers and gateways).

tests/e2e/stack.py starts the standard four through the launcher; resilience tests need shapes the
launcher does not make (two tokenizers on one scheduler, two gateways on one tokenizer) and direct
control of each process (SIGKILL, SIGTERM, /proc), so they start each service themselves, with the
same commands as docs/internals.md and readiness from health Watch / the gateway's ready line.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ringserve.process import ServiceProcess, free_port, python_cmd
from ringserve.v1 import api_pb2, api_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

STARTUP_S = 180.0
ERROR_LINE = re.compile(r" (ERROR|CRITICAL) |Traceback")


@dataclass
class Svc:
    proc: ServiceProcess
    port: int

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def errors(self) -> list[str]:
        return [line for line in self.proc.tail if ERROR_LINE.search(line)]


@dataclass
class Cluster:
    model: str
    services: list[Svc] = field(default_factory=list)

    def _start(self, name: str, module: str, *args: str, grpc_ready: bool = True, port: int = 0) -> Svc:
        port = port or free_port()
        proc = ServiceProcess(name, python_cmd(module, "--host", "127.0.0.1", "--port", str(port), *args),
                              env={"RINGSERVE_LOG_LEVEL": "INFO"})
        svc = Svc(proc.start(), port)
        self.services.append(svc)
        if grpc_ready:
            proc.wait_serving(svc.target, STARTUP_S)
        else:
            proc.wait_ready_line(STARTUP_S)
        return svc

    def detokenizer(self, *args: str) -> Svc:
        return self._start("detokenizer", "services.detokenizer", "--metrics-port", "-1",
                           "--model", self.model, *args)

    def scheduler(self, detok: Svc, *args: str) -> Svc:
        return self._start("scheduler", "services.scheduler", "--metrics-port", "-1", "--model", self.model,
                           "--detokenizer", detok.target, *args)

    def tokenizer(self, sched: Svc, detok: Svc, *args: str, name: str = "tokenizer", port: int = 0) -> Svc:
        return self._start(name, "services.tokenizer", "--metrics-port", "-1", "--model", self.model,
                           "--scheduler", sched.target, "--detokenizer", detok.target, *args, port=port)

    def gateway(self, tok: Svc, *args: str, name: str = "gateway") -> Svc:
        return self._start(name, "gateway", "--tokenizer", tok.target, *args, grpc_ready=False)

    def ring(self, sched_args: tuple[str, ...] = (), tok_args: tuple[str, ...] = ()) -> tuple[Svc, Svc, Svc]:
        detok = self.detokenizer()
        sched = self.scheduler(detok, *sched_args)
        return detok, sched, self.tokenizer(sched, detok, *tok_args)

    def stop_all(self) -> None:
        for svc in reversed(self.services):
            svc.proc.stop(timeout=20)


@contextmanager
def cluster(model: str) -> Iterator[Cluster]:
    c = Cluster(model)
    try:
        yield c
    finally:
        c.stop_all()


def eventually(check: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> None:
    """Poll a state (not readiness) that converges asynchronously: KV freed, a map emptied."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        time.sleep(every)


def scheduler_load(target: str) -> scheduler_pb2.LoadReport:
    with grpc.insecure_channel(target) as ch:
        return scheduler_pb2_grpc.SchedulerServiceStub(ch).GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10).load


def rid_to_state_size(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return api_pb2_grpc.InferenceServiceStub(ch).GetServerInfo(
            api_pb2.GetServerInfoRequest(), timeout=10).rid_to_state_size


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise LookupError(f"no VmRSS for {pid}")
