"""docker-compose.yml (+ docker-compose.cpu.yml): compose-spec validation and the deployment contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy import _compose as compose

CHECK_JSONSCHEMA = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
MODULES = {"detokenizer": "services.detokenizer", "scheduler": "services.scheduler",
           "tokenizer": "services.tokenizer", "gateway": "gateway"}
PORTS = {"detokenizer": (50053, 9093), "scheduler": (50052, 9092), "tokenizer": (50051, 9091),
         "gateway": (30000, 30000)}


def check_jsonschema(path: Path) -> None:
    if not Path(CHECK_JSONSCHEMA).exists():
        pytest.skip("pip install check-jsonschema (requirements-dev.txt)")
    r = subprocess.run([CHECK_JSONSCHEMA, "--builtin-schema", "vendor.compose-spec", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_compose_file_matches_the_compose_spec() -> None:
    check_jsonschema(compose.COMPOSE)


def test_cpu_override_merged_matches_the_compose_spec(tmp_path: Path) -> None:
    # The override uses `!reset`, which only compose understands: validate the merged model.
    merged = compose.model((compose.COMPOSE, compose.COMPOSE_CPU))
    out = tmp_path / "merged.yml"
    out.write_text(yaml.safe_dump(merged, sort_keys=False))
    check_jsonschema(out)


def test_tls_override_merged_matches_the_compose_spec(tmp_path: Path) -> None:
    merged = compose.model((compose.COMPOSE, compose.COMPOSE_CPU, compose.COMPOSE_TLS))
    out = tmp_path / "merged.yml"
    out.write_text(yaml.safe_dump({k: v for k, v in merged.items() if not k.startswith("x-")}, sort_keys=False))
    check_jsonschema(out)
    for name in MODULES:
        svc = merged["services"][name]
        env = compose.environment(svc)
        assert env["RINGSERVE_TLS_CA"] == "/etc/ringserve/tls/ca.crt" and "RINGSERVE_LOG_LEVEL" in env, name
        targets = [compose.volume_target(v) for v in svc["volumes"]]
        assert "/etc/ringserve/tls" in targets, name
        if name != "gateway":  # the base file's model cache is kept
            assert "/cache/hf" in targets, name


def test_ring_commands_ports_and_env() -> None:
    services = compose.model()["services"]
    for name, module in MODULES.items():
        svc = services[name]
        cmd = svc["command"]
        assert cmd[:3] == ["python", "-m", module], cmd
        assert flag(cmd, "--host") == "0.0.0.0"
        grpc_port, metrics_port = PORTS[name]
        assert int(flag(cmd, "--port")) == grpc_port
        if name != "gateway":
            assert int(flag(cmd, "--metrics-port")) == metrics_port
            env = compose.environment(svc)
            assert env["RINGSERVE_MODEL"] == "${MODEL:-/models/default}"
            assert env["HF_TOKEN"] == "${HF_TOKEN:-}"
            assert env["HF_HOME"] == "/cache/hf"
            assert "model-cache:/cache/hf" in svc["volumes"]
        assert svc["restart"] == "unless-stopped"
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        assert "profiles" not in svc
    assert flag(services["scheduler"]["command"], "--detokenizer") == "detokenizer:50053"
    tok = services["tokenizer"]["command"]
    assert flag(tok, "--scheduler") == "scheduler:50052"
    assert flag(tok, "--detokenizer") == "detokenizer:50053"
    assert flag(tok, "--routing-policy") == "round_robin"
    assert flag(services["gateway"]["command"], "--tokenizer") == "tokenizer:50051"
    assert "${GATEWAY_PORT:-30000}:30000" in services["gateway"]["ports"]


def test_healthchecks_and_start_order() -> None:
    services = compose.model()["services"]
    for name in compose.RING:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", "exec form: slim images have no curl, the probe is python"
        if name == "gateway":
            assert test[1:3] == ["python", "-c"] and "http://127.0.0.1:30000/health" in test[3]
        else:
            assert test[1:] == ["python", "-m", "ringserve.probe", f"127.0.0.1:{PORTS[name][0]}"]
    assert services["scheduler"]["healthcheck"]["start_period"] in ("1800s", "30m")
    for name, deps in {"scheduler": {"detokenizer"}, "tokenizer": {"detokenizer", "scheduler"},
                       "gateway": {"tokenizer"}}.items():
        got = services[name]["depends_on"]
        assert set(got) == deps
        assert all(d["condition"] == "service_healthy" for d in got.values())
    ring = {k: v for k, v in services.items() if k in compose.RING}
    assert compose.start_order(ring) == list(compose.RING)


def test_gpu_reservation_and_cpu_override() -> None:
    services = compose.model()["services"]
    (dev,) = services["scheduler"]["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
    assert services["scheduler"]["build"]["target"] == "scheduler-cuda"
    assert compose.environment(services["scheduler"])["RINGSERVE_DEVICE"] == "cuda"
    for name in ("gateway", "tokenizer", "detokenizer", "prometheus", "grafana"):
        assert "deploy" not in services[name], f"{name} must not reserve a GPU"
    cpu = compose.model((compose.COMPOSE, compose.COMPOSE_CPU))["services"]["scheduler"]
    assert "deploy" not in cpu
    assert cpu["build"] == {**services["scheduler"]["build"], "target": "scheduler-cpu"}
    assert compose.environment(cpu)["RINGSERVE_DEVICE"] == "cpu"
    assert cpu["command"] == services["scheduler"]["command"]


def test_interpolation_passes_model_and_token_through() -> None:
    env = {"MODEL": "Qwen/Qwen2.5-0.5B-Instruct", "HF_TOKEN": "hf_x"}
    services = compose.model(env=env)["services"]
    for name in ("detokenizer", "scheduler", "tokenizer"):
        e = compose.environment(services[name])
        assert (e["RINGSERVE_MODEL"], e["HF_TOKEN"]) == ("Qwen/Qwen2.5-0.5B-Instruct", "hf_x")
    defaults = compose.model(env={})["services"]
    assert compose.environment(defaults["scheduler"])["RINGSERVE_MODEL"] == "/models/default"


def test_monitoring_profile() -> None:
    doc = compose.model()
    services = doc["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        image = services[name]["image"]
        assert ":" in image and not image.endswith(":latest"), image
    assert "./monitoring/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    assert "./monitoring/grafana/provisioning:/etc/grafana/provisioning:ro" in services["grafana"]["volumes"]
    assert {"model-cache", "prometheus-data", "grafana-data"} <= set(doc["volumes"])
