"""The scheduler through the in-process Engine: prefix reuse, aborts, finish rules, streaming, control."""

from __future__ import annotations

import random
import re

import pytest

from ringserve.errors import InvalidArgument
from ringserve.text_tokenizer import TextTokenizer
from services.scheduler.config import EngineConfig
from services.scheduler.core.engine import Engine, QueueFull
from services.scheduler.core.req import Req
from services.scheduler.model_executor.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Engine:
    e = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=6000, max_running_requests=32,
                            max_queued_requests=8))
    e.warmup()
    return e


@pytest.fixture(autouse=True)
def idle_after(engine: Engine):
    yield
    assert not engine.has_work()
    engine.tree.check()


def rand_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_shared_prefix_is_served_from_the_radix_cache(engine: Engine) -> None:
    prefix = rand_ids(400, 1)
    a, = engine.generate([prefix + rand_ids(10, 2)], greedy(max_new_tokens=4))
    assert a.cached_tokens == 0
    before = engine.scheduler.stats.prefill_tokens
    b_prompt = prefix + rand_ids(20, 3)
    b, = engine.generate([b_prompt], greedy(max_new_tokens=4))
    assert b.cached_tokens >= 384
    # Its prefill computed only what was not cached.
    assert engine.scheduler.stats.prefill_tokens - before == len(b_prompt) - b.cached_tokens
    # Same prompt again: all but the last token is cached (logits need one computed token).
    c, = engine.generate([b_prompt], greedy(max_new_tokens=4))
    assert c.cached_tokens == len(b_prompt) - 1 and c.output_ids == b.output_ids


def test_abort_running_request_frees_its_kv(engine: Engine) -> None:
    # Free or evictable: the prompt stays in the radix cache (as in SGLang), but nothing holds it.
    pool = engine.kv.kv_pool
    free_before = engine.kv.available()
    engine.submit(Req(rid="long", origin_input_ids=rand_ids(50, 4), params=greedy(max_new_tokens=500, ignore_eos=True),
                      stream=True))
    for _ in range(5):
        engine.step()
    assert pool.available_size() < free_before and engine.load().num_running_reqs == 1
    engine.abort(["long"])
    out = engine.step()
    assert all(o.rid != "long" for o in out)  # nothing more is emitted for an aborted request
    assert engine.kv.available() == free_before
    assert engine.load().num_running_reqs == 0 and engine.load().num_used_tokens == 0


def test_abort_owner_removes_waiting_and_running(engine: Engine) -> None:
    free_before = engine.kv.kv_pool.available_size()
    for i in range(3):
        engine.submit(Req(rid=f"o{i}", owner="tok-A", origin_input_ids=rand_ids(30, 10 + i),
                          params=greedy(max_new_tokens=300, ignore_eos=True)))
    engine.submit(Req(rid="other", owner="tok-B", origin_input_ids=rand_ids(30, 20), params=greedy(max_new_tokens=3)))
    engine.step()
    engine.abort_owner("tok-A")
    finished = []
    while engine.has_work():
        finished += [o.rid for o in engine.step() if o.finish]
    assert finished == ["other"]
    assert engine.kv.kv_pool.available_size() + engine.tree.evictable_size() >= free_before


def test_max_new_tokens_and_stop_token_ids(engine: Engine) -> None:
    prompt = rand_ids(40, 5)
    base, = engine.generate([prompt], greedy(max_new_tokens=12, ignore_eos=True))
    assert len(base.output_ids) == 12 and base.finish.type == "length"
    stop_id = base.output_ids[5]
    r, = engine.generate([prompt], greedy(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)))
    first = base.output_ids.index(stop_id)
    assert r.output_ids == base.output_ids[:first + 1]
    assert r.finish.type == "stop" and r.finish.matched_token == stop_id


def test_min_new_tokens_holds_back_stop_ids(engine: Engine) -> None:
    prompt = rand_ids(40, 5)
    base, = engine.generate([prompt], greedy(max_new_tokens=12, ignore_eos=True))
    stop_id = base.output_ids[0]
    r, = engine.generate([prompt], greedy(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,),
                                          min_new_tokens=4))
    assert len(r.output_ids) >= 4
    assert stop_id not in r.output_ids[:4]
    early, = engine.generate([prompt], greedy(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)))
    assert early.output_ids == [stop_id]


