"""A benchmarked server as a child process: its output goes to a log file, readiness is a line in
that output (no sleeping), and stopping kills its whole process group."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

from bench.venvs import CACHE, log
from ringserve.process import ServiceProcess

LOG_DIR = CACHE / "logs"


def descendants(pid: int) -> set[int]:
    """Pids of all live descendants of `pid` (from /proc), taken before stopping it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


class LineWatcher:
    """A ServiceProcess sink: appends to a log file and fires an event on a marker line."""

    def __init__(self, path: Path, marker: str, fail_markers: tuple[str, ...] = ()) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("w", encoding="utf-8")
        self.marker = marker
        self.fail_markers = fail_markers
        self.seen = threading.Event()
        self.failure = ""

    def write(self, text: str) -> None:
        if self.marker in text:
            self.seen.set()
        if not self.failure and any(m in text for m in self.fail_markers):
            self.failure = text.strip()
            self.seen.set()
        self.file.write(text)

    def flush(self) -> None:
        self.file.flush()


class Server:
    def __init__(self, name: str, cmd: list[str], marker: str, env: dict[str, str] | None = None,
                 health_url: str | None = None, fail_markers: tuple[str, ...] = (), stop_timeout: float = 20) -> None:
        self.name = name
        self.log_path = LOG_DIR / f"{name}.log"
        self.watcher = LineWatcher(self.log_path, marker, fail_markers)
        self.stop_timeout = stop_timeout
        self.proc = ServiceProcess(name, cmd, env=env, sink=self.watcher)
        self.health_url = health_url

    def start(self, timeout: float) -> Server:
        t0 = time.monotonic()
        log(f"starting {self.name} (log: {self.log_path})")
        self.proc.start()
        deadline = t0 + timeout
        while not self.watcher.seen.wait(0.5):
            if not self.proc.alive():
                assert self.proc.proc is not None  # started above
                raise RuntimeError(f"{self.name} exited with {self.proc.proc.returncode}; "
                                   f"last output:\n{''.join(list(self.proc.tail)[-20:])}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")
        if self.watcher.failure:
            raise RuntimeError(f"{self.name} failed to start: {self.watcher.failure}; see {self.log_path}")
        if self.health_url:
            self._confirm_health(deadline)
        log(f"{self.name} ready in {time.monotonic() - t0:.0f}s")
        return self

    def _confirm_health(self, deadline: float) -> None:
        """GET the health URL until 200. uvicorn logs "Application startup complete" just before it
        binds the socket, so the first tries may be refused; this is bounded by the start deadline."""
        assert self.health_url is not None  # called only when there is one
        last: Exception | None = None
        while time.monotonic() < deadline and self.proc.alive():
            try:
                with urllib.request.urlopen(self.health_url, timeout=10) as r:
                    if r.status == 200:
                        return
                    last = RuntimeError(f"HTTP {r.status}")
            except OSError as e:  # connection refused, or HTTP 503 (HTTPError) while still warming up
                last = e
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: GET {self.health_url} never returned 200 ({last}); see {self.log_path}")

    def stop(self) -> None:
        p = self.proc.proc
        if p is None:
            return
        family = descendants(p.pid)
        self.proc.stop(timeout=self.stop_timeout)
        try:  # vLLM's engine core and workers share its process group
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in descendants(p.pid) | family:  # the launcher's services run in their own sessions
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.watcher.flush()
        log(f"{self.name} stopped")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
