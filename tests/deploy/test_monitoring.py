"""monitoring/: Prometheus scrapes every service's metrics port; the Grafana dashboard shows the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.deploy import _compose as compose

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "monitoring"
DASHBOARD = MON / "grafana" / "dashboards" / "ringserve.json"
METRICS = (
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
    "sglang:gen_throughput", "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
    "sglang:e2e_request_latency_seconds", "sglang:generation_tokens_total",
)


def metrics_port(command: list[str]) -> int:
    flag = "--metrics-port" if "--metrics-port" in command else "--port"  # gateway: /metrics on its HTTP port
    return int(command[command.index(flag) + 1])


def test_prometheus_scrapes_every_service_metrics_port() -> None:
    prom = yaml.safe_load((MON / "prometheus.yml").read_text())
    scraped = set()
    for job in prom["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            scraped |= {(name, sd["port"]) for name in sd["names"]}
        for sc in job.get("static_configs", []):
            scraped |= {(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1])) for t in sc["targets"]}
    services = compose.model()["services"]
    for name in compose.RING:
        assert (name, metrics_port(services[name]["command"])) in scraped, f"{name} is not scraped"


def test_dashboard_panels_cover_the_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for metric in METRICS:
        assert metric in exprs, f"no panel uses {metric}"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for word in ("running", "queued", "token usage", "cache hit", "ttft", "inter-token", "throughput"):
        assert word in titles, word
    # one datasource variable: works with the compose provisioning and with a Grafana sidecar
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_grafana_provisioning_matches_compose_mounts() -> None:
    ds = yaml.safe_load((MON / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((MON / "grafana/provisioning/dashboards/ringserve.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    grafana = compose.model()["services"]["grafana"]
    assert f"./monitoring/grafana/dashboards:{path}:ro" in grafana["volumes"]
