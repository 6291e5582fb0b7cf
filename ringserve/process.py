"""Start a service as an OS process and wait for it to be ready, without sleeping.

Used by the launcher (`make run`) and by the end-to-end tests. Readiness is event driven:
gRPC services are watched with grpc.health.v1 `Watch` (the server pushes SERVING), the HTTP
gateway prints a readiness line that is read from its output.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve import tls as tls_mod

ROOT = Path(__file__).resolve().parent.parent
READY_LINE = "RINGSERVE READY"  # printed by a service once it serves (the gateway, for HTTP)


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A port free now that this process has not handed out before.

    The kernel may give the same ephemeral port to two binds in a row once the first socket is
    closed, so without the record two services started together could be told the same port.
    """
    with _handed_out_lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port: int = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def wait_grpc_serving(target: str, timeout: float, service: str = "",
                      tls: tls_mod.TlsConfig | None = None) -> None:
    """Block until `target` reports SERVING on grpc.health.v1, or raise TimeoutError.

    TLS follows `tls`, else the process's config / RINGSERVE_TLS_* env (ringserve.tls).
    """
    deadline = time.monotonic() + timeout
    with tls_mod.sync_channel(target, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{target} not SERVING after {timeout:.0f}s")
            try:
                # wait_for_ready holds the call until the server accepts connections; Watch then
                # streams every status change, so nothing here polls.
                for resp in stub.Watch(health_pb2.HealthCheckRequest(service=service),
                                       timeout=left, wait_for_ready=True):
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise TimeoutError(f"{target} not SERVING after {timeout:.0f}s") from e
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise  # a broken health service, not a restart: asking again would spin
                # The server went away mid-watch (restart): wait_for_ready waits for the next one.


class TextSink(Protocol):
    """Where a ServiceProcess copies its child's output: a text stream, or anything with these two."""

    def write(self, text: str, /) -> object: ...

    def flush(self) -> object: ...


class ServiceProcess:
    """A child process whose output is copied, line by line with a prefix, to `sink`."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None,
                 sink: TextSink | None = None, cwd: Path = ROOT, cpus: frozenset[int] | None = None) -> None:
        self.name = name
        self.cpus = cpus  # pin the process to these cores (None: wherever the OS puts it)
        self.cmd = cmd
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.sink: TextSink = sink if sink is not None else sys.stdout
        self.cwd = cwd
        self.proc: subprocess.Popen[str] | None = None
        self.tail: deque[str] = deque(maxlen=2000)
        self.lines_seen = 0
        self._new_line = threading.Condition()
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self) -> ServiceProcess:
        self._ready.clear()
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     start_new_session=True)
        if self.cpus:
            # Popen returns once the child has exec'd, before the interpreter has started any thread,
            # so the main thread's mask is the one every later thread inherits.
            try:
                os.sched_setaffinity(self.proc.pid, self.cpus)
            except ProcessLookupError:
                pass  # it already exited; the supervisor sees that
        self._reader = threading.Thread(target=self._pump, args=(self.proc,), daemon=True)
        self._reader.start()
        return self

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._new_line:
                self.tail.append(line)
                self.lines_seen += 1
                self._new_line.notify_all()
            if READY_LINE in line:
                self._ready.set()
            try:
                self.sink.write(f"[{self.name}] {line}")
                self.sink.flush()
            except ValueError:  # sink closed at interpreter exit
                pass

    def wait_ready_line(self, timeout: float) -> None:
        """Block until the process prints READY_LINE (or dies, or the timeout passes)."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} printed no readiness line in {timeout:.0f}s:\n{self.output()}")

    def wait_output(self, text: str, timeout: float, after: int = 0) -> str:
        """Block until a line printed after line number `after` contains `text`; return it."""
        deadline = time.monotonic() + timeout
        with self._new_line:
            while True:
                recent = list(self.tail)[-(self.lines_seen - after):] if self.lines_seen > after else []
                for line in recent:
                    if text in line:
                        return line
                after = self.lines_seen
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no line with {text!r} in {timeout:.0f}s")
                self._new_line.wait(left)

    def wait_serving(self, target: str, timeout: float) -> None:
        """Block until `target` is SERVING; raise at once if the process exits meanwhile.

        The health Watch (wait_for_ready) cannot see the process die: without this a service that
        crashes at import would make its caller wait the whole startup timeout.
        """
        outcome: list[BaseException | None] = []
        done = threading.Event()

        def watch() -> None:
            try:
                wait_grpc_serving(target, timeout)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                outcome.append(e)
            finally:
                done.set()

        threading.Thread(target=watch, daemon=True, name=f"wait {self.name}").start()
        while not done.wait(0.5):
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before SERVING:\n"
                                   f"{self.output()}")
        err = outcome[0]
        if isinstance(err, TimeoutError):
            raise TimeoutError(f"{err}\n{self.name} output:\n{self.output()}") from err
        if err is not None:
            raise err

    def output(self) -> str:
        return "".join(self.tail)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the service drains), then SIGKILL the whole process group after `timeout`."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=2)
        return self.proc.returncode


def python_cmd(module: str, *args: str) -> list[str]:
    """`python -m module args`, the same command the containers run."""
    return [sys.executable, "-m", module, *args]
