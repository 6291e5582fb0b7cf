"""Generate against the real InferenceService with fake scheduler and detokenizer servers."""

from __future__ import annotations

import math

import grpc
import pytest

from ringserve.v1 import api_pb2, common_pb2

from .fakes import FAIL_STOP, REJECT_STOP, fake_text


def gen_request(text: str = "hello world", max_new_tokens: int = 8, stream: bool = True,
                **kw) -> api_pb2.GenerateRequest:
    sp = kw.pop("sampling_params", None) or common_pb2.SamplingParams(max_new_tokens=max_new_tokens)
    return api_pb2.GenerateRequest(text=text, sampling_params=sp, stream=stream, **kw)


def prompt_ids(ring, text: str = "hello world") -> list[int]:
    return ring.tokenizer.encode(text)


def test_stream_generate(ring, client):
    msgs = list(client.Generate(gen_request(rid="s1", max_new_tokens=8), timeout=10))
    ids = prompt_ids(ring)
    assert "".join(m.text for m in msgs) == fake_text(ids, 8)
    assert len(msgs) == 8 and [m.finished for m in msgs] == [False] * 7 + [True]
    assert [m.meta_info.completion_tokens for m in msgs] == list(range(1, 9))
    final = msgs[-1]
    assert final.rid == "s1" and final.meta_info.prompt_tokens == len(ids)
    assert final.meta_info.finish_reason.type == "length" and final.meta_info.e2e_latency > 0
    assert not final.meta_info.HasField("timings")
    sent = ring.recorder.requests[0]
    assert sent.rid == "s1" and list(sent.input_ids) == ids and sent.sampling_params.max_new_tokens == 8
    assert sent.owner == ring.tokenizers[0].cfg.tokenizer_id


def test_non_stream_generate_with_logprobs_and_timings(ring, client):
    req = gen_request(rid="ns", max_new_tokens=5, stream=False, return_logprob=True, top_logprobs_num=2,
                      return_timings=True)
    msgs = list(client.Generate(req, timeout=10))
    assert len(msgs) == 1
    m = msgs[0]
    assert m.finished and m.text == fake_text(prompt_ids(ring), 5) and len(m.output_ids) == 5
    assert len(m.logprobs) == 5 and len(m.logprobs[0].top_logprobs) == 2
    assert m.logprobs[0].token == ring.tokenizer.token_texts([m.output_ids[0]])[0]
    assert m.logprobs[0].top_logprobs[1].token == ring.tokenizer.token_texts([m.output_ids[0] + 1])[0]
    t = m.meta_info.timings
    assert t.queue_s == pytest.approx(0.001) and t.e2e_s > 0 and t.ttft_s > 0 and t.tokenize_s > 0


def test_generated_rid_and_chat_input(ring, client):
    chat = api_pb2.ChatInput(messages=[api_pb2.ChatMessage(role="user", content="hi")])
    req = api_pb2.GenerateRequest(chat=chat, sampling_params=common_pb2.SamplingParams(max_new_tokens=3))
    (m,) = list(client.Generate(req, timeout=10))
    assert len(m.rid) >= 16  # a generated uuid
    ids = ring.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert m.text == fake_text(ids, 3)


def test_n3_expands_with_seeds(ring, client):
    sp = common_pb2.SamplingParams(max_new_tokens=4, n=3, seed=5)
    msgs = list(client.Generate(gen_request(rid="multi", sampling_params=sp, stream=True), timeout=10))
    ids = prompt_ids(ring)
    by_index = {i: "".join(m.text for m in msgs if m.index == i) for i in range(3)}
    assert by_index == {i: fake_text(ids, 4, 5 + i) for i in range(3)}
    assert sum(m.finished for m in msgs) == 3 and all(m.rid == "multi" for m in msgs)
    sent = {r.rid: r.sampling_params.seed for r in ring.recorder.requests}
    assert sent == {"multi-0": 5, "multi-1": 6, "multi-2": 7}


