"""The whole stack through its public faces: parity, the openai client, disconnects, metrics."""

from __future__ import annotations

import concurrent.futures as cf
import queue
import re
import threading
import time
from typing import Any

import grpc
import httpx
import pytest

from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import api_pb2, api_pb2_grpc, common_pb2
from tests.e2e.grpc_client import server_info
from tests.e2e.reference import PROMPTS, greedy_body, greedy_reference
from tests.e2e.stack import Stack, running_stack, sse_events

pytestmark = pytest.mark.e2e



@pytest.fixture(scope="module")
def stack(model_dir: str):
    with running_stack(model_dir) as s:
        yield s


def test_concurrent_greedy_equals_transformers(stack: Stack, model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    reference = greedy_reference(model_dir, PROMPTS, 32)
    bodies = [greedy_body(p, 32) for p in PROMPTS * 4]  # 40 concurrent requests, duplicates share prefixes
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        outs = list(pool.map(stack.generate, bodies))
    for body, out in zip(bodies, outs):
        assert out["output_ids"] == reference[body["text"]], body["text"]
        assert out["text"] == tok.decode(out["output_ids"])


def test_openai_client_stream_equals_non_stream(stack: Stack) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    kwargs: dict[str, Any] = dict(model=model, prompt="Hello there", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert [c.usage for c in chunks if c.usage][-1].completion_tokens == full.usage.completion_tokens
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_echo_logprobs_score_the_prompt_as_transformers_does(stack: Stack, model_dir: str) -> None:
    """lm-eval's loglikelihood request (echo, logprobs=1, max_tokens=1) through all four services."""
    import torch
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    tok = TextTokenizer.from_model(model_dir)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)  # [n, V]
    client = OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    stack.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})  # now the prompt is cached
    for stream in (False, True):
        kw: dict[str, Any] = dict(model=model, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
        if stream:
            parts = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
            lps = [x for p in parts for x in p.token_logprobs]
            tops = [x for p in parts for x in p.top_logprobs]
        else:
            lp = client.completions.create(**kw).choices[0].logprobs
            lps, tops = lp.token_logprobs, lp.top_logprobs
        n = len(prompt)
        assert len(lps) == n + 1 and lps[0] is None and tops[0] is None
        want = [float(ref[i - 1, prompt[i]]) for i in range(1, n)] + [float(ref[n - 1].max())]
        assert lps[1:] == pytest.approx(want, abs=1e-4)
        assert all(len(t) == 1 for t in tops[1:])
    # max_tokens=0: the prompt scored, nothing generated (OpenAI's legacy scoring request)
    only = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0).choices[0]
    assert only.logprobs.token_logprobs[1:] == pytest.approx(want[:-1], abs=1e-4)
    assert only.text.endswith(tok.decode(prompt)) and only.finish_reason == "length"  # echo keeps <s>


