"""SGLang's scheduler protocol at the scheduler's edge: requests in (checked, every refusal naming its
field), outputs out (chunks, completes), and the per-request output sinks (direct_sink.py)."""

from __future__ import annotations

import asyncio
import math

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb2

from ringserve.errors import InvalidArgument
from ringserve.message import Finish, Logprob, StepBatch, TokenDelta
from services.scheduler.rpc.direct_sink import DirectStream, OutputRouter, merge
from services.scheduler.rpc.sglang_convert import GenerateCall, ModelFacts, chunk_pb, complete_pb

FACTS = ModelFacts(vocab_size=1000, max_seq_len=64)


def _sp(**kw) -> pb2.SamplingParams:
    """What smg sends: every field explicit."""
    base = dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1,
                skip_special_tokens=True, spaces_between_special_tokens=True)
    return pb2.SamplingParams(**{**base, **kw})


def _req(ids=(1, 2, 3), **kw) -> pb2.GenerateRequest:
    sp = kw.pop("sampling_params", _sp())
    return pb2.GenerateRequest(request_id=kw.pop("request_id", "r1"), tokenized=pb2.TokenizedInput(input_ids=ids),
                               sampling_params=sp, logprob_start_len=kw.pop("logprob_start_len", -1), **kw)


def test_defaults_as_smg_sends_them() -> None:
    call = GenerateCall.from_pb(_req(sampling_params=_sp(max_new_tokens=5, stop_token_ids=[7])), FACTS)
    (sp,) = call.samplings
    assert call.input_ids == [1, 2, 3] and not call.stream and call.logprob_start_len == -1
    assert sp.is_greedy and sp.max_new_tokens == 5 and sp.stop_token_ids == (7,) and sp.top_k == -1


def test_max_new_tokens_unset_is_the_rest_of_the_context_and_too_many_are_capped() -> None:
    assert GenerateCall.from_pb(_req(), FACTS).samplings[0].max_new_tokens == 64 - 3
    capped = GenerateCall.from_pb(_req(sampling_params=_sp(max_new_tokens=10**6)), FACTS)
    assert capped.samplings[0].max_new_tokens == 61


def test_n_expands_into_samples_and_zero_repetition_penalty_means_none() -> None:
    call = GenerateCall.from_pb(_req(sampling_params=_sp(n=3, temperature=0.7, repetition_penalty=0.0)), FACTS)
    assert call.n == 3 and all(s.n == 1 and s.repetition_penalty == 1.0 for s in call.samplings)
    reqs = call.reqs(["a", "b", "c"], "owner")
    assert [r.rid for r in reqs] == ["a", "b", "c"] and all(r.origin_input_ids == [1, 2, 3] for r in reqs)


@pytest.mark.parametrize(("constraint", "field", "value"), [
    ("regex", "regex", "[ab]+"), ("json_schema", "json_schema", "{}"), ("ebnf_grammar", "ebnf", 'root ::= "x"')])
def test_constraints_map_to_the_grammar_backend(constraint: str, field: str, value: str) -> None:
    sp = GenerateCall.from_pb(_req(sampling_params=_sp(**{constraint: value})), FACTS).samplings[0]
    assert getattr(sp, field) == value


def test_logprob_start_len_counts_only_with_return_logprob() -> None:
    assert GenerateCall.from_pb(_req(logprob_start_len=0), FACTS).logprob_start_len == -1
    call = GenerateCall.from_pb(_req(logprob_start_len=1, return_logprob=True, top_logprobs_num=2), FACTS)
    assert call.logprob_start_len == 1 and call.top_logprobs_num == 2


def test_logit_bias_keys_are_token_ids() -> None:
    sp = GenerateCall.from_pb(_req(sampling_params=_sp(logit_bias={"5": 1.5, "2": -3.0})), FACTS).samplings[0]
    assert sp.logit_bias == ((2, -3.0), (5, 1.5))