def test_constraint_reaches_the_scheduler_on_every_sample(ring, client):
    sp = common_pb2.SamplingParams(max_new_tokens=4, n=2, regex="[a-z]+")
    msgs = list(client.Generate(gen_request(rid="re", sampling_params=sp, stream=False), timeout=10))
    assert sorted(m.index for m in msgs) == [0, 1]
    sent = {r.rid: r.sampling_params for r in ring.recorder.requests}
    assert set(sent) == {"re-0", "re-1"}
    for p in sent.values():
        assert p.HasField("regex") and p.regex == "[a-z]+"
        assert not p.HasField("json_schema") and not p.HasField("ebnf")


def test_n3_non_stream_gives_one_final_per_sample(ring, client):
    sp = common_pb2.SamplingParams(max_new_tokens=4, n=3)
    msgs = list(client.Generate(gen_request(rid="m2", sampling_params=sp, stream=False), timeout=10))
    assert sorted(m.index for m in msgs) == [0, 1, 2] and all(m.finished for m in msgs)


def server_info(client) -> api_pb2.GetServerInfoResponse:
    return client.GetServerInfo(api_pb2.GetServerInfoRequest(), timeout=5)


def test_cancel_aborts_at_scheduler(ring, client):
    ring.options.step_s = 0.01
    call = client.Generate(gen_request(rid="c1", max_new_tokens=1000), timeout=30)
    next(call), next(call)
    assert server_info(client).rid_to_state_size == 1
    call.cancel()
    assert ring.recorder.wait_for(lambda: "c1" in ring.recorder.aborts, 5)
    assert server_info(client).rid_to_state_size == 0


