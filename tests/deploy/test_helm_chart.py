"""The Helm chart, offline: lint, schema, render across a values matrix, assertions on the objects,
and every rendered manifest through `kubernetes-validate --strict`.

helm-python-sdk bundles libhelm_c (Helm v4's Go SDK behind a C ABI) in its wheel: no helm binary,
no download, no cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

# helm: helm-python-sdk, or the module is skipped; case: the values-matrix fixture (one rendered case per file)
from tests.deploy._helm import (  # noqa: F401
    CHART,
    GRPC_COMPONENTS,
    K8S_VERSIONS,
    MATRIX,
    NAMESPACE,
    RELEASE,
    ROOT,
    arg,
    by_kind,
    case,
    component,
    container,
    deployments,
    helm,
    objects,
    render,
    values_of,
)

PREPARED = "/prepared/model"  # where model-init writes the model and the services read it


def test_lint_strict_every_case() -> None:
    for name in MATRIX:
        for kube in K8S_VERSIONS:
            report = helm.lint(CHART, values_of(name), strict=True, namespace=NAMESPACE, kube_version=f"v{kube}")
            problems = [m for m in report["messages"] if m["severity"] >= 2]
            # severity 1 (info) "icon is recommended" is the only accepted remark
            assert not report["errors"] and not problems, f"{name} on {kube}: {report}"


def test_schema_accepts_matrix_and_rejects_mistakes() -> None:
    with helm.Chart.load(CHART) as chart:
        for name in MATRIX:
            chart.validate_schema(values_of(name))
        bad: dict[str, Any]
        for bad in ({"scheduler": {"device": "tpu"}},
                    {"scheduler": {"replicas": -1}},
                    {"scheduler": {"gpu": {"resourceKey": "nvidia.com/gpu", "count": 0}}},
                    {"gateway": {"service": {"type": "Ingress", "port": 80}}},
                    {"tokenizer": {"autoscaling": {"enabled": True, "minReplicas": 0}}},
                    {"modelVolume": {"name": "x", "hostPath": {"path": "/srv"}}},  # the chart names it
                    {"modelInit": {"image": "x"}},
                    {"schedulr": {}}):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)


def test_rendering_applies_the_schema() -> None:
    with pytest.raises(helm.HelmError):
        render({"scheduler": {"device": "tpu"}})


def test_every_manifest_passes_kubernetes_validate_strict(case, tmp_path: Path) -> None:
    name, _, objs = case
    files = []
    for i, obj in enumerate(objs):
        f = tmp_path / f"{i:02d}-{obj['kind']}.yaml"
        f.write_text(yaml.safe_dump(obj))
        files.append(str(f))
    cmd = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet"]
    for v in K8S_VERSIONS:
        cmd += ["-k", v]
    r = subprocess.run(cmd + files, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{name}:\n{r.stdout}{r.stderr}"
    # CRDs have no bundled schema: the only warnings allowed are for the ServiceMonitor.
    warned = [line for line in r.stdout.splitlines() if line.startswith("WARN")]
    assert all("ServiceMonitor" in line for line in warned), warned


def test_components_and_services(case) -> None:
    name, values, objs = case
    deps = deployments(objs)
    assert set(deps) == {"gateway", "tokenizer", "scheduler", "detokenizer"}
    services = by_kind(objs, "Service")
    prefix = f"{RELEASE}-ringserve"
    assert {f"{prefix}-gateway", f"{prefix}-tokenizer", f"{prefix}-tokenizer-headless",
            f"{prefix}-detokenizer", f"{prefix}-scheduler-headless"} == set(services)
    assert services[f"{prefix}-scheduler-headless"]["spec"]["clusterIP"] == "None"
    for svc in services.values():
        comp = component(svc)
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == comp
        ports = {p["name"]: p for p in container(deps[comp])["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"{svc['metadata']['name']}: {p} targets no named port"
            if p["name"] == "grpc":
                assert p.get("appProtocol") == "grpc"


def test_named_ports_and_probes_on_every_container(case) -> None:
    _, values, objs = case
    for comp, dep in deployments(objs).items():
        pod = dep["spec"]["template"]["spec"]
        for c in pod["containers"]:  # init containers (model-init) have neither ports nor probes
            names = {p["name"] for p in c["ports"]}
            assert names == ({"http"} if comp == "gateway" else {"grpc", "metrics"}), (comp, names)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, f"{comp}: no {probe}"
                p = c[probe]
                grpc_port = next((x["containerPort"] for x in c["ports"] if x["name"] == "grpc"), None)
                if comp == "gateway":
                    assert p["httpGet"]["port"] == "http"
                elif values.get("tls", {}).get("enabled"):  # the kubelet's grpc probe cannot speak TLS
                    assert p["exec"]["command"][:4] == ["python", "-m", "ringserve.probe", f"127.0.0.1:{grpc_port}"]
                else:  # native gRPC probe on the gRPC port (grpc.port must be a number)
                    assert p["grpc"]["port"] == grpc_port
            assert c["readinessProbe"].get("httpGet", {}).get("path", "/health") == "/health"
            assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        # the grace period covers the preStop sleep plus the service's own drain
        assert pod["terminationGracePeriodSeconds"] > int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    sched = container(deployments(objs)["scheduler"])
    budget = sched["startupProbe"]["periodSeconds"] * sched["startupProbe"]["failureThreshold"]
    assert budget >= 600, "the scheduler needs a long startup budget for model loads"


def test_gpu_request_on_scheduler_only(case) -> None:
    _, values, objs = case
    sched_values = {**{"device": "cuda", "gpu": {"resourceKey": "nvidia.com/gpu", "count": 1}},
                    **values.get("scheduler", {})}
    key = sched_values["gpu"]["resourceKey"]
    deps = deployments(objs)
    for comp, dep in deps.items():
        res = container(dep).get("resources", {})
        gpu_keys = [k for part in ("limits", "requests") for k in res.get(part, {}) if "gpu" in k]
        if comp == "scheduler" and sched_values["device"] == "cuda":
            assert res["limits"][key] == sched_values["gpu"]["count"]
            assert gpu_keys == [key]
        else:
            assert gpu_keys == [], f"{comp} must not request GPUs: {res}"
    sched = deps["scheduler"]
    c = container(sched)
    assert arg(c, "--device") == sched_values["device"]
    assert c["image"].endswith(f"/scheduler-{sched_values['device']}:0.1.0")
    pod = sched["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert pod.get("runtimeClassName") == (sched_values.get("runtimeClassName") or None)
    assert pod.get("nodeSelector") == (sched_values.get("nodeSelector") or None)
    assert pod.get("tolerations") == (sched_values.get("tolerations") or None)
    for flag, key_ in (("--max-total-tokens", "maxTotalTokens"), ("--mem-fraction", "memFraction"),
                       ("--max-running-requests", "maxRunningRequests"),
                       ("--chunked-prefill-size", "chunkedPrefillSize")):
        if sched_values.get(key_) is None:
            assert flag not in c["args"]
        else:
            assert float(arg(c, flag)) == float(sched_values[key_])


def test_scheduler_memory_follows_the_device() -> None:
    """device=cpu holds the KV pool, weights and decode caches in host memory: cpuResources (sized from
    the accounted bounds, docs/deployment.md "Memory"); device=cuda: resources."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["scheduler"]
    for device, key in (("cpu", "cpuResources"), ("cuda", "resources")):
        res = container(deployments(objects(render({"scheduler": {"device": device}})))["scheduler"])["resources"]
        assert res["requests"]["memory"] == defaults[key]["requests"]["memory"], device
        assert res["limits"]["memory"] == defaults[key]["limits"]["memory"], device
    assert defaults["cpuResources"]["requests"]["memory"] == "6Gi"