@pytest.mark.parametrize(("field", "req"), [
    ("request_id", _req(request_id="")),
    ("tokenized.input_ids", _req(ids=[])),
    ("tokenized.input_ids", _req(ids=[1000])),
    ("tokenized.input_ids", _req(ids=list(range(64)))),
    ("sampling_params.structural_tag", _req(sampling_params=_sp(structural_tag="{}"))),
    ("sampling_params.top_p", _req(sampling_params=_sp(top_p=0.0))),
    ("sampling_params.temperature", _req(sampling_params=_sp(temperature=-1.0))),
    ("sampling_params.logit_bias", _req(sampling_params=_sp(logit_bias={"x": 1.0}))),
    ("sampling_params.logit_bias", _req(sampling_params=_sp(logit_bias={"5000": 1.0}))),
    ("sampling_params.stop_token_ids[0]", _req(sampling_params=_sp(stop_token_ids=[4000]))),
    ("sampling_params.min_new_tokens", _req(sampling_params=_sp(max_new_tokens=2, min_new_tokens=3))),
    ("sampling_params.n", _req(sampling_params=_sp(n=17))),
    ("sampling_params.json_schema", _req(sampling_params=_sp(json_schema="{nope"))),
    ("sampling_params.custom_params", _req(sampling_params=_sp(custom_params={"a": 1}))),
    ("top_logprobs_num", _req(top_logprobs_num=21)),
    ("logprob_start_len", _req(return_logprob=True, logprob_start_len=3)),
    ("lora_id", _req(lora_id="adapter")),
    ("mm_inputs", _req(mm_inputs=pb2.MultimodalInputs(image_urls=["x"]))),
    ("input_embeds", _req(input_embeds=[0.5])),
    ("return_hidden_states", _req(return_hidden_states=True)),
    ("disaggregated_params", _req(disaggregated_params=pb2.DisaggregatedParams(bootstrap_host="h"))),
    ("token_ids_logprob", _req(token_ids_logprob=[1])),
    ("data_parallel_rank", _req(data_parallel_rank=1)),
    ("require_reasoning", _req(require_reasoning=True)),
])
def test_refusals_name_the_field(field: str, req: pb2.GenerateRequest) -> None:
    with pytest.raises(InvalidArgument) as e:
        GenerateCall.from_pb(req, FACTS)
    assert e.value.field == field or e.value.message.startswith(field)


def test_rank_zero_is_accepted() -> None:
    assert GenerateCall.from_pb(_req(data_parallel_rank=0), FACTS).n == 1


# -- out ---------------------------------------------------------------------------------------------

def test_chunk_counts_are_cumulative_and_logprobs_ride_along() -> None:
    call = GenerateCall.from_pb(_req(return_logprob=True, top_logprobs_num=1, logprob_start_len=0), FACTS)
    d = TokenDelta(rid="x", ids=[8, 9], offset=3, cached_tokens=2,
                   logprobs=[Logprob(8, -0.5, ((8, -0.5),)), Logprob(9, -1.0, ((4, -0.9),))],
                   input_logprobs=[Logprob(1, math.nan), Logprob(2, -2.0, ((2, -2.0),))])
    c = chunk_pb(call, 1, d).chunk
    assert list(c.token_ids) == [8, 9] and c.completion_tokens == 5 and c.prompt_tokens == 3 and c.index == 1
    assert c.cached_tokens == 2 and list(c.output_logprobs.token_ids) == [8, 9]
    assert [list(t.token_ids) for t in c.output_logprobs.top_logprobs] == [[8], [4]]
    assert not c.input_logprobs.token_logprobs[0].HasField("value")
    assert c.input_logprobs.token_logprobs[1].value == -2.0


