"""The chart's tls block: the Secret, its mount and the RINGSERVE_TLS_* env in every pod (offline; the
exec probes and a generation over mTLS are in test_helm_commands.py)."""

from __future__ import annotations

import pytest

from tests.deploy._helm import case, container, deployments, render  # noqa: F401 - case is a fixture

TLS_ENV = {"RINGSERVE_TLS_CERT": "server.crt", "RINGSERVE_TLS_KEY": "server.key", "RINGSERVE_TLS_CA": "ca.crt",
           "RINGSERVE_TLS_CLIENT_CERT": "client.crt", "RINGSERVE_TLS_CLIENT_KEY": "client.key"}


def test_tls_secret_and_env_in_every_pod(case) -> None:
    _, values, objs = case
    tls = values.get("tls", {})
    for comp, dep in deployments(objs).items():
        pod = dep["spec"]["template"]["spec"]
        c = container(dep)
        env = {e["name"]: e.get("value") for e in c["env"]}
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        if not tls.get("enabled"):
            assert not any(k.startswith("RINGSERVE_TLS_") for k in env) and "tls" not in vols, comp
            continue
        assert vols["tls"]["secret"]["secretName"] == tls["secretName"], comp
        assert mounts["tls"] == {"name": "tls", "mountPath": "/etc/ringserve/tls", "readOnly": True}, comp
        for var, file in TLS_ENV.items():
            assert env[var] == f"/etc/ringserve/tls/{file}", (comp, var)
        assert env.get("RINGSERVE_TLS_SERVER_NAME") == (tls.get("serverName") or None), comp


def test_tls_needs_a_secret() -> None:
    with pytest.raises(Exception, match="secretName"):
        render({"tls": {"enabled": True}})