def test_stop_string_ends_on_the_token_that_completes_it(engine: Engine, model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    prompt = tok.encode("你好，世界！The scheduler decides every finish.")
    base, = engine.generate([prompt], greedy(max_new_tokens=30, ignore_eos=True))
    text = tok.decode(base.output_ids)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip() and "\ufffd" not in stop
    r, = engine.generate([prompt], greedy(max_new_tokens=30, ignore_eos=True, stop=(stop,)))
    assert r.finish.type == "stop" and r.finish.matched_str == stop
    assert stop in tok.decode(r.output_ids)
    assert stop not in tok.decode(r.output_ids[:-1])  # no token past the one that completed it
    assert r.output_ids == base.output_ids[:len(r.output_ids)]


def test_stop_regex_ends_on_the_token_that_completes_a_match(engine: Engine, model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    prompt = tok.encode("你好，世界！The scheduler decides every finish.")
    base, = engine.generate([prompt], greedy(max_new_tokens=30, ignore_eos=True))
    text = tok.decode(base.output_ids)
    piece = text[len(text) // 2: len(text) // 2 + 2]
    assert piece.strip() and "\ufffd" not in piece
    pattern = re.escape(piece[0]) + "."  # the piece's first character and whatever follows it
    r, = engine.generate([prompt], greedy(max_new_tokens=30, ignore_eos=True, stop_regex=(pattern,)))
    assert r.finish.type == "stop" and r.finish.matched_str == pattern
    out = tok.decode(r.output_ids)
    m = re.search(pattern, out)
    assert m is not None and not re.search(pattern, tok.decode(r.output_ids[:-1]))
    assert r.finish.trim_chars == len(out) - m.start()
    assert r.output_ids == base.output_ids[:len(r.output_ids)]


def test_logit_bias_forces_a_token_in_a_running_batch(engine: Engine) -> None:
    forced = 1234
    prompts = [rand_ids(12, 40), rand_ids(15, 41), rand_ids(9, 42)]
    base = engine.generate(prompts, greedy(max_new_tokens=6, ignore_eos=True))
    params = [greedy(max_new_tokens=6, ignore_eos=True, logit_bias=((forced, 100.0),)),
              greedy(max_new_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_new_tokens=6, ignore_eos=True,
                             logit_bias=((forced, 100.0),))]
    a, b, c = engine.generate(prompts, params)  # one batch: biased and unbiased rows side by side
    assert a.output_ids == [forced] * 6 and c.output_ids == [forced] * 6
    assert b.output_ids == base[1].output_ids  # the unbiased row is untouched


def test_streaming_emits_every_step_and_params_once(engine: Engine) -> None:
    engine.submit(Req(rid="s1", owner="o", origin_input_ids=rand_ids(20, 6), params=greedy(max_new_tokens=5),
                      stream=True))
    engine.submit(Req(rid="n1", owner="o", origin_input_ids=rand_ids(20, 7), params=greedy(max_new_tokens=5)))
    by_rid: dict[str, list] = {"s1": [], "n1": []}
    while engine.has_work():
        for o in engine.step():
            by_rid[o.rid].append(o)
    s = by_rid["s1"]
    assert [len(o.ids) for o in s] == [1] * 5 and [o.offset for o in s] == list(range(5))
    assert s[0].params is not None and all(o.params is None for o in s[1:])
    assert s[-1].finish is not None and s[-1].timings is not None
    n, = by_rid["n1"]  # non-streaming: once, at finish, with all ids
    assert n.offset == 0 and len(n.ids) == 5 and n.finish is not None and n.params is not None


def test_stream_interval_batches_tokens_but_not_the_first_or_the_last(engine: Engine) -> None:
    engine.scheduler.stream_interval = 4
    try:
        engine.submit(Req(rid="s4", owner="o", origin_input_ids=rand_ids(20, 16), params=greedy(max_new_tokens=10),
                          stream=True))
        outs = []
        while engine.has_work():
            outs.extend(engine.step())
    finally:
        engine.scheduler.stream_interval = 1
    # First token at once, then every 4, the remainder with the finish; contiguous offsets.
    assert [len(o.ids) for o in outs] == [1, 4, 4, 1]
    assert [o.offset for o in outs] == [0, 1, 5, 9]
    assert outs[-1].finish is not None and all(o.finish is None for o in outs[:-1])


def test_resync_returns_full_state(engine: Engine) -> None:
    engine.submit(Req(rid="r1", owner="own", origin_input_ids=rand_ids(20, 8),
                      params=greedy(max_new_tokens=50, ignore_eos=True), stream=True))
    for _ in range(4):
        engine.step()
    (live,) = [o for o in engine.resync("own") if o.rid == "r1"]
    assert live.offset == 0 and len(live.ids) == 4 and live.params is not None and live.finish is None
    assert all(o.rid != "r1" for o in engine.resync("someone-else"))
    ok, msg = engine.flush_cache()
    assert not ok and "running" in msg  # refused while anything runs
    engine.abort(["r1"])
    engine.step()
    ok, _ = engine.flush_cache()
    assert ok and engine.tree.total_size() == 0
    assert engine.kv.kv_pool.available_size() == engine.kv.size


def test_queue_limit_and_bad_prompt(engine: Engine) -> None:
    for i in range(8):
        engine.submit(Req(rid=f"q{i}", origin_input_ids=[5, 6], params=greedy(max_new_tokens=1)))
    with pytest.raises(QueueFull):
        engine.submit(Req(rid="q-over", origin_input_ids=[5, 6], params=greedy(max_new_tokens=1)))
    while engine.has_work():
        engine.step()
    with pytest.raises(InvalidArgument):  # refused at submit, the one channel (a Rejection when served)
        engine.submit(Req(rid="empty", origin_input_ids=[], params=greedy()))


def test_lpm_and_fcfs_give_the_same_greedy_tokens(model_dir: str, engine: Engine) -> None:
    prefix = rand_ids(60, 9)
    prompts = [prefix + rand_ids(5 + i, 30 + i) if i % 2 else rand_ids(10 + i, 40 + i) for i in range(10)]
    fcfs = engine.generate(prompts, greedy(max_new_tokens=6, ignore_eos=True))
    lpm = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=2000, schedule_policy="lpm"))
    got = lpm.generate(prompts, greedy(max_new_tokens=6, ignore_eos=True))
    assert [r.output_ids for r in got] == [r.output_ids for r in fcfs]
    lpm.tree.check()


def test_step_profile_counts_steps_time_and_decode_rows(engine: Engine) -> None:
    st = engine.scheduler.stats
    before = (st.prefill_steps, st.decode_steps, st.prefill_s, st.decode_s, st.decode_rows, st.dropped_tokens)
    outs = engine.generate([rand_ids(20, 40), rand_ids(30, 41)], greedy(max_new_tokens=5))
    steps_p, steps_d = st.prefill_steps - before[0], st.decode_steps - before[1]
    assert steps_p >= 1 and steps_d >= 4 and st.prefill_s > before[2] and st.decode_s > before[3]
    # Each request's first token comes from its prefill, the other four from decode steps; with
    # overlap scheduling each also decodes once more before its finish is known (dropped).
    dropped = st.dropped_tokens - before[5]
    assert dropped == (2 if engine.overlap is not None else 0)
    assert st.decode_rows - before[4] - dropped == sum(len(o.output_ids) - 1 for o in outs) == 8
    load = engine.stats()  # the snapshot the metrics read
    assert (load.prefill_steps, load.decode_steps, load.decode_rows) == (st.prefill_steps, st.decode_steps,
                                                                         st.decode_rows)


def test_a_decode_step_follows_each_prefill_step_while_requests_run(model_dir: str) -> None:
    def run(interleave: bool) -> tuple[str, dict[str, list[int]]]:
        e = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=2000, chunked_prefill_size=32,
                                disable_decode_interleave=not interleave))
        params = greedy(max_new_tokens=12, ignore_eos=True)
        e.submit(Req(rid="r0", origin_input_ids=rand_ids(20, 60), params=params))
        outs: dict[str, list[int]]
        kinds, outs = "", {}

        def step() -> None:
            nonlocal kinds
            before = e.scheduler.stats.prefill_steps
            for o in e.step():
                outs.setdefault(o.rid, []).extend(o.ids)
            kinds += "P" if e.scheduler.stats.prefill_steps > before else "D"
        step()
        for i in range(3):  # 90 prompt tokens: three 32-token chunks
            e.submit(Req(rid=f"r{i + 1}", origin_input_ids=rand_ids(30, 61 + i), params=params))
        while e.has_work():
            step()
        return kinds, outs

    kinds, outs = run(True)
    assert kinds.startswith("PDPDPDPD") and kinds.count("P") == 4
    kinds_off, outs_off = run(False)
    assert kinds_off.startswith("PPPPD") and kinds_off.count("P") == 4
    assert outs == outs_off and all(len(ids) == 12 for ids in outs.values())


