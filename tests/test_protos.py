"""A protobuf round trip per service boundary, and the packed encoding of token ids."""

from __future__ import annotations

from ringserve.v1 import api_pb2, common_pb2, detokenizer_pb2, scheduler_pb2


def roundtrip(msg):
    back = type(msg)()
    back.ParseFromString(msg.SerializeToString())
    assert back == msg
    return back


def test_public_api_generate_roundtrip() -> None:
    req = api_pb2.GenerateRequest(
        rid="r1", text="你好", stream=True, return_logprob=True, top_logprobs_num=3,
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=8, stop=["\n"], n=2))
    back = roundtrip(req)
    assert back.WhichOneof("input") == "text"
    # `optional` keeps an explicit zero distinguishable from "unset" (temperature defaults to 1.0).
    assert back.sampling_params.HasField("temperature") and back.sampling_params.temperature == 0.0
    assert not back.sampling_params.HasField("top_p")
    chat = api_pb2.GenerateRequest(chat=api_pb2.ChatInput(messages=[api_pb2.ChatMessage(role="user", content="hi")]))
    assert roundtrip(chat).chat.messages[0].content == "hi"
    resp = api_pb2.GenerateResponse(rid="r1", text="x", output_ids=[1, 2], finished=True, meta_info=api_pb2.MetaInfo(
        finish_reason=common_pb2.FinishReason(type="stop", matched_str="\n")))
    assert roundtrip(resp).meta_info.finish_reason.WhichOneof("matched") == "matched_str"


def test_scheduler_connect_roundtrip() -> None:
    msg = scheduler_pb2.ConnectRequest(
        hello=scheduler_pb2.Hello(owner="tok-1"),
        requests=[scheduler_pb2.TokenizedRequest(rid="a", owner="tok-1", input_ids=list(range(100)))],
        abort_rids=["b"])
    assert list(roundtrip(msg).requests[0].input_ids) == list(range(100))
    resp = scheduler_pb2.ConnectResponse(load=scheduler_pb2.LoadReport(num_running_reqs=3, token_usage=0.5),
                                         rejections=[scheduler_pb2.Rejection(rid="c", status_code=8)])
    assert roundtrip(resp).rejections[0].status_code == 8


def test_detokenizer_push_and_subscribe_roundtrip() -> None:
    push = detokenizer_pb2.PushRequest(scheduler_id="s0", batch=detokenizer_pb2.StepBatch(deltas=[
        detokenizer_pb2.TokenDelta(rid="a", offset=5, ids=[7],
                                   params=detokenizer_pb2.DecodeParams(
                                       owner="tok-1", sampling_params=common_pb2.SamplingParams(stop=["x"])))]))
    assert roundtrip(push).batch.deltas[0].params.owner == "tok-1"
    sub = detokenizer_pb2.SubscribeResponse(deltas=[detokenizer_pb2.TextDelta(
        rid="a", token_offset=5, ids=[7], text_offset=9, text="é",
        finish=common_pb2.FinishReason(type="length"))])
    assert roundtrip(sub).deltas[0].text == "é"


def test_token_ids_are_packed() -> None:
    # 1000 small ids must cost about 2 bytes each (packed varints), not a tag per id.
    delta = detokenizer_pb2.TokenDelta(ids=[1000] * 1000)
    assert len(delta.SerializeToString()) < 2 * 1000 + 16


def test_buf_lint_passes() -> None:
    """`make lint`: buf's STANDARD rules over protos/ (needs npx and the npm registry)."""
    import shutil
    import subprocess

    import pytest

    from tests.conftest import ROOT

    if shutil.which("npx") is None:
        pytest.skip("npx not installed")
    out = subprocess.run(["npx", "--yes", "@bufbuild/buf", "lint", "protos"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "npm ERR" in out.stderr + out.stdout:
        pytest.skip(f"could not install buf: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stdout + out.stderr
