"""Constrained decoding through the in-process Engine: the grammar queue in front of `waiting`, the
mask before sampling, the matcher after it, and what happens on retraction, abort and timeout."""

from __future__ import annotations

import json
import random
import re
import threading
import uuid

import grpc
import jsonschema
import pytest

from ringserve.text_tokenizer import TextTokenizer
from services.scheduler.config import EngineConfig
from services.scheduler.core.engine import Engine
from services.scheduler.core.req import Req
from services.scheduler.grammar import GrammarCache, GrammarQueue
from services.scheduler.model_executor.sampling import SamplingParams

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
WORD = r"[a-z]{3,12}"


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Engine:
    e = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=6000, max_running_requests=32))
    e.warmup()
    return e


@pytest.fixture(scope="module")
def tok(model_dir: str) -> TextTokenizer:
    return TextTokenizer.from_model(model_dir)


@pytest.fixture(autouse=True)
def idle_after(engine: Engine):
    yield
    assert not engine.has_work() and len(engine.grammar) == 0
    engine.tree.check()


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def text_of(tok: TextTokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def test_constrained_rows_do_not_change_unconstrained_ones(engine: Engine, tok: TextTokenizer) -> None:
    prompts = [rand_ids(12 + i, i) for i in range(4)]
    plain = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    alone = engine.generate(prompts, plain)
    schema = SamplingParams(temperature=0.9, seed=7, max_new_tokens=200, json_schema=json.dumps(SCHEMA))
    regex = SamplingParams(temperature=1.0, seed=8, max_new_tokens=64, regex=WORD)
    mixed = engine.generate(prompts + [rand_ids(10, 50), rand_ids(10, 51)], [plain] * 4 + [schema, regex])
    assert [r.output_ids for r in mixed[:4]] == [r.output_ids for r in alone]
    assert all(r.finish.type == "length" for r in mixed[:4])
    js, rx = mixed[4], mixed[5]
    assert js.finish.type == "stop" and rx.finish.type == "stop"
    jsonschema.validate(json.loads(text_of(tok, js.output_ids)), SCHEMA)
    assert re.fullmatch(WORD, text_of(tok, rx.output_ids))


def test_same_constraint_many_samples_each_own_matcher(engine: Engine, tok: TextTokenizer) -> None:
    """One compile (the cache), n matchers: samples at different positions must not share state."""
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=200, json_schema=json.dumps(SCHEMA))
              for s in range(6)]
    outs = engine.generate([rand_ids(8, 3)] * 6, params)
    assert len({tuple(r.output_ids) for r in outs}) > 1
    for r in outs:
        assert r.finish.type == "stop", r.finish
        jsonschema.validate(json.loads(text_of(tok, r.output_ids)), SCHEMA)


def test_min_new_tokens_does_not_fight_the_grammar(engine: Engine, tok: TextTokenizer) -> None:
    """The grammar allows only EOS after "yes": masking EOS for min_new_tokens would leave nothing."""
    (r,) = engine.generate([rand_ids(6, 4)], SamplingParams(temperature=1.0, seed=1, max_new_tokens=16,
                                                           min_new_tokens=10, regex="(yes|no)"))
    assert r.finish.type == "stop" and text_of(tok, r.output_ids) in ("yes", "no")


def test_ignore_eos_still_ends_at_the_grammar_end(engine: Engine, tok: TextTokenizer) -> None:
    (r,) = engine.generate([rand_ids(6, 5)], SamplingParams(temperature=1.0, seed=2, max_new_tokens=32,
                                                           ignore_eos=True, regex="[0-9]{4}"))
    assert r.finish.type == "stop" and r.finish.matched_token in engine.runner.eos_token_ids
    assert re.fullmatch("[0-9]{4}", text_of(tok, r.output_ids))


@pytest.mark.parametrize("kind,text", [("json_schema", '{"type": "nope"}'), ("regex", "(ab"),
                                       ("ebnf", "root ::= (")])
def test_invalid_constraint_aborts_with_invalid_argument(engine: Engine, kind: str, text: str) -> None:
    ok, bad = engine.generate([rand_ids(6, 6)] * 2, [SamplingParams(temperature=0.0, max_new_tokens=4),
                                                     SamplingParams(max_new_tokens=4, **{kind: text})])  # type: ignore[arg-type]
    assert ok.finish.type == "length"
    assert bad.finish.type == "abort" and bad.finish.status == grpc.StatusCode.INVALID_ARGUMENT and not bad.output_ids
    assert bad.finish.message.startswith(f"sampling_params.{kind}: ")


