"""Run the deployment's own commands (compose services, Helm containers) as local processes.

Both e2e tests translate a deployment file into `LocalService`s, then `run_ring` starts them in order,
gates each on readiness (gRPC health Watch / the gateway's ready line), runs each one's health check
once, sends a request through the gateway and stops everything (SIGTERM drain, exit 0).

Translation is literal: the command, flags and environment come from the file; only what cannot work
outside a container is mapped: service hostnames -> 127.0.0.1, container ports -> free local ports,
`python` -> this interpreter, the in-image paths /models/default, /prepared and /cache/hf -> local
directories (`local_paths`). The model-preparation step (compose's model-init service, the chart's
init container) runs first, once, as a `OneShot` (`prepare_model`): it writes the local /prepared/model
that the services then read.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ringserve.process import ServiceProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
IMAGE_MODEL_DIR = "/models/default"
IMAGE_HF_HOME = "/cache/hf"
IMAGE_PREPARED_DIR = "/prepared"  # the volume model-init writes and the services read (/prepared/model)
IMAGE_TLS_DIR = "/etc/ringserve/tls"  # where compose's TLS override and the chart's tls block mount the files
# Modules the containers run; the e2e tests skip (with this reason) until they exist.
SERVICE_MODULES = ("services.detokenizer", "services.scheduler", "services.tokenizer", "gateway")
TARGET_RE = re.compile(r"^(?P<scheme>dns:///)?(?P<host>[A-Za-z0-9][A-Za-z0-9.-]*):(?P<port>\d+)$")
LOCAL_ADDR_RE = re.compile(r"127\.0\.0\.1:(\d+)")
START_TIMEOUT_S = 300.0  # the scheduler loads the model and warms up on a shared 2-core machine


def skip_unless_services_exist() -> None:
    missing = [m for m in SERVICE_MODULES if importlib.util.find_spec(f"{m}.__main__") is None]
    if missing:
        pytest.skip(f"service modules not written yet: {', '.join(missing)} (no __main__)")
    if importlib.util.find_spec("ringserve.v1") is None:
        pytest.skip("generated protobuf code missing: run `make proto`")


@dataclass
class LocalService:
    """One deployment unit translated for a local run."""

    name: str
    argv: list[str]  # as written in the deployment file, `python -m module ...`
    env: dict[str, str]
    ports: list[int]  # container ports it listens on (its own --port and --metrics-port)
    kind: str  # "grpc" (health Watch) or "http" (ready line)
    serve_port: int  # the port its health check targets
    health: Callable[[PortMap], None] = field(repr=False, default=lambda pm: None)


@dataclass
class OneShot:
    """A command that runs to completion before the services start (model preparation)."""

    name: str
    argv: list[str]  # `python -m module ...`, or `sh -c SCRIPT`
    env: dict[str, str]


@dataclass
class PortMap:
    """(host name, container port) -> local port; host names are compose services or k8s Services."""

    by_host: dict[str, str] = field(default_factory=dict)  # host alias -> service name
    ports: dict[tuple[str, int], int] = field(default_factory=dict)

    def add_service(self, name: str, ports: list[int], aliases: tuple[str, ...] = ()) -> None:
        for alias in (name, *aliases):
            self.by_host[alias] = name
        for p in ports:
            self.ports.setdefault((name, p), free_port())

    def local(self, service: str, port: int) -> int:
        return self.ports[(self.by_host[service], port)]

    def resolve_host(self, host: str) -> str | None:
        """`detokenizer`, `rs-ringserve-scheduler-headless.ns.svc.cluster.local` -> service name."""
        if host in self.by_host:
            return self.by_host[host]
        return self.by_host.get(host.split(".", 1)[0])


def local_paths(model_dir: str, tmp_path: Path) -> dict[str, str]:
    """In-image path -> local path: the model built into the images is the local test model; /prepared and
    HF_HOME are fresh directories of the test."""
    prepared = tmp_path / "prepared"
    prepared.mkdir(exist_ok=True)
    return {IMAGE_MODEL_DIR: model_dir, IMAGE_PREPARED_DIR: str(prepared), IMAGE_HF_HOME: hf_home_dir(tmp_path)}


def map_paths(value: str, paths: dict[str, str]) -> str:
    for image, local in paths.items():
        if value == image or value.startswith(image + "/"):
            return local + value[len(image):]
    return value


def localize_argv(svc: LocalService, pm: PortMap, paths: dict[str, str]) -> list[str]:
    """The container command with hosts, ports, interpreter and image paths mapped for a local run."""
    assert svc.argv[:2] == ["python", "-m"], f"{svc.name}: command must be `python -m MODULE`: {svc.argv}"
    out = [sys.executable, "-m", svc.argv[2]]
    args = svc.argv[3:]
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--port", "--metrics-port") and i + 1 < len(args):
            out += [a, str(pm.local(svc.name, int(args[i + 1])))]
            i += 2
            continue
        if a == "--host" and i + 1 < len(args):
            assert args[i + 1] == "0.0.0.0", f"{svc.name}: containers must bind 0.0.0.0"
            out += [a, "127.0.0.1"]
            i += 2
            continue
        out.append(localize_value(a, pm, paths))
        i += 1
    return out


def localize_value(value: str, pm: PortMap, paths: dict[str, str]) -> str:
    m = TARGET_RE.match(value)
    if m:
        target = pm.resolve_host(m["host"])
        assert target is not None, f"{value!r} names no service of the deployment"
        return f"{m['scheme'] or ''}127.0.0.1:{pm.local(target, int(m['port']))}"
    return map_paths(value, paths)


def with_tls_dir(env: dict[str, str], tls_dir: Path | None) -> dict[str, str]:
    """env with the TLS mount path replaced by the local directory holding the same files."""
    return env if tls_dir is None else {k: v.replace(IMAGE_TLS_DIR, str(tls_dir)) for k, v in env.items()}


def localize_env(env: dict[str, str], pm: PortMap, paths: dict[str, str]) -> dict[str, str]:
    return {k: localize_value(v, pm, paths) for k, v in env.items()}


def localize_oneshot(step: OneShot, paths: dict[str, str]) -> list[str]:
    """A one-shot's command for a local run: `python` -> this interpreter, in-image paths -> local ones
    (inside a `sh -c` script too)."""
    if step.argv[:2] == ["sh", "-c"] and len(step.argv) == 3:
        def literal(path: str) -> str:  # a re.sub replacement that inserts the quoted path as it is
            return shlex.quote(path).replace("\\", "\\\\")

        script = re.sub(r"(?<![\w/.-])python(?=\s)", literal(sys.executable), step.argv[2])
        for image, local in paths.items():
            script = re.sub(rf"(?<![\w/.-]){re.escape(image)}(?=[/\s\"']|$)", literal(local), script)
        return ["sh", "-c", script]
    assert step.argv[:2] == ["python", "-m"], f"{step.name}: command must be `python -m MODULE` or `sh -c`"
    return [sys.executable, *step.argv[1:3], *(map_paths(a, paths) for a in step.argv[3:])]


def prepare_model(step: OneShot, pm: PortMap, paths: dict[str, str]) -> Path:
    """Run the deployment's model-preparation step locally; returns the local /prepared/model it wrote."""
    argv = localize_oneshot(step, paths)
    unmapped = re.compile(rf"(?<![\w/.-]){re.escape(IMAGE_PREPARED_DIR)}\b")
    assert not any(unmapped.search(a) for a in argv[1:]), f"{step.name}: unmapped path in {argv}"
    env = {**os.environ, **localize_env(step.env, pm, paths), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, f"{step.name} {argv} exited {r.returncode}:\n{r.stdout}{r.stderr}"
    out = Path(map_paths(IMAGE_PREPARED_DIR + "/model", paths))
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists(), f"{step.name} wrote no model: {out}"
    return out


def localize_health_cmd(cmd: list[str], svc: LocalService, pm: PortMap) -> list[str]:
    """A compose healthcheck `test` (["CMD", "python", ...]) aimed at the service's local ports."""
    assert cmd and cmd[0] == "CMD", f"{svc.name}: healthcheck must be exec form (no shell in slim images)"
    argv = [sys.executable if a == "python" else a for a in cmd[1:]]
    return [LOCAL_ADDR_RE.sub(lambda m: f"127.0.0.1:{pm.local(svc.name, int(m[1]))}", a) for a in argv]


def run_health_cmd(argv: list[str], env: dict[str, str] | None = None) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT, env=env)
    assert r.returncode == 0, f"health check {argv} exited {r.returncode}:\n{r.stdout}{r.stderr}"