def test_complete_reports_finish_reason_and_matched_stop() -> None:
    call = GenerateCall.from_pb(_req(), FACTS)
    done = complete_pb(call, 0, TokenDelta(rid="x", ids=[5], offset=4, finish=Finish("stop", matched_token=5))).complete
    assert done.finish_reason == "stop" and done.matched_token_id == 5 and done.completion_tokens == 5
    assert list(done.output_ids) == [5] and not done.HasField("output_logprobs")
    done = complete_pb(call, 0, TokenDelta(rid="x", ids=[], finish=Finish("stop", matched_str="\n\n"))).complete
    assert done.matched_stop_str == "\n\n"
    done = complete_pb(call, 0, TokenDelta(rid="x", ids=[1], finish=Finish("length"))).complete
    assert done.finish_reason == "length" and done.WhichOneof("matched_stop") is None


# -- sinks -------------------------------------------------------------------------------------------

def test_merge_keeps_order_and_the_last_finish() -> None:
    a = TokenDelta(rid="x", ids=[1], offset=0, logprobs=[Logprob(1, -1.0)], input_logprobs=[Logprob(0, math.nan)])
    b = TokenDelta(rid="x", ids=[2, 3], offset=1, logprobs=[Logprob(2, -2.0), Logprob(3, -3.0)],
                   finish=Finish("length"))
    m = merge(a, b)
    assert m.ids == [1, 2, 3] and m.offset == 0 and [lp.token_id for lp in m.logprobs] == [1, 2, 3]
    assert m.finish == Finish("length") and len(m.input_logprobs) == 1


async def test_router_sends_direct_deltas_to_their_stream_and_the_rest_on() -> None:
    router = OutputRouter()
    stream = DirectStream(asyncio.get_running_loop())
    rids = [router.rid("req", i, 2) for i in range(2)]
    router.register(rids, stream)
    other = TokenDelta(rid="tokenizer-rid", ids=[9])
    rest = router.route(StepBatch([TokenDelta(rid=rids[1], ids=[1]), other, TokenDelta(rid=rids[1], ids=[2])]))
    assert rest.deltas == [other]
    got = await stream.take()
    assert list(got) == [1] and got[1].ids == [1, 2]
    # A resync re-sends full state for a detokenizer: direct requests have no part in it.
    assert router.route(StepBatch([TokenDelta(rid=rids[0], ids=[5], offset=0)], resync=True)).deltas == []
    # After the call ended, a late delta of its request is dropped, not pushed to the detokenizer.
    router.unregister(rids)
    assert router.route(StepBatch([TokenDelta(rid=rids[0], ids=[6])])).deltas == []
    assert len(router) == 0


async def test_stream_cancel_wakes_the_reader() -> None:
    stream = DirectStream(asyncio.get_running_loop())
    waiter = asyncio.create_task(stream.take())
    await asyncio.sleep(0)
    stream.cancel("Stream dropped")
    assert await asyncio.wait_for(waiter, 1) == {} and stream.cancelled == "Stream dropped"


def test_rids_of_two_processes_do_not_collide() -> None:
    assert OutputRouter().rid("a", 0, 1) != OutputRouter().rid("a", 0, 1)


def test_config_needs_somewhere_for_outputs() -> None:
    from services.scheduler.config import SchedulerServerConfig

    with pytest.raises(ValueError, match="detokenizer"):
        SchedulerServerConfig(detokenizer="")
    assert SchedulerServerConfig(detokenizer="", sglang_grpc_port=0).sglang_grpc_port == 0
    with pytest.raises(ValueError, match="sglang_grpc_port"):
        SchedulerServerConfig(sglang_grpc_port=70000)


# -- the servicer's Generate / Abort with a fake engine ------------------------------------------------

class FakeRunner:
    vocab_size = 1000


class FakeEngine:
    """What the servicer uses of the Engine: submit (refusing after `capacity`), abort; the test plays
    the engine thread by routing deltas itself."""

    def __init__(self, capacity: int = 8) -> None:
        self.runner = FakeRunner()
        self.max_prompt_tokens = 63
        self.capacity = capacity
        self.submitted: list = []
        self.aborted: list[str] = []

    def submit(self, req) -> None:
        from services.scheduler.core.inbox import QueueFull

        if len(self.submitted) >= self.capacity:
            raise QueueFull("queue full")
        self.submitted.append(req)

    def abort(self, rids: list[str]) -> None:
        self.aborted += rids


