"""yamllint (config: .yamllint) on the compose files, the chart's values and metadata, monitoring and the
test values matrix. Helm templates are Go templates and are checked by rendering (test_helm_chart.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = [
    "docker-compose.yml",
    "docker-compose.cpu.yml",
    "k8s/ringserve/Chart.yaml",
    "k8s/ringserve/values.yaml",
    "monitoring/prometheus.yml",
    "monitoring/grafana/provisioning/datasources/prometheus.yml",
    "monitoring/grafana/provisioning/dashboards/ringserve.yml",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/deploy/values").glob("*.yaml")),
]


def test_yamllint() -> None:
    pytest.importorskip("yamllint", reason="pip install yamllint (requirements-dev.txt)")
    r = subprocess.run([sys.executable, "-m", "yamllint", "--strict", "-c", str(ROOT / ".yamllint"), *FILES],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