def post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


@contextmanager
def running(services: list[LocalService], pm: PortMap, paths: dict[str, str]) -> Iterator[dict[str, ServiceProcess]]:
    """Start `services` in the given order, each gated on readiness and its own health check."""
    procs: dict[str, ServiceProcess] = {}
    try:
        for svc in services:
            env = {**localize_env(svc.env, pm, paths), "PYTHONPATH": str(ROOT)}
            proc = ServiceProcess(svc.name, localize_argv(svc, pm, paths), env=env).start()
            procs[svc.name] = proc
            local = pm.local(svc.name, svc.serve_port)
            if svc.kind == "grpc":
                proc.wait_serving(f"127.0.0.1:{local}", START_TIMEOUT_S)
            else:
                proc.wait_ready_line(START_TIMEOUT_S)
            svc.health(pm)  # the deployment's own health check, once, must pass now
        yield procs
    finally:
        codes = {name: p.stop(timeout=60) for name, p in reversed(list(procs.items()))}
    # Reached only when the body succeeded: SIGTERM drains and exits 0 (docs/internals.md).
    assert all(c == 0 for c in codes.values()), f"exit codes after SIGTERM: {codes}"


def generate_through_gateway(port: int) -> dict:
    out = post_json(f"http://127.0.0.1:{port}/generate", {
        "text": "Hello, ringserve",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
    })
    assert isinstance(out.get("text"), str) and out["text"], f"no text in {out}"
    return out


def hf_home_dir(tmp_path: Path) -> str:
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    return str(d)


def env_for_interpolation(model_dir: str) -> dict[str, str]:
    """The shell environment compose would interpolate with: MODEL points at the local model dir."""
    keep = {k: v for k, v in os.environ.items() if k not in ("MODEL", "HF_TOKEN")}
    return {**keep, "MODEL": model_dir}
