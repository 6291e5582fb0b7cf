"""dns:/// scheduler targets: one Connect stream per resolved address, following pods as they change."""

from __future__ import annotations

import grpc
import pytest

from ringserve.process import free_port, wait_grpc_serving
from ringserve.v1 import api_pb2, scheduler_pb2_grpc
from services.tokenizer import discovery
from services.tokenizer.discovery import parse_dns_target, resolve

from .fakes import FakeScheduler
from .ring import stub
from .test_generate import gen_request


def test_parse_dns_target() -> None:
    assert parse_dns_target("dns:///sched-headless.ns.svc:50052") == ("sched-headless.ns.svc", 50052)
    assert parse_dns_target("10.0.0.1:50052") is None
    with pytest.raises(ValueError):
        parse_dns_target("dns:///no-port")


async def test_resolve_localhost() -> None:
    assert "127.0.0.1:80" in await resolve("localhost", 80)


def test_one_stream_per_resolved_address(ring, monkeypatch) -> None:
    port = free_port()
    servers = []
    for host in ("127.0.0.1", "127.0.0.2"):  # two "pods" behind one name, same port
        async def start(host: str = host) -> grpc.aio.Server:
            server = grpc.aio.server()
            scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(
                FakeScheduler(ring.detok, ring.recorder, ring.options), server)
            assert server.add_insecure_port(f"{host}:{port}") == port
            await server.start()
            return server
        servers.append(ring.lt.run(start()))
    answer = [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]

    async def fake_resolve(host: str, p: int) -> list[str]:
        assert (host, p) == ("schedulers.test", port)
        return list(answer)

    monkeypatch.setattr(discovery, "resolve", fake_resolve)
    try:
        tok = ring.start_tokenizer([], scheduler=(f"dns:///schedulers.test:{port}",))
        wait_grpc_serving(tok.cfg.address, timeout=10)
        channel, client = stub(tok)
        with channel:
            for i in range(4):
                assert list(client.Generate(gen_request(rid=f"d{i}", max_new_tokens=3), timeout=10))
            info = client.GetServerInfo(api_pb2.GetServerInfoRequest(), timeout=5)
            assert sorted(s.address for s in info.schedulers if s.connected) == answer
            answer.pop()  # one pod goes away
            ring.lt.run(tok.discovery.refresh())
            info = client.GetServerInfo(api_pb2.GetServerInfoRequest(), timeout=5)
            assert [s.address for s in info.schedulers] == answer
            assert list(client.Generate(gen_request(rid="after", max_new_tokens=3), timeout=10))
    finally:
        for s in servers:
            ring.lt.run(s.stop(None))
