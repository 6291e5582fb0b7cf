"""SGLang's gateway (smg 1.13, PyPI) in front of the real scheduler, which serves SGLang's scheduler
protocol on --sglang-grpc-port: the openai client through smg (chat and completions, streaming and
not, n = 2, logprobs, a stop token, a JSON schema), a client disconnect, and the protocol's RPCs
directly. One scheduler (tiny model, no detokenizer: smg detokenizes) and one smg for the module.
Greedy output through smg is compared with the protocol's own Generate for the same prompt ids (which
equals the in-process engine's: tests/scheduler/test_scheduler_service.py), and with what
ringserve's tokenizer would send for the same chat.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sglang_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sglang_grpc

from bench.smg_server import model_id, smg_binary, smg_cmd, wait_ready
from ringserve.process import ServiceProcess, free_port, python_cmd
from ringserve.text_tokenizer import TextTokenizer

pytestmark = pytest.mark.e2e


@dataclass
class Front:
    scheduler: ServiceProcess
    url: str               # smg's HTTP
    model: str             # the model name smg serves
    worker: str            # the scheduler's SGLang-protocol HOST:PORT
    smg: ServiceProcess

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=60, max_retries=0)

    def stub(self) -> sglang_grpc.SglangSchedulerStub:
        return sglang_grpc.SglangSchedulerStub(grpc.insecure_channel(self.worker))


@pytest.fixture(scope="module")
def front(model_dir: str) -> Iterator[Front]:
    if smg_binary() is None:
        pytest.skip("smg is not installed (requirements-dev.txt: smg==1.13.0)")
    own, port, http_port = free_port(), free_port(), free_port()
    scheduler = ServiceProcess("scheduler", python_cmd(
        "services.scheduler", "--model", model_dir, "--port", str(own), "--metrics-port", "-1",
        "--detokenizer", "", "--sglang-grpc-port", str(port), "--max-total-tokens", "4096",
        "--grace-period-s", "2"), env={"RINGSERVE_LOG_LEVEL": "INFO"}).start()
    smg: ServiceProcess | None = None
    try:
        # Without a detokenizer both ports are SERVING once the model is warm.
        scheduler.wait_serving(f"127.0.0.1:{own}", timeout=180)
        scheduler.wait_serving(f"127.0.0.1:{port}", timeout=10)
        url = f"http://127.0.0.1:{http_port}"
        smg = ServiceProcess("smg", smg_cmd([f"127.0.0.1:{port}"], model_dir, http_port)).start()
        wait_ready(smg, url, timeout=60)
        yield Front(scheduler, url, model_id(url), f"127.0.0.1:{port}", smg)
    finally:
        if smg is not None:
            smg.stop()
        assert scheduler.stop(timeout=20) == 0, scheduler.output()[-3000:]


def _greedy(front: Front, ids: list[int], n: int) -> list[int]:
    """The scheduler's greedy ids through its SGLang port directly, without smg."""
    req = _request(f"ref-{time.monotonic_ns()}", ids, max_new_tokens=n, ignore_eos=True)
    (done,) = [m.complete for m in front.stub().Generate(req, timeout=30)]
    return list(done.output_ids)