def test_disabled_backend_refuses_with_unimplemented(engine: Engine, monkeypatch) -> None:
    monkeypatch.setattr(engine.grammar, "queue", None)
    (r,) = engine.generate([rand_ids(6, 7)], SamplingParams(max_new_tokens=4, regex="a+"))
    assert r.finish.type == "abort" and r.finish.status == grpc.StatusCode.UNIMPLEMENTED
    assert r.finish.message == "sampling_params.regex: constrained decoding is disabled"


class GatedBackend:
    """Wraps a backend; compiling `blocked` waits for the gate (a compile that outlives its timeout)."""

    def __init__(self, inner, blocked: str) -> None:
        self.inner, self.blocked = inner, blocked
        self.gate = threading.Event()
        self.vocab_size = inner.vocab_size

    def compile(self, kind, text):
        if text == self.blocked:
            self.gate.wait(30)
        return self.inner.compile(kind, text)


def test_abort_while_in_the_grammar_queue(engine: Engine, monkeypatch) -> None:
    glue = engine.grammar
    slow = f"[a-z]+{uuid.uuid4().hex}"
    gated = GatedBackend(glue.queue.backend, slow)
    queue = GrammarQueue(gated, GrammarCache(), timeout_s=30, on_ready=engine.wake)  # type: ignore[arg-type]
    monkeypatch.setattr(glue, "queue", queue)
    try:
        engine.submit(Req(rid="gq", origin_input_ids=rand_ids(6, 8),
                          params=SamplingParams(max_new_tokens=8, regex=slow)))
        assert engine.step() == []
        assert "gq" in glue.reqs and "gq" in queue and not engine.scheduler.waiting
        assert engine.load().num_queue_reqs == 1  # load reports count grammar-queue requests
        assert not engine.scheduler.has_work() and engine.has_work()  # idle loop waits, drain does not
        engine.abort(["gq"])
        assert engine.step() == []  # an abort emits nothing
        assert "gq" not in glue.reqs and "gq" not in queue and engine.load().num_queue_reqs == 0
    finally:
        gated.gate.set()
        queue.close()


def test_compile_timeout_aborts_only_that_request(engine: Engine, tok: TextTokenizer, monkeypatch) -> None:
    glue = engine.grammar
    slow = f"[a-z]+{uuid.uuid4().hex}"
    gated = GatedBackend(glue.queue.backend, slow)
    queue = GrammarQueue(gated, GrammarCache(), timeout_s=0.5, on_ready=engine.wake)  # type: ignore[arg-type]
    monkeypatch.setattr(glue, "queue", queue)
    try:
        outs = engine.generate([rand_ids(6, 9)] * 3, [
            SamplingParams(max_new_tokens=8, regex=slow),
            SamplingParams(temperature=1.0, seed=3, max_new_tokens=64, regex=WORD),
            SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)])
    finally:
        gated.gate.set()
        queue.close()
    timed_out, word, plain = outs
    assert timed_out.finish.type == "abort" and timed_out.finish.status == grpc.StatusCode.DEADLINE_EXCEEDED
    assert timed_out.finish.message.startswith("sampling_params.regex: ") and not timed_out.output_ids
    assert word.finish.type == "stop" and re.fullmatch(WORD, text_of(tok, word.output_ids))
    assert plain.finish.type == "length" and len(plain.output_ids) == 8


def test_retracted_grammar_requests_keep_their_matcher(model_dir: str, tok: TextTokenizer) -> None:
    """A KV pool too small for the batch: decode retracts requests mid-output; their prefill again
    must continue the grammar where it stopped, not restart it."""
    e = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=300, max_running_requests=16))
    # About 60 tokens each, more than the 0.7 * max_new_tokens that admission reserves: four such
    # requests admitted together outgrow the pool in decode.
    pattern = r"[a-z]{30}( [a-z]{30}){7}"
    reqs = [Req(rid=f"rt-{i}", origin_input_ids=rand_ids(20, 100 + i),
                params=SamplingParams(temperature=1.0, seed=i, max_new_tokens=80, regex=pattern))
            for i in range(4)]
    for r in reqs:
        e.submit(r)
    for _ in range(2000):
        if not e.has_work():
            break
        if not e.scheduler.has_work():
            e.wait_for_work(0.05)
        e.step()
    assert not e.has_work()
    assert e.scheduler.stats.retractions > 0 and any(r.num_retractions for r in reqs)
    for r in reqs:
        assert r.finished_reason.type == "stop", (r.rid, r.finished_reason)
        assert re.fullmatch(pattern, text_of(tok, r.output_ids)), r.rid
        assert r.grammar is None  # dropped at finish
    e.tree.check()
