"""The Helm containers' commands are real: render the chart (CPU mode), run the model-init init
container's command + args + env (the same in every pod that loads the model: once here), then each
Deployment's container command + args + env as a local process (Services -> 127.0.0.1, container ports
-> free ports), gate each on readiness and on its own startup/readiness/liveness probes; then generate.
With tls.enabled the Secret's mount path points at a throwaway CA's files and the probes are the
chart's exec probes."""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.deploy._ring import (
    LocalService,
    OneShot,
    PortMap,
    generate_through_gateway,
    local_paths,
    prepare_model,
    run_health_cmd,
    running,
    skip_unless_services_exist,
    with_tls_dir,
)

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (requirements-dev.txt)")

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("detokenizer", "scheduler", "tokenizer", "gateway")  # readiness order (docs/deployment.md)
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
CPU = {"scheduler": {"device": "cpu"}}
def rendered_objects(values: dict) -> list[dict]:
    with helm.Chart.load(ROOT / "k8s" / "ringserve") as chart:
        out = chart.render(values=values, name="rs", namespace="llm")
    return [d for path, text in out.items() if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]


def run_probe(probe: dict, container: dict, name: str, pm: PortMap, env: dict[str, str]) -> None:
    """What the kubelet does, against the local ports: gRPC health via the project's probe (the
    kubelet's own, or the chart's exec probe with the container's env), or GET."""
    if "grpc" in probe:
        local = pm.local(name, probe["grpc"]["port"])
        run_health_cmd([sys.executable, "-m", "ringserve.probe", f"127.0.0.1:{local}"])
    elif "exec" in probe:
        cmd = probe["exec"]["command"]
        assert cmd[:3] == ["python", "-m", "ringserve.probe"], cmd
        host, port = cmd[3].split(":")
        assert host == "127.0.0.1", cmd
        run_health_cmd([sys.executable, *cmd[1:3], f"127.0.0.1:{pm.local(name, int(port))}", *cmd[4:]],
                       env={**os.environ, **env})
    else:
        get = probe["httpGet"]
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
        url = f"http://127.0.0.1:{pm.local(name, port)}{get['path']}"
        with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1) + 2) as resp:
            assert 200 <= resp.status < 400, f"{name} {url}: {resp.status}"


def model_init(deps: dict[str, dict]) -> OneShot:
    """The init container that prepares the model: the same in every pod that has one."""
    inits = {name: d["spec"]["template"]["spec"].get("initContainers", []) for name, d in deps.items()}
    assert inits.pop("gateway") == []
    (first,) = inits["scheduler"]
    assert all(i == [first] for i in inits.values()), inits
    env = {e["name"]: e["value"] for e in first.get("env", []) if "value" in e}  # secretKeyRef: not here
    return OneShot(first["name"], first["command"] + [str(a) for a in first["args"]], env)


def local_services(values: dict = CPU,
                   tls_dir: Path | None = None) -> tuple[OneShot, list[LocalService], PortMap]:
    """tls_dir: where the TLS Secret's files are here (its mount path in the env is mapped to it)."""
    objs = rendered_objects(values)
    deps = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in objs if d["kind"] == "Deployment"}
    assert set(deps) == set(ORDER)
    pm = PortMap()
    containers = {}
    for name in ORDER:
        (c,) = deps[name]["spec"]["template"]["spec"]["containers"]
        containers[name] = c
        pm.add_service(name, [p["containerPort"] for p in c["ports"]])
    for svc in (o for o in objs if o["kind"] == "Service"):
        comp = svc["metadata"]["labels"]["app.kubernetes.io/component"]
        ports = {p["name"]: p["containerPort"] for p in containers[comp]["ports"]}
        for p in svc["spec"]["ports"]:
            # service port == container port, so a host:port in an arg maps straight to a local port
            assert ports[p["targetPort"]] == p["port"], svc["metadata"]["name"]
        pm.add_service(comp, [], aliases=(svc["metadata"]["name"],))
    out = []
    for name in ORDER:
        c = containers[name]
        env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}  # secretKeyRef: not here
        env = with_tls_dir(env, tls_dir)
        serve = next(p["containerPort"] for p in c["ports"] if p["name"] in ("grpc", "http"))

        def health(pm: PortMap, c=c, name=name, env=env) -> None:
            for probe in PROBES:
                run_probe(c[probe], c, name, pm, env)

        out.append(LocalService(name=name, argv=c["command"] + [str(a) for a in c["args"]], env=env,
                                ports=[p["containerPort"] for p in c["ports"]],
                                kind="http" if name == "gateway" else "grpc", serve_port=serve, health=health))
    return model_init(deps), out, pm


def test_helm_translation_maps_every_host_and_port(model_dir: str, tmp_path: Path) -> None:
    from tests.deploy._ring import localize_argv, localize_oneshot

    init, services, pm = local_services()
    paths = local_paths(model_dir, tmp_path)
    prepared = paths["/prepared"] + "/model"
    assert localize_oneshot(init, paths)[1:] == ["-m", "ringserve.model_source", model_dir, "--out", prepared]
    for svc in services:
        argv = localize_argv(svc, pm, paths)
        assert not any("svc.cluster.local" in a or a.startswith("rs-ringserve") for a in argv), argv
        if svc.name != "gateway":
            assert argv[argv.index("--model") + 1] == prepared


@pytest.mark.e2e
@pytest.mark.slow
def test_helm_commands_serve_a_request(model_dir: str, tmp_path: Path) -> None:
    skip_unless_services_exist()
    init, services, pm = local_services()
    paths = local_paths(model_dir, tmp_path)
    prepare_model(init, pm, paths)
    with running(services, pm, paths):
        generate_through_gateway(pm.local("gateway", 30000))


@pytest.mark.e2e
@pytest.mark.slow
def test_helm_commands_serve_with_mutual_tls(model_dir: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_services_exist()
    from tests.security.certs import tls_files

    secret = tls_files(tmp_path / "secret")  # the Secret's keys, as the chart mounts them
    values = {**CPU, "tls": {"enabled": True, "secretName": "rs-tls", "serverName": "localhost"}}
    init, services, pm = local_services(values, secret)
    assert all(svc.env["RINGSERVE_TLS_CA"] == str(secret / "ca.crt") for svc in services)
    for var, file in (("CA", "ca.crt"), ("CLIENT_CERT", "client.crt"), ("CLIENT_KEY", "client.key")):
        monkeypatch.setenv(f"RINGSERVE_TLS_{var}", str(secret / file))  # this test's readiness waits
    monkeypatch.setenv("RINGSERVE_TLS_SERVER_NAME", "localhost")
    paths = local_paths(model_dir, tmp_path)
    prepare_model(init, pm, paths)
    with running(services, pm, paths):
        generate_through_gateway(pm.local("gateway", 30000))
