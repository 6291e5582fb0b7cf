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
MODEL_READERS = ("detokenizer", "scheduler", "tokenizer")
PREPARED = "/prepared/model"


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
            assert env["RINGSERVE_MODEL"] == PREPARED
            assert env["HF_TOKEN"] == "${HF_TOKEN:-}"
            assert env["HF_HOME"] == "/cache/hf"
            assert "model-cache:/cache/hf" in svc["volumes"]
            assert "prepared-model:/prepared:ro" in svc["volumes"]
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
    for name, deps in {"detokenizer": set(), "scheduler": {"detokenizer"},
                       "tokenizer": {"detokenizer", "scheduler"}, "gateway": {"tokenizer"}}.items():
        got = dict(services[name].get("depends_on") or {})
        if name in MODEL_READERS:
            assert got.pop("model-init") == {"condition": "service_completed_successfully"}, name
        assert set(got) == deps
        assert all(d["condition"] == "service_healthy" for d in got.values())
    ring = {k: v for k, v in services.items() if k in compose.RING}
    assert compose.start_order(ring) == list(compose.RING)
    assert compose.start_order({k: services[k] for k in ("model-init", *compose.RING)}) == \
        ["model-init", *compose.RING]


def test_model_init_prepares_the_model_before_any_service() -> None:
    """The one-shot model-init runs the scheduler image's model_source into the prepared-model volume; every
    model-loading service waits for it to complete and reads what it wrote, read-only."""
    for files in ((compose.COMPOSE,), (compose.COMPOSE, compose.COMPOSE_CPU)):
        services = compose.model(files)["services"]
        init = services["model-init"]
        assert init["restart"] == "no"
        # the scheduler's image (torch: it dequantizes a GGUF), on the CPU: no GPU reservation, no ports
        assert (init["image"], init["build"]) == (services["scheduler"]["image"], services["scheduler"]["build"])
        assert "deploy" not in init and "ports" not in init and "healthcheck" not in init
        assert compose.environment(init)["MODEL"] == "${MODEL:-/models/default}"
        assert {compose.volume_target(v): v for v in init["volumes"]} == {
            "/cache/hf": "model-cache:/cache/hf",  # hub downloads
            "/prepared": "prepared-model:/prepared",  # written here, read-only in the services
            "/models/host": "${MODELS_DIR:-host-models}:/models/host:ro",  # local checkpoints from the host
        }
        for name in MODEL_READERS:
            svc = services[name]
            assert svc["depends_on"]["model-init"]["condition"] == "service_completed_successfully", name
            assert compose.environment(svc)["RINGSERVE_MODEL"] == PREPARED, name
            assert "prepared-model:/prepared:ro" in svc["volumes"], name
            assert svc["labels"]["io.ringserve.model"] == "${MODEL:-/models/default}", name  # new MODEL: recreated
    doc = compose.model(env={"MODEL": "/models/host/x.gguf"})
    assert {"prepared-model", "host-models"} <= set(doc["volumes"])
    cmd = doc["services"]["model-init"]["command"]
    assert cmd[:2] == ["sh", "-c"] and len(cmd) == 3
    # the previous model is removed whole, then model_source prepares $MODEL (quoted: the container's env)
    steps = [step.strip() for step in cmd[2].split("&&")]
    assert steps == ["rm -rf /prepared/model",
                     'exec python -m ringserve.model_source "$MODEL" --out /prepared/model']
    assert compose.environment(doc["services"]["model-init"])["MODEL"] == "/models/host/x.gguf"


def test_models_dir_mounts_a_host_directory() -> None:
    init = compose.model(env={"MODELS_DIR": "/srv/gguf"})["services"]["model-init"]
    assert "/srv/gguf:/models/host:ro" in init["volumes"]
    init = compose.model(env={})["services"]["model-init"]
    assert "host-models:/models/host:ro" in init["volumes"]  # unset: an empty named volume


def test_gpu_reservation_and_cpu_override() -> None:
    services = compose.model()["services"]
    (dev,) = services["scheduler"]["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
    assert services["scheduler"]["build"]["target"] == "scheduler-cuda"
    assert compose.environment(services["scheduler"])["RINGSERVE_DEVICE"] == "cuda"
    for name in ("model-init", "gateway", "tokenizer", "detokenizer", "prometheus", "grafana"):
        assert "deploy" not in services[name], f"{name} must not reserve a GPU"
    cpu = compose.model((compose.COMPOSE, compose.COMPOSE_CPU))["services"]["scheduler"]
    assert "deploy" not in cpu
    assert cpu["build"] == {**services["scheduler"]["build"], "target": "scheduler-cpu"}
    assert compose.environment(cpu)["RINGSERVE_DEVICE"] == "cpu"
    assert cpu["command"] == services["scheduler"]["command"]
    # On CPU the KV pool, weights and decode caches are host memory: sized from the default model's
    # accounted bounds plus its runtime (docs/deployment.md, "Memory").
    assert (cpu["mem_reservation"], cpu["mem_limit"]) == ("6g", "7g")


def test_interpolation_passes_model_and_token_through() -> None:
    env = {"MODEL": "Qwen/Qwen2.5-0.5B-Instruct", "HF_TOKEN": "hf_x"}
    services = compose.model(env=env)["services"]
    assert compose.environment(services["model-init"])["MODEL"] == "Qwen/Qwen2.5-0.5B-Instruct"
    for name in ("model-init", *MODEL_READERS):
        assert compose.environment(services[name])["HF_TOKEN"] == "hf_x"
    for name in MODEL_READERS:
        assert compose.environment(services[name])["RINGSERVE_MODEL"] == PREPARED
        assert services[name]["labels"]["io.ringserve.model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    # served as MODEL says, SmolLM2-135M-Instruct for the default, or SERVED_MODEL_NAME
    assert compose.environment(services["tokenizer"])["RINGSERVE_SERVED_MODEL_NAME"] == "Qwen/Qwen2.5-0.5B-Instruct"
    defaults = compose.model(env={})["services"]
    assert compose.environment(defaults["model-init"])["MODEL"] == "/models/default"
    assert compose.environment(defaults["scheduler"])["RINGSERVE_MODEL"] == PREPARED
    assert compose.environment(defaults["tokenizer"])["RINGSERVE_SERVED_MODEL_NAME"] == "SmolLM2-135M-Instruct"
    named = compose.model(env={"MODEL": "/models/host/x.gguf", "SERVED_MODEL_NAME": "x"})["services"]
    assert compose.environment(named["tokenizer"])["RINGSERVE_SERVED_MODEL_NAME"] == "x"


def test_monitoring_profile() -> None:
    doc = compose.model()
    services = doc["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        image = services[name]["image"]
        assert ":" in image and not image.endswith(":latest"), image
    assert "./monitoring/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    assert "./monitoring/grafana/provisioning:/etc/grafana/provisioning:ro" in services["grafana"]["volumes"]
    assert {"model-cache", "prepared-model", "prometheus-data", "grafana-data"} <= set(doc["volumes"])
