"""API keys on a real gateway process: several keys from env, flags and a file; 401 otherwise;
/health and /metrics public or not by flag; the docs stay reachable."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.auth import key_ok
from ringserve.process import ServiceProcess, free_port, python_cmd
from tests.resilience.cluster import Cluster, Svc, cluster

pytestmark = pytest.mark.e2e

ENV_KEYS = ("env-key-1", "env-key-2")
FILE_KEY = "file-key-ü"  # non-ASCII keys compare as UTF-8 bytes


@pytest.fixture(scope="module")
def gateways(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Svc, Svc]]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# one key per line\n\n{FILE_KEY}\n", encoding="utf-8")
    with cluster(model_dir) as c:
        _, _, tok = c.ring()
        public = _gateway(c, tok, {"RINGSERVE_API_KEY": ",".join(ENV_KEYS)}, "--api-key-file", str(key_file))
        private = _gateway(c, tok, {}, "--api-key", "only-key", "--no-public-health", "--no-public-metrics")
        yield public, private


def _gateway(c: Cluster, tok: Svc, env: dict[str, str], *args: str) -> Svc:
    """Like Cluster.gateway, with its own environment (keys from RINGSERVE_API_KEY)."""
    port = free_port()
    proc = ServiceProcess("gateway", python_cmd("gateway", "--host", "127.0.0.1", "--port", str(port),
                                                "--tokenizer", tok.target, *args), env=env)
    svc = Svc(proc.start(), port)
    c.services.append(svc)
    proc.wait_ready_line(120)
    return svc


def _get(gw: Svc, path: str, key: str | None = None, scheme: str = "Bearer ") -> httpx.Response:
    headers = {b"Authorization": f"{scheme}{key}".strip().encode()} if key is not None else {}
    return httpx.get(f"{gw.url}{path}", headers=headers, timeout=30)


def test_every_configured_key_works(gateways: tuple[Svc, Svc]) -> None:
    public, private = gateways
    for key in (*ENV_KEYS, FILE_KEY):
        assert _get(public, "/v1/models", key).status_code == 200, key
    assert _get(public, "/v1/models", ENV_KEYS[0], scheme="").status_code == 200  # bare key (bench_serving)
    assert _get(private, "/v1/models", "only-key").status_code == 200
    r = httpx.post(f"{public.url}/generate", headers={"Authorization": f"Bearer {ENV_KEYS[1]}"}, timeout=60,
                   json={"text": "auth", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200


@pytest.mark.parametrize("key", [None, "", "wrong", ENV_KEYS[0][:-1], ENV_KEYS[0] + "x", "only-key"])
def test_anything_else_is_401(gateways: tuple[Svc, Svc], key: str | None) -> None:
    public, _ = gateways
    for path in ("/v1/models", "/get_model_info"):
        r = _get(public, path, key)
        assert r.status_code == 401, (path, key, r.status_code)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
    # The body is never parsed before the key is checked.
    r = httpx.post(f"{public.url}/generate", content=b"not json", timeout=30)
    assert r.status_code == 401


def test_health_and_metrics_public_by_flag(gateways: tuple[Svc, Svc]) -> None:
    public, private = gateways
    assert _get(public, "/health").status_code == 200
    assert _get(public, "/metrics").status_code == 200
    assert _get(private, "/health").status_code == 401
    assert _get(private, "/metrics").status_code == 401
    assert _get(private, "/health", "only-key").status_code == 200
    assert _get(private, "/openapi.json").status_code == 200  # docs are always public


def test_compare_is_over_all_keys_and_exact() -> None:
    keys = tuple(k.encode() for k in ("alpha", "beta"))
    assert key_ok("alpha", keys) and key_ok("beta", keys)
    assert not key_ok("alph", keys) and not key_ok("alphaa", keys) and not key_ok("", keys)
    source = Path(key_ok.__code__.co_filename).read_text()
    assert "hmac.compare_digest" in source
