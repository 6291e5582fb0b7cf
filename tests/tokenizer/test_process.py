"""The tokenizer as the container runs it (`python -m services.tokenizer`), against the fakes."""

from __future__ import annotations

import signal
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ringserve.process import ServiceProcess, free_port, python_cmd
from ringserve.v1 import api_pb2, api_pb2_grpc

from .fakes import fake_text
from .test_generate import gen_request

pytestmark = pytest.mark.e2e


def tokenizer_cmd(*args: str) -> list[str]:
    return python_cmd("services.tokenizer", *args)


@pytest.fixture
def tokenizer_process(ring):
    port, metrics_port = free_port(), free_port()
    sched = ring.start_scheduler()
    proc = ServiceProcess("tokenizer", tokenizer_cmd(
        "--port", str(port), "--metrics-port", str(metrics_port), "--tokenizer-id", "proc-1",
        "--routing-policy", "cache_aware", *ring.tokenizer_args([sched])))
    proc.start()
    try:
        proc.wait_serving(f"127.0.0.1:{port}", timeout=30)
        yield proc, port, metrics_port
    finally:
        proc.stop()


def test_process_serves_generate_info_tokenize_metrics(ring, tokenizer_process):
    proc, port, metrics_port = tokenizer_process
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = api_pb2_grpc.InferenceServiceStub(channel)
        msgs = list(client.Generate(gen_request(rid="p1", max_new_tokens=5), timeout=10))
        assert "".join(m.text for m in msgs) == fake_text(ring.tokenizer.encode("hello world"), 5)
        assert ring.recorder.requests[-1].owner == "proc-1"

        info = client.GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=5)
        assert info.served_model_name == "ringserve-tiny-llama" and info.max_context_length == 2048
        assert info.vocab_size == ring.tokenizer.vocab_size and list(info.eos_token_ids) == ring.tokenizer.eos_token_ids
        assert info.has_chat_template and info.is_generation

        server = client.GetServerInfo(api_pb2.GetServerInfoRequest(), timeout=5)
        assert server.tokenizer_id == "proc-1" and server.routing_policy == "cache_aware"
        assert server.detokenizer_connected and server.schedulers[0].connected
        assert server.schedulers[0].max_total_num_tokens == 1000 and server.rid_to_state_size == 0

        tok = client.Tokenize(api_pb2.TokenizeRequest(text="hello world"), timeout=5)
        assert list(tok.ids) == ring.tokenizer.encode("hello world") and tok.count == len(tok.ids)
        assert list(tok.tokens) == ring.tokenizer.token_texts(list(tok.ids)) and tok.max_model_len == 2048
        chat = api_pb2.ChatInput(messages=[api_pb2.ChatMessage(role="user", content="hi")])
        assert list(client.Tokenize(api_pb2.TokenizeRequest(chat=chat), timeout=5).ids) == \
            ring.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
        text = client.Detokenize(api_pb2.DetokenizeRequest(ids=tok.ids), timeout=5).text
        assert text == "hello world"
        with pytest.raises(grpc.RpcError) as e:
            client.Detokenize(api_pb2.DetokenizeRequest(ids=[10**6]), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("ids:")

        assert client.FlushCache(api_pb2.FlushCacheRequest(), timeout=5).success

        # Reflection: grpcurl can list the service without proto files.
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5))
        assert "ringserve.v1.InferenceService" in {s.name for s in resp.list_services_response.service}

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    label = 'model_name="ringserve-tiny-llama"'
    for name in ("sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:num_requests_total",
                 "sglang:time_to_first_token_seconds_count", "sglang:e2e_request_latency_seconds_count",
                 "sglang:inter_token_latency_seconds_count", "sglang:num_aborted_requests_total"):
        assert f"{name}{{{label}}}" in body, name
    assert f"sglang:generation_tokens_total{{{label}}} 5.0" in body

    proc.signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=15) == 0
