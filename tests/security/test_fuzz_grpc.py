"""Hypothesis fuzzing of the public gRPC API (tokenizer InferenceService.Generate) on a real ring.

Random field values (floats incl. NaN/inf/huge/negative, ints over each field's whole width, ids
out of vocabulary, random chat messages and stop strings), and raw random bytes as the request:
every call ends with OK or a client-error status, never INTERNAL/UNKNOWN or a hang, and the
tokenizer (and the scheduler behind it) stays SERVING.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve import probe
from ringserve.v1 import api_pb2, api_pb2_grpc, common_pb2
from tests.resilience.cluster import Svc, cluster

pytestmark = pytest.mark.e2e

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
CALL_TIMEOUT_S = 60.0
GENERATE = "/ringserve.v1.InferenceService/Generate"

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, 1.0, -1.0, 1e30, -1e30, math.nan, math.inf, -math.inf, 1e-45])
SMALL_TOKENS = st.integers(0, 12)  # most valid requests must finish in a few steps on a CPU
TEXT = st.text(max_size=40)
RARE_TEXT = st.integers(0, 9).flatmap(lambda i: TEXT if i == 0 else st.just(""))  # mostly the default
IDS = st.lists(st.integers(-5, 5000) | INT32, max_size=20)  # vocab is 4096: some in, some out


def opt(s: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | s


@st.composite
def sampling(draw: st.DrawFn) -> common_pb2.SamplingParams:
    sp = common_pb2.SamplingParams(
        min_p=draw(FLOATS), frequency_penalty=draw(FLOATS), presence_penalty=draw(FLOATS),
        min_new_tokens=draw(SMALL_TOKENS | UINT32), stop=draw(st.lists(TEXT, max_size=20)),
        stop_token_ids=draw(st.lists(INT32 | st.integers(0, 5000), max_size=5)), ignore_eos=draw(st.booleans()),
        no_stop_trim=draw(st.booleans()),
        logit_bias=draw(st.dictionaries(INT32 | st.integers(0, 5000), FLOATS, max_size=4)),
        # Random patterns: invalid ones, empty matches and nested repeats are refused at intake.
        stop_regex=draw(st.lists(TEXT | st.sampled_from(["(a+)+$", "x*", "[", "\\d", "(?=a)"]), max_size=2)))
    for name, strat in (("temperature", FLOATS), ("top_p", FLOATS), ("top_k", INT32 | st.integers(-2, 50)),
                        ("repetition_penalty", FLOATS), ("max_new_tokens", SMALL_TOKENS | UINT32),
                        ("skip_special_tokens", st.booleans()), ("spaces_between_special_tokens", st.booleans()),
                        ("seed", st.integers(-(2**63), 2**63 - 1)), ("n", st.integers(0, 20) | UINT32),
                        ("json_schema", TEXT | st.just('{"type": "object"}')), ("regex", TEXT),
                        ("ebnf", TEXT)):
        value = draw(opt(strat))
        # Constrained decoding is one field at a time when set at all (compiling grammars is slow).
        if value is not None and (name not in ("json_schema", "regex", "ebnf") or draw(st.integers(0, 9)) == 0):
            setattr(sp, name, value)
    return sp


@st.composite
def requests(draw: st.DrawFn) -> api_pb2.GenerateRequest:
    req = api_pb2.GenerateRequest(rid=draw(st.just("") | TEXT), stream=draw(st.booleans()),
                                  return_logprob=draw(st.booleans()),
                                  top_logprobs_num=draw(st.integers(0, 25) | UINT32),
                                  return_timings=draw(st.booleans()),
                                  model=draw(RARE_TEXT))
    kind = draw(st.sampled_from(["text", "ids", "chat", "none"]))
    if kind == "text":
        req.text = draw(TEXT)
    elif kind == "ids":
        req.input_ids.ids.extend(draw(IDS))
    elif kind == "chat":
        msgs = draw(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool", ""]) | TEXT, TEXT),
                             max_size=4))
        req.chat.messages.extend(api_pb2.ChatMessage(role=r, content=c) for r, c in msgs)
        if draw(st.booleans()):
            req.chat.add_generation_prompt = draw(st.booleans())
        req.chat.continue_final_message = draw(st.booleans())
    if draw(st.booleans()):
        req.sampling_params.CopyFrom(draw(sampling()))
    return req


@pytest.fixture(scope="module")
def tok(model_dir: str) -> Iterator[Svc]:
    with cluster(model_dir) as c:
        _, _, tok = c.ring()
        yield tok


def _outcome(call: object) -> grpc.StatusCode:
    try:
        for _ in call:  # type: ignore[attr-defined]
            pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_random_generate_requests(tok: Svc) -> None:
    seen: collections.Counter[str] = collections.Counter()
    bad: list[str] = []
    with grpc.insecure_channel(tok.target) as ch:
        stub = api_pb2_grpc.InferenceServiceStub(ch)

        @settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(req=requests())
        def run(req: api_pb2.GenerateRequest) -> None:
            code = _outcome(stub.Generate(req, timeout=CALL_TIMEOUT_S))
            seen[code.name] += 1
            if code not in ALLOWED:
                bad.append(f"{code.name}: {req}")

        run()
    print(f"grpc fuzz: {sum(seen.values())} requests -> {dict(seen)}")
    assert not bad, "\n---\n".join(bad[:10])
    assert seen["OK"] > 0 and seen["INVALID_ARGUMENT"] > 0
    assert probe.check(tok.target) and not tok.errors(), tok.errors()


def test_random_bytes_as_the_request(tok: Svc) -> None:
    seen: collections.Counter[str] = collections.Counter()
    bad: list[str] = []
    with grpc.insecure_channel(tok.target) as ch:
        # No serializers: the bytes go on the wire as they are.
        raw: grpc.UnaryStreamMultiCallable[bytes, bytes] = ch.unary_stream(GENERATE, request_serializer=None,
                                                                          response_deserializer=None)

        @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(body=st.binary(max_size=200) | requests().map(lambda r: r.SerializeToString()[::-1]))
        def run(body: bytes) -> None:
            code = _outcome(raw(body, timeout=CALL_TIMEOUT_S))
            seen[code.name] += 1
            if code not in ALLOWED:
                bad.append(f"{code.name}: {body!r}")

        run()
    print(f"raw-bytes fuzz: {sum(seen.values())} bodies -> {dict(seen)}")
    assert not bad, "\n".join(bad[:10])
    assert probe.check(tok.target)