def test_deadline_aborts_at_scheduler(ring, client):
    ring.options.step_s = 0.01
    with pytest.raises(grpc.RpcError) as e:
        list(client.Generate(gen_request(rid="d1", max_new_tokens=1000), timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ring.recorder.wait_for(lambda: "d1" in ring.recorder.aborts, 5)
    assert ring.recorder.wait_for(lambda: "d1" not in ring.options.running, 5)
    assert server_info(client).rid_to_state_size == 0


def test_abort_rpc_ends_all_samples(ring, client):
    ring.options.step_s = 0.01
    sp = common_pb2.SamplingParams(max_new_tokens=1000, n=2)
    call = client.Generate(gen_request(rid="ab", sampling_params=sp), timeout=30)
    next(call)
    assert client.Abort(api_pb2.AbortRequest(rid="ab"), timeout=5).found
    rest = list(call)
    finals = [m for m in rest if m.finished]
    assert sorted(m.index for m in finals) == [0, 1]
    assert all(m.meta_info.finish_reason.type == "abort" for m in finals)
    assert ring.recorder.wait_for(lambda: {"ab-0", "ab-1"} <= set(ring.recorder.aborts), 5)
    assert not client.Abort(api_pb2.AbortRequest(rid="ab"), timeout=5).found
    assert server_info(client).rid_to_state_size == 0


def test_duplicate_live_rid_is_already_exists(ring, client):
    ring.options.step_s = 0.01
    call = client.Generate(gen_request(rid="dup", max_new_tokens=1000), timeout=30)
    next(call)
    with pytest.raises(grpc.RpcError) as e:
        list(client.Generate(gen_request(rid="dup"), timeout=5))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()


def test_rejection_and_engine_abort_end_with_their_status(ring, client):
    sp = common_pb2.SamplingParams(max_new_tokens=4, stop=[REJECT_STOP])
    with pytest.raises(grpc.RpcError) as e:
        list(client.Generate(gen_request(rid="rej", sampling_params=sp), timeout=5))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    sp = common_pb2.SamplingParams(max_new_tokens=4, stop=[FAIL_STOP])
    with pytest.raises(grpc.RpcError) as e:
        list(client.Generate(gen_request(rid="fail", sampling_params=sp), timeout=5))
    assert e.value.code() == grpc.StatusCode.INTERNAL and "engine exploded" in e.value.details()
    assert server_info(client).rid_to_state_size == 0


def test_resync_duplicates_do_not_duplicate_text(ring, client):
    ring.options.resend_from_zero = True
    msgs = list(client.Generate(gen_request(rid="rs", max_new_tokens=12), timeout=10))
    assert "".join(m.text for m in msgs) == fake_text(prompt_ids(ring), 12)
    assert sum(len(m.output_ids) for m in msgs) == 12
    assert msgs[-1].meta_info.completion_tokens == 12


@pytest.mark.parametrize("resend", [False, True])
def test_prompt_logprobs_come_once_with_token_texts(ring, client, resend):
    ring.options.resend_from_zero = resend  # resync re-sends them: the client still gets them once
    ids = prompt_ids(ring)
    req = gen_request(rid=f"pl{resend}", max_new_tokens=4, return_logprob=True, top_logprobs_num=1, logprob_start_len=0)
    msgs = list(client.Generate(req, timeout=10))
    assert ring.recorder.requests[-1].logprob_start_len == 0
    firsts = [m for m in msgs if m.input_logprobs]
    assert len(firsts) == 1 and firsts[0] is msgs[0]
    lps = firsts[0].input_logprobs
    assert [lp.token_id for lp in lps] == ids and math.isnan(lps[0].logprob) and lps[1].logprob == -1.0
    assert [lp.token for lp in lps] == ring.tokenizer.token_texts(ids)
    assert lps[1].top_logprobs[0].token == ring.tokenizer.token_texts([ids[1]])[0]
    # Without return_logprob nothing is scored (SGLang's rule), and nothing reaches the scheduler.
    list(client.Generate(gen_request(rid=f"np{resend}", max_new_tokens=2, logprob_start_len=0), timeout=10))
    assert not ring.recorder.requests[-1].HasField("logprob_start_len")


BAD = [
    ("sampling_params.temperature", dict(sampling_params=common_pb2.SamplingParams(temperature=-1))),
    ("sampling_params.top_p", dict(sampling_params=common_pb2.SamplingParams(top_p=0))),
    ("sampling_params.top_k", dict(sampling_params=common_pb2.SamplingParams(top_k=-2))),
    ("sampling_params.n", dict(sampling_params=common_pb2.SamplingParams(n=17))),
    ("sampling_params.json_schema", dict(sampling_params=common_pb2.SamplingParams(json_schema="{bad"))),
    ("sampling_params.regex", dict(sampling_params=common_pb2.SamplingParams(regex="a", ebnf="root ::= x"))),
    ("sampling_params.max_new_tokens", dict(text="hi", sampling_params=common_pb2.SamplingParams(max_new_tokens=5000))),
    ("text", dict(text="")),
    ("input_ids", dict(input_ids=api_pb2.TokenIds(ids=[1, 99999]))),
    ("top_logprobs_num", dict(top_logprobs_num=21, return_logprob=True)),
    ("logprob_start_len", dict(logprob_start_len=-2, return_logprob=True)),
    ("input", dict()),
]


@pytest.mark.parametrize("field,kw", BAD, ids=[b[0] for b in BAD])
def test_invalid_requests_never_reach_scheduler(ring, client, field, kw):
    req = api_pb2.GenerateRequest(rid="bad", **kw)
    with pytest.raises(grpc.RpcError) as e:
        list(client.Generate(req, timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()
    assert ring.recorder.requests == []
    assert server_info(client).rid_to_state_size == 0


def test_model_mismatch_is_not_found(ring, client):
    with pytest.raises(grpc.RpcError) as e:
        list(client.Generate(gen_request(model="gpt-9"), timeout=5))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details().startswith("model:")


def test_chat_template_error_is_invalid_argument(ring, client):
    chat = api_pb2.ChatInput(messages=[api_pb2.ChatMessage(role="assistant", content="x")],
                             continue_final_message=True)
    req = api_pb2.GenerateRequest(chat=chat)
    _ = ring.tokenizer.chat_template  # the default model has one
    chat_bad = api_pb2.GenerateRequest(chat=api_pb2.ChatInput())
    with pytest.raises(grpc.RpcError) as e:
        list(client.Generate(chat_bad, timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("chat.messages:")
    del req