def test_ring_wiring(case) -> None:
    _, values, objs = case
    deps = deployments(objs)
    prefix = f"{RELEASE}-ringserve"
    tok = container(deps["tokenizer"])
    assert tok["command"] == ["python", "-m", "services.tokenizer"]
    assert arg(tok, "--scheduler") == f"dns:///{prefix}-scheduler-headless.{NAMESPACE}.svc.cluster.local:50052"
    assert arg(tok, "--detokenizer") == f"{prefix}-detokenizer:50053"
    assert arg(tok, "--routing-policy") == "round_robin"
    assert arg(container(deps["scheduler"]), "--detokenizer") == f"{prefix}-detokenizer:50053"
    assert arg(container(deps["gateway"]), "--tokenizer") == \
        f"dns:///{prefix}-tokenizer-headless.{NAMESPACE}.svc.cluster.local:50051"
    for comp in GRPC_COMPONENTS:
        c = container(deps[comp])
        assert c["command"] == ["python", "-m", f"services.{comp}"]
        assert arg(c, "--host") == "0.0.0.0"
        assert arg(c, "--model") == PREPARED  # what the pod's model-init wrote
    assert arg(tok, "--served-model-name") == served_name(values)
    assert deps["scheduler"]["spec"]["replicas"] == values.get("scheduler", {}).get("replicas", 1)
    assert deps["detokenizer"]["spec"]["replicas"] == 1