def _generate(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    return out[0] if isinstance(out, list) else out


def test_greedy_output_equals_the_scheduler_s_for_the_same_token_ids(front: Front, model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    out = _generate(front.url, {"model": front.model, "input_ids": ids,
                                "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    assert out["output_ids"] == _greedy(front, ids, 12)
    assert out["text"] == tok.decode(out["output_ids"])
    assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_completions_are_sent_without_bos(front: Front, model_dir: str) -> None:
    """smg sends a completions prompt without the BOS ringserve's tokenizer adds: its output is the
    scheduler's for the prompt's ids without BOS."""
    tok = TextTokenizer.from_model(model_dir)
    ids = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") != ids, "the tiny model's tokenizer adds a BOS"
    r = front.client().completions.create(model=front.model, prompt="hello", max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text == tok.decode(_greedy(front, ids, 8))


def test_chat_prompt_is_the_chat_template_as_ringserve_renders_it(front: Front, model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "what is 2+2?"}]
    ids = tok.encode_chat([dict(m) for m in msgs])
    r = front.client().chat.completions.create(model=front.model, messages=msgs, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tok.decode(_greedy(front, ids, 8))


def test_chat_streaming_equals_not_streaming(front: Front) -> None:
    c = front.client()
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi there"}]
    full = c.chat.completions.create(model=front.model, messages=msgs, max_tokens=10, temperature=0)
    assert full.usage.completion_tokens >= 1
    chunks = list(c.chat.completions.create(model=front.model, messages=msgs, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    usage = [ch.usage for ch in chunks if ch.usage is not None][-1]
    assert usage.completion_tokens == full.usage.completion_tokens


def test_completions_streaming(front: Front) -> None:
    c = front.client()
    full = c.completions.create(model=front.model, prompt="once upon", max_tokens=10, temperature=0)
    parts = list(c.completions.create(model=front.model, prompt="once upon", max_tokens=10, temperature=0,
                                      stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10


def test_n2_with_logprobs(front: Front) -> None:
    r = front.client().chat.completions.create(model=front.model, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=6, temperature=1.0, n=2, logprobs=True, top_logprobs=2)
    assert sorted(ch.index for ch in r.choices) == [0, 1]
    for ch in r.choices:
        assert ch.logprobs is not None
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in ch.logprobs.content)
    # smg gives one logprob entry per piece of text, not per token: a token that ends inside a UTF-8
    # character comes out in one entry with the token that completes it (temperature 1 on the tiny model
    # samples such byte tokens), and EOS, which usage counts, has none. So a choice has at most as many
    # entries as tokens: 6 tokens on a length finish (SGLang checks the length first, so a 6th token
    # that is EOS also finishes "length"), fewer with a stop.
    tokens = [(6, 6) if ch.finish_reason == "length" else (len(ch.logprobs.content) + 1, 5) for ch in r.choices]
    for ch in r.choices:
        assert ch.finish_reason in ("length", "stop")
        assert 1 <= len(ch.logprobs.content) <= 6 if ch.finish_reason == "length" else len(ch.logprobs.content) <= 4
    assert r.usage is not None
    assert sum(lo for lo, _ in tokens) <= r.usage.completion_tokens <= sum(hi for _, hi in tokens)


def test_prompt_and_output_logprobs_native(front: Front, model_dir: str) -> None:
    ids = TextTokenizer.from_model(model_dir).encode("abc", add_special_tokens=False)
    out = _generate(front.url, {"model": front.model, "input_ids": ids, "return_logprob": True,
                                "logprob_start_len": 0, "top_logprobs_num": 1,
                                "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    meta = out["meta_info"]
    assert [t for _, t in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    assert [int(t) for _, t in meta["output_token_logprobs"]] == out["output_ids"]


def test_single_token_stop_ends_in_the_scheduler(front: Front, model_dir: str) -> None:
    """smg turns a one-token stop string into stop_token_ids: the scheduler stops there (the count is
    the worker's) and reports it as matched."""
    tok = TextTokenizer.from_model(model_dir)
    c = front.client()
    free = c.completions.create(model=front.model, prompt="hello", max_tokens=12, temperature=0, extra_body={
        "ignore_eos": True})
    first = tok.encode(free.choices[0].text, add_special_tokens=False)
    stop = tok.decode(first[2:3])
    assert len(tok.encode(stop, add_special_tokens=False)) == 1, "the stop must be one token"
    r = c.completions.create(model=front.model, prompt="hello", max_tokens=12, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 12
    assert stop not in r.choices[0].text


def test_json_schema(front: Front) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = front.client().chat.completions.create(
        model=front.model, messages=[{"role": "user", "content": "json"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)


def _running(front: Front) -> int:
    loads = front.stub().GetLoads(sglang_pb2.GetLoadsRequest(), timeout=5)
    return loads.loads[0].num_running_reqs + loads.loads[0].num_waiting_reqs


def test_client_disconnect_empties_the_running_batch(front: Front) -> None:
    body = {"model": front.model, "prompt": "stream on", "max_tokens": 100000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    mark = front.scheduler.lines_seen
    with httpx.stream("POST", f"{front.url}/v1/completions", json=body, timeout=60) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n >= 3:
                break  # leave with the request running
    # smg sends Abort("Stream dropped"), which ends the call; the engine frees the request at its next
    # step, and the load it reports follows at the end of that step.
    front.scheduler.wait_output("aborted by the client: Stream dropped", timeout=15, after=mark)
    deadline = time.monotonic() + 5
    while _running(front) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(front) == 0


# -- the protocol directly ---------------------------------------------------------------------------

def _request(rid: str, ids: list[int], stream: bool = False, **sp) -> sglang_pb2.GenerateRequest:
    params = sglang_pb2.SamplingParams(temperature=0, top_p=1, top_k=-1, repetition_penalty=1, n=1, **sp)
    return sglang_pb2.GenerateRequest(request_id=rid, tokenized=sglang_pb2.TokenizedInput(input_ids=ids),
                                      sampling_params=params, stream=stream, logprob_start_len=-1)


def test_startup_rpcs(front: Front, model_dir: str) -> None:
    stub = front.stub()
    assert stub.HealthCheck(sglang_pb2.HealthCheckRequest(), timeout=5).healthy
    info = stub.GetModelInfo(sglang_pb2.GetModelInfoRequest(), timeout=5)
    assert info.is_generation and info.max_context_length > 0 and info.vocab_size > 0
    assert info.tokenizer_path and json.load(open(f"{info.tokenizer_path}/tokenizer_config.json")) is not None
    server = stub.GetServerInfo(sglang_pb2.GetServerInfoRequest(), timeout=5)
    assert server.server_type == "grpc" and server.max_total_num_tokens > 0
    loads = stub.GetLoads(sglang_pb2.GetLoadsRequest(include=["core", "memory"]), timeout=5)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens > 0
    with pytest.raises(grpc.RpcError) as e:
        stub.GetLoads(sglang_pb2.GetLoadsRequest(include=["bogus"]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "include" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=5))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_generate_stream_chunks_and_complete(front: Front) -> None:
    out = list(front.stub().Generate(_request("direct-1", [5, 6, 7], stream=True, max_new_tokens=5,
                                              ignore_eos=True), timeout=30))
    chunks = [m.chunk for m in out if m.HasField("chunk")]
    done = [m.complete for m in out if m.HasField("complete")]
    assert len(done) == 1 and out[-1].HasField("complete")
    assert sum(len(c.token_ids) for c in chunks) == 5 == done[0].completion_tokens
    assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
    assert done[0].finish_reason == "length" and done[0].prompt_tokens == 3


def test_invalid_arguments_name_the_field(front: Front) -> None:
    stub = front.stub()
    cases = {
        "sampling_params.structural_tag": _request("bad-1", [5], structural_tag="{}"),
        "tokenized.input_ids": _request("bad-2", [10**7]),
        "sampling_params.top_p": sglang_pb2.GenerateRequest(  # proto3's 0, not a gateway's explicit 1
            request_id="bad-3", tokenized=sglang_pb2.TokenizedInput(input_ids=[5]),
            sampling_params=sglang_pb2.SamplingParams(top_p=0, n=1)),
        # refused by the grammar backend in the engine; the abort's status ends the call
        "sampling_params.regex": _request("bad-5", [5], regex="(", max_new_tokens=4),
        "lora_id": sglang_pb2.GenerateRequest(request_id="bad-4", lora_id="x",
                                              tokenized=sglang_pb2.TokenizedInput(input_ids=[5])),
    }
    for field, req in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert e.value.details().startswith(field), e.value.details()


def test_abort_ends_the_stream_at_once(front: Front) -> None:
    stub = front.stub()
    call = stub.Generate(_request("direct-abort", [5, 6], stream=True, max_new_tokens=100000, ignore_eos=True),
                         timeout=30)
    first = next(call)
    assert first.HasField("chunk")
    assert stub.Abort(sglang_pb2.AbortRequest(request_id="direct-abort", reason="test"), timeout=5).success
    rest = list(call)
    assert rest and rest[-1].HasField("complete") and rest[-1].complete.finish_reason == "abort"
    assert not stub.Abort(sglang_pb2.AbortRequest(request_id="direct-abort"), timeout=5).success