def test_schedule_conservativeness_scales_what_a_prefill_admits(model_dir: str) -> None:
    """SGLang's --schedule-conservativeness: below 1 the running requests are expected to use less of
    max_new_tokens, so one prefill admits more of a burst, which then outgrows the pool and retracts;
    the greedy tokens are the same either way."""
    def run(conservativeness: float) -> tuple[int, int, dict[str, list[int]]]:
        e = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=600,
                                schedule_conservativeness=conservativeness))
        params = greedy(max_new_tokens=100, ignore_eos=True)
        for i in range(8):
            e.submit(Req(rid=f"r{i}", origin_input_ids=rand_ids(20, 80 + i), params=params))
        outs: dict[str, list[int]] = {}
        for o in e.step():
            outs.setdefault(o.rid, []).extend(o.ids)
        admitted = len(e.scheduler.running)
        while e.has_work():
            for o in e.step():
                outs.setdefault(o.rid, []).extend(o.ids)
        return admitted, e.scheduler.stats.retractions, outs

    admitted, _, outs = run(1.0)
    eager, retractions, outs_eager = run(0.2)
    assert admitted < eager == 8 and retractions > 0
    assert outs == outs_eager and all(len(ids) == 100 for ids in outs.values())
    with pytest.raises(ValueError, match="schedule_conservativeness"):
        EngineConfig(model=model_dir, schedule_conservativeness=0)
