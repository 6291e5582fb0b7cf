"""SGLang-native routes, HTTP-level errors, limits, auth, metrics and disconnects."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.conftest import API_KEYS, start_gateway
from tests.gateway.fake_tokenizer import MODEL, FakeTokenizer


def sse(text: str) -> list[str]:
    return [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]


def test_generate_single(http: httpx.Client, fake: FakeTokenizer) -> None:
    r = http.post("/generate", json={"text": "hi", "rid": "r1", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "stop": "zzz", "sampling_seed": 8},
        "return_logprob": True, "top_logprobs_num": 2, "lora_path": None, "logprob_start_len": -1})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == "Hello world," and out["output_ids"] == [100, 101, 102]
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (1, 3, 1)
    assert meta["output_token_logprobs"][1][1:] == [101, " world"] and len(meta["output_top_logprobs"][0]) == 2
    call = fake.servicer.calls[-1]
    assert call.rid == "r1" and call.sampling_params.seed == 8 and list(call.sampling_params.stop) == ["zzz"]


def test_generate_input_token_logprobs(http: httpx.Client, fake: FakeTokenizer) -> None:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
            "top_logprobs_num": 1, "logprob_start_len": 0}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert fake.servicer.calls[-1].logprob_start_len == 0
    assert meta["input_token_logprobs"] == [[None, 5, "<5>"], [-0.25, 6, "<6>"], [-0.5, 7, "<7>"]]
    assert meta["input_top_logprobs"][0] is None and meta["input_top_logprobs"][1] == [[-0.5, 0, "<0>"]]
    events = [json.loads(e) for e in sse(http.post("/generate", json=body | {"stream": True}).text)[:-1]]
    assert all(e["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"] for e in events)
    plain = http.post("/generate", json=body | {"logprob_start_len": -1}).json()["meta_info"]
    assert "input_token_logprobs" not in plain and not fake.servicer.calls[-1].HasField("logprob_start_len")


def test_generate_batch_and_stop(http: httpx.Client) -> None:
    r = http.post("/generate", json={"input_ids": [[1, 2], [3]], "sampling_params": [
        {"max_new_tokens": 2}, {"max_new_tokens": 9, "stop": [" héllo"]}]})
    outs = r.json()
    assert [o["text"] for o in outs] == ["Hello world", "Hello world,"]
    assert outs[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": " héllo"}
    eos = http.post("/generate", json={"text": "EOS"}).json()
    assert eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


def test_generate_takes_json_sent_as_a_form(http: httpx.Client) -> None:
    """`curl URL/generate -d '{...}'` sends application/x-www-form-urlencoded; it is still JSON."""
    body = '{"text": "你好", "sampling_params": {"max_new_tokens": 2}}'.encode()
    r = http.post("/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "Hello world"


def test_generate_stream_format(http: httpx.Client) -> None:
    """bench_serving --backend sglang: cumulative text, meta_info.completion_tokens, [DONE]."""
    full = http.post("/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4, "n": 2}}).json()
    r = http.post("/generate", json={"text": ["a", "b"], "stream": True,
                                     "sampling_params": {"max_new_tokens": 4, "n": 2}})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    last: dict[int, dict] = {}
    for e in map(json.loads, events[:-1]):
        prev = last.get(e["index"])
        if prev is not None:
            assert (e["text"].startswith(prev["text"])
                    and e["meta_info"]["completion_tokens"] > prev["meta_info"]["completion_tokens"])
        last[e["index"]] = e
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[i]["text"] for i in range(4)] == [o["text"] for o in full]
    assert all(last[i]["meta_info"]["finish_reason"]["type"] == "length" for i in range(4))


def test_generate_errors(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": "ERR INVALID_ARGUMENT sampling_params.top_p: must be in (0, 1]"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.top_p"
    r = http.post("/generate", json={"text": "MIDERR RESOURCE_EXHAUSTED full", "stream": True})
    events = sse(r.text)
    assert json.loads(events[-2])["error"]["code"] == "resource_exhausted" and events[-1] == "[DONE]"
    r = http.post("/generate", json={"sampling_params": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"


def test_malformed_and_oversized(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    big = {"prompt": "x" * (70 * 1024)}
    assert http.post("/v1/completions", json=big).status_code == 413

    def chunks():  # no Content-Length: counted while streaming in
        body = json.dumps(big).encode()
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]
    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_auth_and_public_routes(gateway: str, fake: FakeTokenizer) -> None:
    assert httpx.post(gateway + "/generate", json={"text": "hi"}).status_code == 401
    r = httpx.post(gateway + "/generate", json={"text": "hi"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(gateway + "/generate", content=b"{", headers={"Authorization": "x"}).status_code == 401
    assert httpx.post(gateway + "/generate", json={"text": "hi"},
                      headers={"Authorization": API_KEYS[1]}).status_code == 200
    assert httpx.get(gateway + "/health").status_code == 200
    fake.set_serving(False)
    r = httpx.get(gateway + "/health")
    assert r.status_code == 503 and "error" in r.json()
    assert httpx.get(gateway + "/metrics").status_code == 200


def test_info_routes(http: httpx.Client, fake: FakeTokenizer) -> None:
    info = http.get("/get_model_info").json()
    assert info["model_path"] == "/models/fake" and info["is_generation"] is True
    server = http.get("/get_server_info").json()
    assert server["tokenizer_id"] == "tok-1" and server["served_model_name"] == MODEL
    assert http.post("/flush_cache").status_code == 200
    fake.servicer.flush_ok = False
    assert http.post("/flush_cache").status_code == 400
    assert http.post("/abort_request", json={"rid": "live"}).json() == {"rid": "live", "found": True}
    assert fake.servicer.aborts == ["live"]
    assert http.get("/health_generate").status_code == 200
    spec = http.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/generate"} <= set(spec["paths"])
    assert "CompletionRequest" in spec["components"]["schemas"]


def test_metrics(http: httpx.Client) -> None:
    http.get("/v1/models")
    http.get("/v1/models/unknown")
    text = http.get("/metrics").text
    assert (f'ringserve_gateway_http_requests_total{{method="GET",model_name="{MODEL}",route="/v1/models",'
            'status="200"}' in text)
    assert 'route="/v1/models/{model_id:path}",status="404"' in text
    assert "ringserve_gateway_http_request_duration_seconds_bucket" in text


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "SLOW", "stream": True}),
    ("/generate", {"text": "SLOW", "stream": True}),
])
def test_disconnect_mid_stream_cancels(gateway: str, fake: FakeTokenizer, path: str, body: dict) -> None:
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {API_KEYS[0]}"}, timeout=10) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    assert fake.servicer.cancel_event.wait(5), "the fake tokenizer never saw the cancellation"


def test_disconnect_non_streaming_cancels(gateway: str, fake: FakeTokenizer) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway + "/v1/completions", json={"prompt": "SLOW"}, timeout=1.0,
                   headers={"Authorization": f"Bearer {API_KEYS[0]}"})
    assert fake.servicer.cancel_event.wait(5)


def test_private_health_and_no_tokenizer(fake: FakeTokenizer) -> None:
    proc, url = start_gateway(fake, "--api-key", "k", "--no-public-health", "--no-public-metrics")
    try:
        assert httpx.get(url + "/health").status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/health", headers={"Authorization": "Bearer k"}).status_code == 200
    finally:
        assert proc.stop() == 0  # SIGTERM drains and exits 0