def _servicer(engine: FakeEngine):
    from services.scheduler.config import SchedulerServerConfig
    from services.scheduler.rpc.sglang_servicer import SglangServicer

    router = OutputRouter()
    cfg = SchedulerServerConfig(detokenizer="", sglang_grpc_port=0)
    return SglangServicer(lambda: engine, router, cfg, info=lambda: None, last_step=lambda: 0.0), router  # type: ignore[arg-type, return-value]


async def _until(pred, loop_turns: int = 100) -> None:
    for _ in range(loop_turns):
        if pred():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def test_a_full_queue_is_resource_exhausted_and_the_samples_already_in_are_aborted() -> None:
    from services.scheduler.core.inbox import QueueFull

    engine = FakeEngine(capacity=1)
    servicer, router = _servicer(engine)
    gen = servicer.Generate(_req(sampling_params=_sp(n=2, temperature=1.0)), None)
    with pytest.raises(QueueFull):
        await anext(gen)
    assert engine.aborted == [engine.submitted[0].rid] and len(router) == 0


async def test_generate_streams_then_completes_each_sample() -> None:
    engine = FakeEngine()
    servicer, router = _servicer(engine)
    gen = servicer.Generate(_req(sampling_params=_sp(n=2, temperature=1.0), stream=True), None)
    first = asyncio.ensure_future(anext(gen))
    await _until(lambda: len(engine.submitted) == 2)
    r0, r1 = (r.rid for r in engine.submitted)
    router.route(StepBatch([TokenDelta(rid=r0, ids=[4]), TokenDelta(rid=r1, ids=[5], finish=Finish("length"))]))
    out = [await first]
    router.route(StepBatch([TokenDelta(rid=r0, ids=[6], offset=1, finish=Finish("stop", matched_token=6))]))
    out += [m async for m in gen]
    kinds = [(m.WhichOneof("response"), getattr(m, m.WhichOneof("response")).index) for m in out]
    assert kinds == [("chunk", 0), ("chunk", 1), ("complete", 1), ("chunk", 0), ("complete", 0)]
    assert out[-1].complete.matched_token_id == 6 and out[-1].complete.completion_tokens == 2
    assert engine.aborted == [] and len(router) == 0


async def test_abort_ends_the_call_and_a_dropped_call_aborts_its_requests() -> None:
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg

    engine = FakeEngine()
    servicer, router = _servicer(engine)
    gen = servicer.Generate(_req(request_id="a", stream=True), None)
    nxt = asyncio.ensure_future(anext(gen))
    await _until(lambda: len(engine.submitted) == 1)
    resp = await servicer.Abort(sg.AbortRequest(request_id="a", reason="Stream dropped"), None)
    assert resp.success
    done = await nxt
    assert done.complete.finish_reason == "abort"
    assert [m async for m in gen] == [] and engine.aborted == [engine.submitted[0].rid]
    # A call that goes away (client cancel) aborts what it submitted.
    gen2 = servicer.Generate(_req(request_id="b", stream=True), None)
    nxt2 = asyncio.ensure_future(anext(gen2))
    await _until(lambda: len(engine.submitted) == 2)
    nxt2.cancel()
    await asyncio.gather(nxt2, return_exceptions=True)
    await gen2.aclose()
    assert engine.aborted[-1] == engine.submitted[1].rid and len(router) == 0


async def test_an_abort_with_a_status_ends_the_call_with_it() -> None:
    import grpc

    from ringserve.errors import ServiceError

    engine = FakeEngine()
    servicer, router = _servicer(engine)
    gen = servicer.Generate(_req(sampling_params=_sp(regex="(")), None)
    nxt = asyncio.ensure_future(anext(gen))
    await _until(lambda: len(engine.submitted) == 1)
    f = Finish.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.regex: does not compile")
    router.route(StepBatch([TokenDelta(rid=engine.submitted[0].rid, ids=[], finish=f)]))
    with pytest.raises(ServiceError) as e:
        await nxt
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("sampling_params.regex")
