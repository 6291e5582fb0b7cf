"""TLS and mutual TLS on every gRPC hop: a TLS stack serves, clients without a valid cert are refused.

The whole stack gets its TLS files from RINGSERVE_TLS_* (the launcher passes its env on), so every
hop (gateway->tokenizer, tokenizer->scheduler/detokenizer, scheduler->detokenizer) and the
launcher's own readiness waits run mTLS with one throwaway CA.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from ringserve import probe
from ringserve.tls import TlsConfig, sync_channel
from ringserve.v1 import api_pb2, api_pb2_grpc
from tests.e2e.grpc_client import generate_request
from tests.e2e.stack import Stack, running_stack

pytest.importorskip("cryptography")  # requirements-dev.txt: the throwaway CA
from tests.security.certs import CA, Pair  # noqa: E402

pytestmark = pytest.mark.e2e


class Pki:
    def __init__(self, directory: Path) -> None:
        self.ca = CA(directory)
        self.server = self.ca.issue("ringserve-server", server=True)
        self.client = self.ca.issue("ringserve-client", server=False)
        self.rogue_ca = CA(directory, "rogue-ca")
        self.rogue_client: Pair = self.rogue_ca.issue("rogue-client", server=False)

    def env(self) -> dict[str, str]:
        return {"RINGSERVE_TLS_CERT": self.server.cert, "RINGSERVE_TLS_KEY": self.server.key,
                "RINGSERVE_TLS_CA": self.ca.path, "RINGSERVE_TLS_CLIENT_CERT": self.client.cert,
                "RINGSERVE_TLS_CLIENT_KEY": self.client.key}

    def client_tls(self) -> TlsConfig:
        return TlsConfig(tls_ca=self.ca.path, tls_client_cert=self.client.cert, tls_client_key=self.client.key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_stack(model_dir: str, pki: Pki) -> Iterator[Stack]:
    with running_stack(model_dir, env=pki.env()) as stack:
        yield stack


def test_tls_stack_serves_a_generation(tls_stack: Stack, pki: Pki) -> None:
    out = tls_stack.generate({"text": "tls", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                 "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 4
    with sync_channel(tls_stack.tokenizer, pki.client_tls()) as ch:
        msgs = list(api_pb2_grpc.InferenceServiceStub(ch).Generate(generate_request("grpc tls", 3), timeout=60))
    assert sum(len(m.output_ids) for m in msgs) == 3
    # Every service says in its log that it listens with mTLS.
    for name in ("detokenizer", "scheduler", "tokenizer"):
        assert any(f"{name} gRPC listening" in line and "mTLS" in line for line in tls_stack.launcher.tail)
    assert probe.check(tls_stack.scheduler, tls=pki.client_tls())


def _refused(target: str, tls: TlsConfig | None) -> grpc.StatusCode:
    channel = sync_channel(target, tls) if tls is not None else grpc.insecure_channel(target)
    with channel:
        stub = api_pb2_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=10)
    return info.value.code()


@pytest.mark.parametrize("service", ["tokenizer", "scheduler", "detokenizer"])
def test_clients_without_a_valid_certificate_are_refused(tls_stack: Stack, pki: Pki, service: str) -> None:
    target = getattr(tls_stack, service)
    # Plaintext, TLS without a client certificate, and a certificate from another CA: all fail at
    # the handshake (UNAVAILABLE), before any method runs.
    assert _refused(target, None) == grpc.StatusCode.UNAVAILABLE
    assert _refused(target, TlsConfig(tls_ca=pki.ca.path)) == grpc.StatusCode.UNAVAILABLE
    rogue = TlsConfig(tls_ca=pki.ca.path, tls_client_cert=pki.rogue_client.cert,
                      tls_client_key=pki.rogue_client.key)
    assert _refused(target, rogue) == grpc.StatusCode.UNAVAILABLE
    assert not probe.check(target, tls=TlsConfig(tls_ca=pki.ca.path))


def test_client_refuses_a_server_from_another_ca(tls_stack: Stack, pki: Pki) -> None:
    wrong_trust = TlsConfig(tls_ca=pki.rogue_ca.path, tls_client_cert=pki.rogue_client.cert,
                            tls_client_key=pki.rogue_client.key)
    assert _refused(tls_stack.tokenizer, wrong_trust) == grpc.StatusCode.UNAVAILABLE


def test_gateway_health_is_green_over_tls(tls_stack: Stack) -> None:
    assert httpx.get(f"{tls_stack.gateway_url}/health", timeout=10).status_code == 200


def test_config_rejects_half_a_tls_setup(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match="--tls-key"):
        TlsConfig(tls_cert=str(cert))
    with pytest.raises(ValueError, match="no such file"):
        TlsConfig(tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="--tls-ca"):
        TlsConfig(tls_client_cert=str(cert), tls_client_key=str(cert))
