"""Failure semantics: scheduler death and return, detokenizer grace, replica isolation, bursts."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from ringserve.process import wait_grpc_serving
from ringserve.v1 import api_pb2, api_pb2_grpc, common_pb2

from .fakes import fake_text
from .health import NOT_SERVING, SERVING, check, wait_status
from .test_generate import gen_request, server_info


def test_scheduler_death_fails_in_flight_then_recovers(ring):
    port = ring.start_scheduler()
    tok = ring.start_tokenizer([port])
    target = tok.cfg.address
    wait_grpc_serving(target, timeout=10)
    ring.options.step_s = 0.01
    with grpc.insecure_channel(target) as channel:
        client = api_pb2_grpc.InferenceServiceStub(channel)
        calls = [client.Generate(gen_request(rid=f"k{i}", max_new_tokens=2000), timeout=30) for i in range(3)]
        for c in calls:
            next(c)
        killed_at = time.monotonic()
        ring.kill_scheduler(port)
        for c in calls:
            with pytest.raises(grpc.RpcError) as e:
                list(c)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert e.value.details() == f"scheduler 127.0.0.1:{port} unavailable"
        assert time.monotonic() - killed_at < 5
        wait_status(target, NOT_SERVING, timeout=5)
        assert server_info(client).rid_to_state_size == 0
        # New requests while it is down: a clear UNAVAILABLE, not a hang.
        with pytest.raises(grpc.RpcError) as e:
            list(client.Generate(gen_request(rid="while-down"), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # Same port, new scheduler: the tokenizer reconnects by itself.
        ring.start_scheduler(port)
        wait_grpc_serving(target, timeout=10)
        msgs = list(client.Generate(gen_request(rid="after", max_new_tokens=4), timeout=10))
        assert "".join(m.text for m in msgs) == fake_text(ring.tokenizer.encode("hello world"), 4)
        assert ring.recorder.hellos == [tok.cfg.tokenizer_id] * 2


def test_detokenizer_grace_fails_in_flight(ring):
    port = ring.start_scheduler()
    tok = ring.start_tokenizer([port], detokenizer_grace_s=0.5)
    target = tok.cfg.address
    wait_grpc_serving(target, timeout=10)
    ring.options.step_s = 0.01
    with grpc.insecure_channel(target) as channel:
        client = api_pb2_grpc.InferenceServiceStub(channel)
        call = client.Generate(gen_request(rid="g1", max_new_tokens=2000), timeout=30)
        next(call)
        ring.lt.run(ring.detok_server.stop(None))
        wait_status(target, NOT_SERVING, timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "detokenizer" in e.value.details()
        assert ring.recorder.wait_for(lambda: "g1" in ring.recorder.aborts, 5)
        assert server_info(client).rid_to_state_size == 0


def test_two_tokenizers_get_only_their_own_outputs(ring):
    port = ring.start_scheduler()
    a = ring.start_tokenizer([port], tokenizer_id="replica-a")
    b = ring.start_tokenizer([port], tokenizer_id="replica-b")
    for t in (a, b):
        wait_grpc_serving(t.cfg.address, timeout=10)
    with grpc.insecure_channel(a.cfg.address) as ca, grpc.insecure_channel(b.cfg.address) as cb:
        sa, sb = api_pb2_grpc.InferenceServiceStub(ca), api_pb2_grpc.InferenceServiceStub(cb)
        calls = []
        for i in range(10):
            calls.append(("a", f"a-{i}",
                          sa.Generate(gen_request(text=f"alpha {i}", rid=f"a-{i}", max_new_tokens=6), timeout=10)))
            calls.append(("b", f"b-{i}",
                          sb.Generate(gen_request(text=f"beta {i} x", rid=f"b-{i}", max_new_tokens=6), timeout=10)))
        for who, rid, call in calls:
            msgs = list(call)
            text = f"alpha {rid[2:]}" if who == "a" else f"beta {rid[2:]} x"
            assert "".join(m.text for m in msgs) == fake_text(ring.tokenizer.encode(text), 6)
            assert {m.rid for m in msgs} == {rid}
    owners = {r.rid: r.owner for r in ring.recorder.requests}
    assert all(owners[f"a-{i}"] == "replica-a" and owners[f"b-{i}"] == "replica-b" for i in range(10))
    assert a.manager.ignored_deltas == 0 and b.manager.ignored_deltas == 0
    assert sorted(ring.recorder.subscribes) == ["replica-a", "replica-b"]


def test_burst_of_mixed_requests_leaves_no_state(ring):
    ports = [ring.start_scheduler(), ring.start_scheduler()]
    tok = ring.start_tokenizer(ports, routing_policy="least_load")
    wait_grpc_serving(tok.cfg.address, timeout=10)
    ring.options.step_s = 0.003

    async def one(stub: api_pb2_grpc.InferenceServiceStub, i: int) -> str:
        kind = ("ok", "ok_n", "cancel", "deadline", "invalid", "nonstream")[i % 6]
        if kind == "invalid":
            req = api_pb2.GenerateRequest(rid=f"r{i}", text="x",
                                          sampling_params=common_pb2.SamplingParams(top_p=2))
        elif kind == "ok_n":
            req = gen_request(rid=f"r{i}", sampling_params=common_pb2.SamplingParams(max_new_tokens=5, n=2))
        else:
            req = gen_request(text=f"burst {i}", rid=f"r{i}",
                              max_new_tokens=400 if kind in ("cancel", "deadline") else 6, stream=kind != "nonstream")
        call = stub.Generate(req, timeout=0.3 if kind == "deadline" else 20)
        try:
            if kind == "cancel":
                await call.read()
                call.cancel()
                return "cancelled"
            async for _ in call:
                pass
            return "ok"
        except grpc.aio.AioRpcError as e:
            return e.code().name

    async def burst() -> list[str]:
        async with grpc.aio.insecure_channel(tok.cfg.address) as channel:
            stub = api_pb2_grpc.InferenceServiceStub(channel)
            return await asyncio.gather(*(one(stub, i) for i in range(200)))

    results = asyncio.run(burst())
    assert results.count("INVALID_ARGUMENT") == 33
    assert results.count("DEADLINE_EXCEEDED") == 33
    assert results.count("ok") == 34 * 2 + 33
    with grpc.insecure_channel(tok.cfg.address) as channel:
        client = api_pb2_grpc.InferenceServiceStub(channel)
        assert ring.recorder.wait_for(lambda: not ring.options.running, 10), ring.options.running
        assert server_info(client).rid_to_state_size == 0
        info = server_info(client)
        assert [s.connected for s in info.schedulers] == [True, True]
    assert check(tok.cfg.address) == SERVING
