"""The compose commands are real: run model-init's command (the model preparation) and then each ring
service's `command` and `environment` from docker-compose.yml (+ the CPU override, + the TLS override) as
a local process, in depends_on order, each gated on readiness and on its own compose healthcheck; then
generate through the gateway."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.deploy import _compose as compose
from tests.deploy._ring import (
    LocalService,
    OneShot,
    PortMap,
    env_for_interpolation,
    generate_through_gateway,
    local_paths,
    localize_health_cmd,
    prepare_model,
    run_health_cmd,
    running,
    skip_unless_services_exist,
    with_tls_dir,
)


def local_services(model_dir: str, tls_dir: Path | None = None) -> tuple[OneShot, list[LocalService], PortMap]:
    """model-init (MODEL is the local model), then the ring. tls_dir: with the TLS override, where its
    mounted files are here."""
    files = (compose.COMPOSE, compose.COMPOSE_CPU) + ((compose.COMPOSE_TLS,) if tls_dir else ())
    doc = compose.model(files, env=env_for_interpolation(model_dir))
    services = doc["services"]
    order = [name for name in compose.start_order(services) if name in ("model-init", *compose.RING)]
    assert order == ["model-init", *compose.RING]
    init = services["model-init"]
    model_init = OneShot("model-init", [str(a) for a in init["command"]], compose.environment(init))
    pm = PortMap()
    out = []
    for name in order[1:]:
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
    return model_init, out, pm


def test_compose_translation_maps_every_host_and_port(model_dir: str, tmp_path: Path) -> None:
    """Offline part: every hostname/port the commands use belongs to a compose service; the model
    is what model-init writes."""
    from tests.deploy._ring import localize_argv, localize_env, localize_oneshot

    model_init, services, pm = local_services(model_dir)
    paths = local_paths(model_dir, tmp_path)
    prepared = paths["/prepared"] + "/model"
    assert model_init.env["MODEL"] == model_dir
    script = localize_oneshot(model_init, paths)[2]
    assert f"rm -rf {prepared} &&" in script and f"--out {prepared}" in script
    for svc in services:
        argv = localize_argv(svc, pm, paths)
        assert "0.0.0.0" not in argv and not any(a.endswith(":50052") for a in argv)
        env = localize_env(svc.env, pm, paths)
        if svc.name != "gateway":
            assert env["RINGSERVE_MODEL"] == prepared
            assert env["HF_HOME"] == paths["/cache/hf"]
    scheduler = next(s for s in services if s.name == "scheduler")
    assert scheduler.env["RINGSERVE_DEVICE"] == "cpu"


def test_model_init_command_prepares_the_model(model_dir: str, tmp_path: Path) -> None:
    """model-init's own command (its shell script, MODEL from its environment), run here: it replaces
    whatever /prepared/model held with a copy of MODEL."""
    model_init, _, pm = local_services(model_dir)
    paths = local_paths(model_dir, tmp_path)
    stale = Path(paths["/prepared"]) / "model"
    stale.mkdir()
    (stale / "chat_template.jinja").write_text("another model's template")
    out = prepare_model(model_init, pm, paths)
    assert out == stale and not (out / "chat_template.jinja").exists()
    assert (out / "config.json").read_bytes() == (Path(model_dir) / "config.json").read_bytes()


@pytest.mark.slow
def test_model_init_command_prepares_a_gguf(tmp_path: Path) -> None:
    """MODEL=<a .gguf>: model-init's command leaves a float32 model directory that the torch-free
    services accept as it is (the conversion is cached under .cache/models, as `make model` leaves it)."""
    from ringserve.model_source import CONVERTED_MARK, DOWNLOADS_DIR, SMOLLM2_WHEEL, resolve_model

    gguf = DOWNLOADS_DIR / Path(SMOLLM2_WHEEL[2]).name
    if not gguf.exists():
        pytest.skip("the default model's GGUF is not downloaded: run `make model`")
    model_init, _, pm = local_services(str(gguf))
    assert model_init.env["MODEL"] == str(gguf)
    out = prepare_model(model_init, pm, local_paths(str(gguf), tmp_path))
    assert (out / "model.safetensors").exists() and (out / CONVERTED_MARK).exists()
    assert resolve_model(str(out), prepare=False) == out  # what the detokenizer and tokenizer do on start


@pytest.mark.e2e
@pytest.mark.slow
def test_compose_commands_serve_a_request(model_dir: str, tmp_path: Path) -> None:
    skip_unless_services_exist()
    model_init, services, pm = local_services(model_dir)
    paths = local_paths(model_dir, tmp_path)
    prepare_model(model_init, pm, paths)
    with running(services, pm, paths):
        generate_through_gateway(pm.local("gateway", 30000))


@pytest.mark.e2e
@pytest.mark.slow
def test_compose_commands_serve_with_mutual_tls(model_dir: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_services_exist()
    from tests.security.certs import tls_files

    certs = tls_files(tmp_path / "certs")
    model_init, services, pm = local_services(model_dir, certs)
    assert all(s.env["RINGSERVE_TLS_CERT"] == str(certs / "server.crt") for s in services)
    for var, file in (("CA", "ca.crt"), ("CLIENT_CERT", "client.crt"), ("CLIENT_KEY", "client.key")):
        monkeypatch.setenv(f"RINGSERVE_TLS_{var}", str(certs / file))  # this test's readiness waits
    paths = local_paths(model_dir, tmp_path)
    prepare_model(model_init, pm, paths)
    with running(services, pm, paths):
        generate_through_gateway(pm.local("gateway", 30000))
