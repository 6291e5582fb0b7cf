"""The real process: python -m services.detokenizer, health, push/subscribe, metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import urllib.request

import grpc
import pytest
from test_servicer import PushStream, collect, delta  # type: ignore[import-not-found]

from ringserve.process import ServiceProcess, free_port, python_cmd
from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import detokenizer_pb2 as pb
from ringserve.v1 import detokenizer_pb2_grpc


@pytest.mark.e2e
async def test_process_serves_and_drains(model_dir: str, tiny_tok: TextTokenizer) -> None:
    port, metrics_port = free_port(), free_port()
    proc = ServiceProcess("detokenizer", python_cmd(
        "services.detokenizer", "--port", str(port), "--metrics-port", str(metrics_port),
        "--model", model_dir)).start()
    try:
        await asyncio.to_thread(proc.wait_serving, f"127.0.0.1:{port}", 30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
            push = await PushStream.connect(stub, "sched-e2e")
            sub = stub.Subscribe(pb.SubscribeRequest(owner="tok-e2e"))
            assert await push.next_resync() == "tok-e2e"
            await push.send(delta(tiny_tok, "r1", "tok-e2e", "over the wire 😀"))
            assert await collect(sub, 1) == {"r1": "over the wire 😀"}
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read())
            assert b"ringserve_detokenizer_tokens_decoded_total" in body
            assert b'ringserve_detokenizer_subscribers{model_name=' in body
            proc.signal(signal.SIGTERM)
            # Draining ends both long-lived streams cleanly, then the process exits 0.
            assert await asyncio.wait_for(sub.read(), 15) is grpc.aio.EOF
            assert await asyncio.wait_for(push.call.read(), 15) is grpc.aio.EOF
            await push.out.put(None)
        assert await asyncio.to_thread(proc.proc.wait, 15) == 0  # type: ignore[union-attr]
    finally:
        proc.stop()