def test_security_context_everywhere(case) -> None:
    _, _, objs = case
    for comp, dep in deployments(objs).items():
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), f"{comp}: no writable /tmp"


def served_name(values: dict[str, Any]) -> str:
    model = values.get("model", "/models/default")
    return values.get("servedModelName") or ("SmolLM2-135M-Instruct" if model == "/models/default" else model)


def check_model_init(values: dict[str, Any], objs: list[dict[str, Any]]) -> None:
    """Every pod that loads the model prepares it first: an init container with the scheduler-cpu image
    runs model_source into the pod's `model` emptyDir, which the service mounts read-only at /prepared."""
    model = values.get("model", "/models/default")
    init_values = values.get("modelInit", {})
    host_volume = values.get("modelVolume") or {}
    for comp, dep in deployments(objs).items():
        pod = dep["spec"]["template"]["spec"]
        if comp == "gateway":  # loads no model
            assert "initContainers" not in pod
            continue
        (init,) = pod["initContainers"]
        assert init["name"] == "model-init"
        assert init["image"] == "ringserve/scheduler-cpu:0.1.0", "torch (a GGUF is dequantized here), on the CPU"
        assert init["command"] == ["python", "-m", "ringserve.model_source"]
        assert init["args"] == [model, "--out", PREPARED]
        assert "ports" not in init and not {"startupProbe", "readinessProbe", "livenessProbe"} & set(init)
        gpu = [k for part in ("limits", "requests") for k in init["resources"].get(part, {}) if "gpu" in k]
        assert not gpu, f"{comp}: model-init must not request GPUs"
        if "resources" in init_values:
            assert init["resources"] == init_values["resources"]
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_HOME"]["value"] == "/cache/hf" and "secretKeyRef" in env["HF_TOKEN"]["valueFrom"]
        assert env["HOME"]["value"] == "/tmp"
        mounts = {(m["name"], m["mountPath"]): m for m in init["volumeMounts"]}
        assert mounts[("model", "/prepared")] == {"name": "model", "mountPath": "/prepared"}  # writable
        assert mounts[("model", "/app/.cache")]["subPath"] == "conversion"  # where model_source converts
        assert ("model-cache", "/cache/hf") in mounts and ("tmp", "/tmp") in mounts
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"] == {"name": "model",
                                    "emptyDir": {"sizeLimit": init_values.get("sizeLimit", "20Gi")}}
        if host_volume:
            assert mounts[("host-models", "/models/host")]["readOnly"] is True
            assert volumes["host-models"] == {"name": "host-models", **host_volume}
        else:
            assert "host-models" not in volumes and not any(m[0] == "host-models" for m in mounts)
        c = container(dep)
        assert {"name": "model", "mountPath": "/prepared", "readOnly": True} in c["volumeMounts"], comp
        assert arg(c, "--model") == PREPARED


def test_model_init_in_every_model_loading_pod(case) -> None:
    _, values, objs = case
    check_model_init(values, objs)


@pytest.mark.parametrize("values", [
    {},  # the default model, prepared into the images
    {"model": "/models/host/SmolLM2-135M-Instruct.Q4_1.gguf", "modelVolume": {"hostPath": {"path": "/srv/gguf"}}},
    {"model": "Qwen/Qwen2.5-0.5B-Instruct", "servedModelName": "qwen"},
    {"model": "tiny", "modelInit": {"sizeLimit": "1Gi", "resources": {"requests": {"cpu": "1", "memory": "2Gi"},
                                                                      "limits": {"memory": "4Gi"}}}},
])
def test_model_init_renders_for_each_kind_of_model(values: dict[str, Any]) -> None:
    objs = [d for path, text in render(values).items() if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]
    check_model_init(values, objs)
    assert arg(container(deployments(objs)["tokenizer"]), "--served-model-name") == served_name(values)
    notes = render(values)["ringserve/templates/NOTES.txt"]
    assert f'served as "{served_name(values)}"' in notes