def test_closing_streams_frees_the_scheduler(stack: Stack) -> None:
    body = {"text": "cancel me", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
    started = threading.Barrier(17)

    def open_and_drop() -> None:
        with httpx.stream("POST", f"{stack.gateway_url}/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break
            started.wait(30)
        # Leaving the block closes the connection mid-generation.

    threads = [threading.Thread(target=open_and_drop) for _ in range(16)]
    for t in threads:
        t.start()
    started.wait(60)
    for t in threads:
        t.join(30)
    with grpc.insecure_channel(stack.tokenizer) as ch:
        _wait_idle(api_pb2_grpc.InferenceServiceStub(ch))


def _wait_idle(stub: api_pb2_grpc.InferenceServiceStub, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while True:
        info = server_info(stub)
        if info.num_running_reqs == 0 and info.num_queue_reqs == 0 and info.rid_to_state_size == 0:
            return
        assert time.monotonic() < deadline, info
        time.sleep(0.2)  # polling a counter that is expected to drain, not waiting for readiness


def test_generate_stream_carries_many_generations_on_one_call(stack: Stack, model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    reference = greedy_reference(model_dir, PROMPTS, 16)

    def generate(rid: str, text: str, n: int, **sp: float) -> api_pb2.GenerateStreamRequest:
        fields: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": n, "min_new_tokens": n, **sp}
        params = common_pb2.SamplingParams(**fields)
        return api_pb2.GenerateStreamRequest(generate=api_pb2.GenerateRequest(
            rid=rid, text=text, stream=True, sampling_params=params))

    outbox: queue.Queue[api_pb2.GenerateStreamRequest | None] = queue.Queue()
    for i, p in enumerate(PROMPTS):
        outbox.put(generate(f"s{i}", p, 16))
    outbox.put(generate("bad", "x", 8, temperature=-1.0))
    outbox.put(generate("long", "cancel me", 2000))

    def instructions():  # the client's side of the stream: open until every answer is in
        while (msg := outbox.get()) is not None:
            yield msg

    ids: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    statuses: dict[str, api_pb2.GenerateStatus] = {}
    rids_per_message: list[int] = []
    cancelled = closed = False
    with grpc.insecure_channel(stack.tokenizer) as ch:
        stub = api_pb2_grpc.InferenceServiceStub(ch)
        for resp in stub.GenerateStream(instructions(), timeout=120):
            rids_per_message.append(len({o.rid for o in resp.outputs}))
            for o in resp.outputs:
                ids.setdefault(o.rid, []).extend(o.output_ids)
                texts[o.rid] = texts.get(o.rid, "") + o.text
            statuses.update({st.rid: st for st in resp.statuses})
            if not cancelled and len(ids.get("long", [])) >= 4:
                outbox.put(api_pb2.GenerateStreamRequest(cancel="long"))
                cancelled = True
            if cancelled and not closed and len(statuses) == len(PROMPTS) + 1:
                outbox.put(None)  # half-close: the server ends the stream once nothing runs
                closed = True
        for i, p in enumerate(PROMPTS):
            assert statuses[f"s{i}"].code == 0
            assert ids[f"s{i}"] == reference[p], p
            assert texts[f"s{i}"] == tok.decode(ids[f"s{i}"])
        assert statuses["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert statuses["bad"].message.startswith("sampling_params.temperature")
        assert "long" not in statuses  # a cancelled generation gets no status
        assert max(rids_per_message) > 1  # one message carried several generations' outputs
        _wait_idle(stub)  # the cancel aborted "long" at the scheduler


def scrape(url: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels ignored)."""
    sums: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? ([-+\deE.naNinf]+)$", line)
        if m:
            sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(2))
    return sums


def test_every_service_exports_moving_metrics(stack: Stack) -> None:
    urls = {
        "gateway": f"{stack.gateway_url}/metrics",
        "tokenizer": f"http://127.0.0.1:{stack.ports['tok_metrics']}/metrics",
        "scheduler": f"http://127.0.0.1:{stack.ports['sched_metrics']}/metrics",
        "detokenizer": f"http://127.0.0.1:{stack.ports['detok_metrics']}/metrics",
    }
    before = {k: scrape(u) for k, u in urls.items()}
    stack.generate({"text": "metrics", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}})
    after = {k: scrape(u) for k, u in urls.items()}
    moving = {
        "tokenizer": ["sglang:generation_tokens_total", "sglang:prompt_tokens_total",
                      "sglang:num_requests_total", "sglang:e2e_request_latency_seconds_count",
                      "sglang:time_to_first_token_seconds_count"],
        "scheduler": ["sglang:queue_time_seconds_count", "ringserve:forward_steps_total",
                      "ringserve:forward_seconds_total", "ringserve:decode_rows_total"],
        "detokenizer": ["ringserve_detokenizer_tokens_decoded_total",
                        "ringserve_detokenizer_step_decode_seconds_count"],
        "gateway": ["ringserve_gateway_http_requests_total"],
    }
    for svc, names in moving.items():
        for name in names:
            assert after[svc].get(name, 0) > before[svc].get(name, 0), (svc, name)
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:max_total_num_tokens", "sglang:gen_throughput"):
        assert name in after["scheduler"], name


def test_timings_cover_every_boundary_and_hop(stack: Stack) -> None:
    """return_timings: each service's share of a request, the two gRPC hops included."""
    for stream in (False, True):
        body = {"text": "Hello there", "stream": stream, "return_timings": True,
                "sampling_params": {"max_new_tokens": 6, "min_new_tokens": 6}}
        if stream:
            with httpx.stream("POST", f"{stack.gateway_url}/generate", json=body, timeout=60) as r:
                events = [e for e in sse_events(r) if isinstance(e, dict)]
            meta = events[-1]["meta_info"]
        else:
            meta = stack.generate(body)["meta_info"]
        t = meta["timings"]
        for name in ("tokenize_s", "to_scheduler_s", "prefill_s", "decode_s", "ring_hops_s", "detokenize_s",
                     "ttft_s", "e2e_s"):
            assert t.get(name, 0) > 0, (stream, name, t)
        assert t["to_scheduler_s"] < t["ttft_s"] < t["e2e_s"]
        assert t["prefill_s"] <= t["decode_s"] and t.get("queue_s", 0) + t["decode_s"] < t["e2e_s"]
