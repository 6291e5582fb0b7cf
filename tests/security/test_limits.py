"""Every request limit answers a 4xx that names it, through a real gateway (native and OpenAI routes).

Limits: body size (gateway --max-body-bytes), prompt length (context), n (--max-n), max_new_tokens
(context), stop strings (--max-stop-strings, --max-stop-len), logprobs count (--max-top-logprobs).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.resilience.cluster import Svc, cluster

pytestmark = pytest.mark.e2e

BODY_LIMIT = 64 * 1024
CONTEXT = 2048  # the default model's


@pytest.fixture(scope="module")
def gw(model_dir: str) -> Iterator[Svc]:
    with cluster(model_dir) as c:
        _, _, tok = c.ring(tok_args=("--max-n", "4", "--max-stop-strings", "3", "--max-stop-len", "16",
                                     "--max-top-logprobs", "5"))
        yield c.gateway(tok, "--max-body-bytes", str(BODY_LIMIT))


def _err(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    return r.json()["error"]


def _native(gw: Svc, **body: object) -> httpx.Response:
    prompt = {} if "input_ids" in body else {"text": "hi"}
    return httpx.post(f"{gw.url}/generate", json={**prompt, **body}, timeout=60)


def _openai(gw: Svc, **body: object) -> httpx.Response:
    model = httpx.get(f"{gw.url}/v1/models", timeout=10).json()["data"][0]["id"]
    return httpx.post(f"{gw.url}/v1/completions", json={"model": model, "prompt": "hi", **body}, timeout=60)


def test_body_size(gw: Svc) -> None:
    r = httpx.post(f"{gw.url}/generate", content=b'{"text": "' + b"a" * BODY_LIMIT + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and str(BODY_LIMIT) in _err(r)["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"text": "'
        for _ in range(BODY_LIMIT // 4096 + 1):
            yield b"a" * 4096
        yield b'"}'
    r = httpx.post(f"{gw.url}/generate", content=chunks(), headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413


def test_prompt_length(gw: Svc) -> None:
    e = _err(_native(gw, input_ids=[5] * (CONTEXT + 1)))
    assert e["param"] == "input_ids" and str(CONTEXT) in e["message"]
    e = _err(_openai(gw, prompt=[5] * (CONTEXT + 1)))
    assert "context length" in e["message"]


def test_n(gw: Svc) -> None:
    e = _err(_native(gw, sampling_params={"n": 5}))
    assert e["param"] == "sampling_params.n" and "[1, 4]" in e["message"]
    assert _err(_openai(gw, n=5))["param"] == "n"


def test_max_new_tokens(gw: Svc) -> None:
    e = _err(_native(gw, sampling_params={"max_new_tokens": CONTEXT}))
    assert e["param"] == "sampling_params.max_new_tokens" and "context length" in e["message"]
    assert _err(_openai(gw, max_tokens=10**9))["param"] == "max_tokens"
    assert _err(_native(gw, sampling_params={"max_new_tokens": -1}))["param"].endswith("max_new_tokens")


def test_stop_strings(gw: Svc) -> None:
    e = _err(_native(gw, sampling_params={"stop": ["a", "b", "c", "d"]}))
    assert e["param"] == "sampling_params.stop" and "at most 3" in e["message"]
    e = _err(_native(gw, sampling_params={"stop": ["x" * 17]}))
    assert e["param"] == "sampling_params.stop[0]" and "16" in e["message"]
    assert _err(_openai(gw, stop=["a", "b", "c", "d"]))["param"] == "stop"


def test_logprobs_count(gw: Svc) -> None:
    e = _err(_native(gw, return_logprob=True, top_logprobs_num=6))
    assert e["param"] == "top_logprobs_num" and "at most 5" in e["message"]
    assert _err(_openai(gw, logprobs=6))["param"] == "logprobs"


def test_within_limits_is_fine(gw: Svc) -> None:
    r = _native(gw, return_logprob=True, top_logprobs_num=5,
                sampling_params={"n": 1, "max_new_tokens": 4, "stop": ["a", "b", "c"]})
    assert r.status_code == 200, r.text