def test_model_cache_and_hf_token(case) -> None:
    _, values, objs = case
    persistence = values.get("modelCache", {}).get("persistence", {})
    hf = {"existingSecret": "", "key": "HF_TOKEN", "value": "", **values.get("hfToken", {})}
    pvcs = by_kind(objs, "PersistentVolumeClaim")
    secrets = by_kind(objs, "Secret")
    if persistence.get("enabled") and not persistence.get("existingClaim"):
        (pvc,) = pvcs.values()
        assert pvc["spec"]["resources"]["requests"]["storage"] == persistence["size"]
        assert pvc["spec"]["storageClassName"] == persistence["storageClass"]
        claim = pvc["metadata"]["name"]
    else:
        assert not pvcs
        claim = persistence.get("existingClaim") if persistence.get("enabled") else None
    secret_name = hf["existingSecret"] or f"{RELEASE}-ringserve-hf-token"
    if hf["value"] and not hf["existingSecret"]:
        assert secrets[secret_name]["stringData"][hf["key"]] == hf["value"]
    else:
        assert not secrets
    for comp in GRPC_COMPONENTS:
        dep = deployments(objs)[comp]
        c = container(dep)
        vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache")
        if claim:
            assert vol["persistentVolumeClaim"]["claimName"] == claim
        else:
            assert "emptyDir" in vol
        env = {e["name"]: e for e in c["env"]}
        assert env["HF_HOME"]["value"] == "/cache/hf"
        assert {"name": "model-cache", "mountPath": "/cache/hf"} in c["volumeMounts"]
        ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"], ref["optional"]) == (secret_name, hf["key"], True)


def test_autoscaling_and_disruption_budgets(case) -> None:
    _, values, objs = case
    hpas = {component(h): h for h in by_kind(objs, "HorizontalPodAutoscaler").values()}
    deps = deployments(objs)
    for comp in ("gateway", "tokenizer"):
        auto = values.get(comp, {}).get("autoscaling", {})
        if auto.get("enabled"):
            h = hpas[comp]["spec"]
            assert h["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                           "name": deps[comp]["metadata"]["name"]}
            assert (h["minReplicas"], h["maxReplicas"]) == (auto["minReplicas"], auto["maxReplicas"])
            assert "replicas" not in deps[comp]["spec"], "the HPA owns replicas"
        else:
            assert comp not in hpas
    assert set(hpas) <= {"gateway", "tokenizer"}
    pdbs = {component(p): p for p in by_kind(objs, "PodDisruptionBudget").values()}
    assert set(pdbs) == {"gateway", "tokenizer", "scheduler"}
    for comp, pdb in pdbs.items():
        assert pdb["spec"]["selector"]["matchLabels"] == deps[comp]["spec"]["selector"]["matchLabels"]


def test_monitoring_objects(case) -> None:
    _, values, objs = case
    sm_on = values.get("metrics", {}).get("serviceMonitor", {}).get("enabled", False)
    sms = [o for o in objs if o["kind"] == "ServiceMonitor"]
    if not sm_on:
        assert not sms
    else:
        (sm,) = sms
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert {e["port"] for e in sm["spec"]["endpoints"]} == {"metrics", "http"}
        selected = [s for s in by_kind(objs, "Service").values()
                    if all(s["metadata"]["labels"].get(k) == v
                           for k, v in sm["spec"]["selector"]["matchLabels"].items())]
        assert sorted(component(s) for s in selected) == ["detokenizer", "gateway", "scheduler", "tokenizer"]
        for k, v in values["metrics"]["serviceMonitor"].get("labels", {}).items():
            assert sm["metadata"]["labels"][k] == v
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = (ROOT / "monitoring" / "grafana" / "dashboards" / "ringserve.json").read_text()
    assert json.loads(cm["data"]["ringserve.json"]) == json.loads(dashboard)


def test_chart_dashboard_copy_is_identical() -> None:
    """Helm can only read files inside the chart: k8s/ringserve/dashboards/ is a copy of monitoring/."""
    src = ROOT / "monitoring" / "grafana" / "dashboards" / "ringserve.json"
    assert (CHART / "dashboards" / "ringserve.json").read_bytes() == src.read_bytes(), \
        "run: cp monitoring/grafana/dashboards/ringserve.json k8s/ringserve/dashboards/"


def test_notes_render() -> None:
    notes = render({})["ringserve/templates/NOTES.txt"]
    assert "port-forward svc/rs-ringserve-gateway" in notes
