"""The compose commands are real: run each ring service's `command` and `environment` from
docker-compose.yml (+ the CPU override, + the TLS override) as a local process, in depends_on order,
each gated on readiness and on its own compose healthcheck; then generate through the gateway."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.deploy import _compose as compose
from tests.deploy._ring import (
    LocalService,
    PortMap,
    env_for_interpolation,
    generate_through_gateway,
    hf_home_dir,
    localize_health_cmd,
    run_health_cmd,
    running,
    skip_unless_services_exist,
    with_tls_dir,
)


def local_services(model_dir: str, tls_dir: Path | None = None) -> tuple[list[LocalService], PortMap]:
    """tls_dir: with the TLS override, where its mounted files are here."""
    files = (compose.COMPOSE, compose.COMPOSE_CPU) + ((compose.COMPOSE_TLS,) if tls_dir else ())
    doc = compose.model(files, env=env_for_interpolation(model_dir))
    services = doc["services"]
    order = [name for name in compose.start_order(services) if name in compose.RING]
    assert order == list(compose.RING)
    pm = PortMap()
    out = []
    for name in order:
        svc = services[name]
        cmd = [str(a) for a in svc["command"]]
        ports = [int(cmd[cmd.index(f) + 1]) for f in ("--port", "--metrics-port") if f in cmd]
        pm.add_service(name, ports)

        env = with_tls_dir(compose.environment(svc), tls_dir)

        def health(pm: PortMap, test=svc["healthcheck"]["test"], name=name, env=env) -> None:
            run_health_cmd(localize_health_cmd(test, out_by_name[name], pm), env={**os.environ, **env})

        out.append(LocalService(name=name, argv=cmd, env=env, ports=ports,
                                kind="http" if name == "gateway" else "grpc", serve_port=ports[0],
                                health=health))
    out_by_name = {s.name: s for s in out}
    return out, pm


def test_compose_translation_maps_every_host_and_port(model_dir: str, tmp_path: Path) -> None:
    """Offline part: every hostname/port the commands use belongs to a compose service."""
    from tests.deploy._ring import localize_argv, localize_env

    services, pm = local_services(model_dir)
    for svc in services:
        argv = localize_argv(svc, pm, model_dir, hf_home_dir(tmp_path))
        assert "0.0.0.0" not in argv and not any(a.endswith(":50052") for a in argv)
        env = localize_env(svc.env, pm, model_dir, hf_home_dir(tmp_path))
        if svc.name != "gateway":
            assert env["RINGSERVE_MODEL"] == model_dir
            assert env["HF_HOME"] == hf_home_dir(tmp_path)
    scheduler = next(s for s in services if s.name == "scheduler")
    assert scheduler.env["RINGSERVE_DEVICE"] == "cpu"


@pytest.mark.e2e
@pytest.mark.slow
def test_compose_commands_serve_a_request(model_dir: str, tmp_path: Path) -> None:
    skip_unless_services_exist()
    services, pm = local_services(model_dir)
    with running(services, pm, model_dir, hf_home_dir(tmp_path)):
        generate_through_gateway(pm.local("gateway", 30000))


@pytest.mark.e2e
@pytest.mark.slow
def test_compose_commands_serve_with_mutual_tls(model_dir: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_services_exist()
    from tests.security.certs import tls_files

    certs = tls_files(tmp_path / "certs")
    services, pm = local_services(model_dir, certs)
    assert all(s.env["RINGSERVE_TLS_CERT"] == str(certs / "server.crt") for s in services)
    for var, file in (("CA", "ca.crt"), ("CLIENT_CERT", "client.crt"), ("CLIENT_KEY", "client.key")):
        monkeypatch.setenv(f"RINGSERVE_TLS_{var}", str(certs / file))  # this test's readiness waits
    with running(services, pm, model_dir, hf_home_dir(tmp_path)):
        generate_through_gateway(pm.local("gateway", 30000))
