"""The chart's objects and values, shared by the Helm tests: render, pick objects, the values matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (requirements-dev.txt)")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "ringserve"
VALUES_DIR = Path(__file__).parent / "values"
MATRIX = sorted(p.stem for p in VALUES_DIR.glob("*.yaml"))
RELEASE, NAMESPACE = "rs", "llm"
K8S_VERSIONS = ("1.30.0", "1.37.0")  # the chart's kubeVersion floor and the newest schemas shipped
GRPC_COMPONENTS = ("detokenizer", "scheduler", "tokenizer")


def values_of(case: str) -> dict[str, Any]:
    return yaml.safe_load((VALUES_DIR / f"{case}.yaml").read_text()) or {}


def render(values: dict[str, Any]) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    docs = []
    for path, text in rendered.items():
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def component(obj: dict[str, Any]) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def deployments(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {component(d): d for d in by_kind(objs, "Deployment").values()}


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def arg(c: dict[str, Any], flag: str) -> str:
    args = c["args"]
    assert flag in args, f"{c['name']}: {flag} missing from {args}"
    return args[args.index(flag) + 1]


@pytest.fixture(scope="module", params=MATRIX)
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    values = values_of(request.param)
    return request.param, values, objects(render(values))
