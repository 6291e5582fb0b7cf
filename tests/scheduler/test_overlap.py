"""Overlap scheduling (core/overlap.py): the one-step lag on sampled ids gives the same tokens as
running each step's forward in turn, and leaves the KV accounting as it was.

Every case runs the same requests on two engines of the tiny model, overlap on and off, and compares
tokens (and logprobs), then checks that no KV slot or req_to_token row is left held.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from ringserve.message import SamplingParams
from services.scheduler.config import EngineConfig
from services.scheduler.core import control
from services.scheduler.core.engine import Engine
from services.scheduler.core.overlap import FutureMap
from services.scheduler.core.req import Req
from services.scheduler.kvcache.memory_pool import ReqToTokenPool


def make(model: str, overlap: bool, **kw: object) -> Engine:
    cfg = {"model": model, "device": "cpu", "max_total_tokens": 4000, "max_running_requests": 16, **kw}
    e = Engine(EngineConfig(disable_overlap_schedule=not overlap, **cfg))  # type: ignore[arg-type]
    e.warmup()
    return e


@pytest.fixture(scope="module")
def engines(model_dir: str) -> Iterator[dict[bool, Engine]]:
    yield {True: make(model_dir, True), False: make(model_dir, False)}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 250) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def assert_released(e: Engine) -> None:
    """Nothing in flight, every row back, every slot free or in the radix cache (unlocked)."""
    assert e.overlap is None or not e.overlap.pending
    rows = e.kv.req_pool
    assert rows.available_size() == rows.size and rows.fence == 0
    assert e.kv.used_tokens() == 0
    e.kv.flush()
    assert e.kv.kv_pool.available_size() == e.kv.size


def both(engines: dict[bool, Engine], reqs: list[list[int]], params: list[SamplingParams], lag: bool = True,
         **kw: object) -> list[tuple[list[int], list[float | None], str]]:
    """Each request's (tokens, logprobs, finish), identical with and without overlap (the logprobs to
    1e-4: the dropped rows change the batches' shapes, and with them the last bits of the math)."""
    got = {}
    for on, e in engines.items():
        before = e.overlap.stats.overlapped if e.overlap else 0
        res = e.generate(reqs, params, **kw)  # type: ignore[arg-type]
        got[on] = [(r.output_ids, r.logprobs, str(r.finish)) for r in res]
        assert_released(e)
        if e.overlap is not None and lag:
            assert e.overlap.stats.overlapped > before  # the lag really ran
    for (ids, lps, fin), (ids0, lps0, fin0) in zip(got[True], got[False], strict=True):
        assert (ids, fin) == (ids0, fin0)
        assert lps == pytest.approx(lps0, abs=1e-4)
    return got[True]


def test_greedy_mixed_lengths_and_finishes(engines: dict[bool, Engine]) -> None:
    """Concurrent requests finishing at different steps (max tokens 1..20, a stop token, a stop
    string), with logprobs: a finish is known one step late, its extra token dropped."""
    ps = prompts(16)
    ref = engines[False].generate(ps[:1], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    stop_id = ref[0].output_ids[5]  # a token the first request samples: it stops there
    rng = random.Random(1)
    params = [SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 20), ignore_eos=True,
                             stop_token_ids=(stop_id,) if i % 3 == 0 else ()) for i in range(len(ps))]
    params[0] = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, stop_token_ids=(stop_id,))
    params[1] = SamplingParams(temperature=0.0, max_new_tokens=20, stop=("e",))
    out = both(engines, ps, params, return_logprob=True, top_logprobs_num=2)
    assert len(out[0][0]) <= 6 and out[0][0][-1] == stop_id
    assert [len(t) for t, _, _ in out] != [p.max_tokens for p in params]  # some stopped early
    assert all(len(lp) == len(t) for t, lp, _ in out)  # no logprob of a dropped token


def test_eos_and_n_samples(engines: dict[bool, Engine]) -> None:
    """EOS ends requests (the model's own, not ignored); n > 1 as the tokenizer expands it: the same
    prompt several times, sharing its prefix through the radix cache while they decode."""
    e = engines[False]
    eos = e.runner.eos_token_ids[0]
    ps = prompts(4, seed=2)
    params = [SamplingParams(temperature=0.0, max_new_tokens=20, logit_bias=((eos, 30.0),) if i == 0 else ())
              for i in range(len(ps))]  # the first samples EOS at once
    out = both(engines, ps + [ps[1]] * 3, params + [params[1]] * 3)
    assert out[0][0] == [eos]
    assert out[1] == out[4] == out[5] == out[6]


def test_chunked_prefill_retraction_and_mixed(model_dir: str) -> None:
    """Prompts cut into 16-token chunks, mixed prefill+decode steps, and a pool so small that decoding
    retracts (resolved first: a retracted request's recompute prompt is its output so far)."""
    ps = prompts(12, seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    kw = {"chunked_prefill_size": 16, "max_total_tokens": 260, "enable_mixed_chunk": True}
    es = {on: make(model_dir, on, **kw) for on in (True, False)}
    both(es, ps, [params] * len(ps))
    st = es[True].scheduler.stats
    assert st.retractions > 0 and st.mixed_steps > 0


def test_cpu_state_and_prompt_logprobs_run_without_lag(engines: dict[bool, Engine]) -> None:
    """Penalties, min_new_tokens and prompt logprobs need the previous token (or the prompt's KV
    position) at sampling: such steps resolve the forward in flight first, and the tokens still match.
    Seeded sampling draws in order on the worker: the same tokens too."""
    ps = prompts(6, seed=4)
    params = [SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, max_new_tokens=12, min_new_tokens=8),
              SamplingParams(temperature=0.9, max_new_tokens=12, seed=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_new_tokens=12, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)]
    synced = engines[True].overlap.stats.synced  # type: ignore[union-attr]
    both(engines, ps, params, lag=False)  # every batch holds one of them: none has the lag
    assert engines[True].overlap.stats.synced > synced  # type: ignore[union-attr]
    scored = {}
    for on, e in engines.items():
        res = e.generate(ps[:3], SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True),
                         return_logprob=True, logprob_start_len=0)
        scored[on] = [(r.output_ids, [t for t, _, _ in r.input_logprobs], [lp for _, lp, _ in r.input_logprobs])
                      for r in res]
        assert_released(e)
    for (ids, toks, lps), (ids0, toks0, lps0) in zip(scored[True], scored[False], strict=True):
        assert (ids, toks) == (ids0, toks0) and lps == pytest.approx(lps0, abs=1e-4, nan_ok=True)


def test_abort_and_pause_while_in_flight(engines: dict[bool, Engine]) -> None:
    """An abort applies while the forward is in flight (its token dropped, KV freed); a pause with
    retract resolves it first (the recompute prompt holds every token), and the outputs match."""
    results = {}
    for on, e in engines.items():
        reqs = [Req(rid=f"ab-{on}-{i}", origin_input_ids=p, params=SamplingParams(
            temperature=0.0, max_new_tokens=16, ignore_eos=True)) for i, p in enumerate(prompts(5, seed=5))]
        for r in reqs:
            e.submit(r)
        for _ in range(4):
            e.step()
        assert e.overlap is None or e.overlap.pending
        e.abort([reqs[0].rid])
        e.step()
        n0 = len(reqs[0].output_ids)
        assert control.pause(e, "retract") == 4
        assert e.overlap is None or not e.overlap.pending
        e.step()
        control.resume(e)
        while not all(r.finished for r in reqs):
            e.step()
        with e.locked():
            pass
        assert len(reqs[0].output_ids) == n0 and reqs[0].finished_reason.type == "abort"  # type: ignore[union-attr]
        results[on] = [r.output_ids for r in reqs[1:]]
        assert_released(e)
    assert results[True] == results[False]
    assert all(len(t) == 16 for t in results[True])


def test_a_finished_request_s_row_waits_for_the_forward_still_reading_it(engines: dict[bool, Engine]) -> None:
    """A finishes at its first token; the decode launched before that was known still reads A's
    req_to_token row, so B, admitted meanwhile, must not be given that row (B would be, without the
    fence: the free list hands out the last row freed)."""
    e = engines[True]
    one = SamplingParams(temperature=0.0, max_new_tokens=1)
    a = Req(rid="fence-a", origin_input_ids=[5, 6, 7, 8], params=one)
    e.submit(a)
    e.step()  # A's prefill launched
    row = a.req_pool_idx
    e.step()  # A's extra decode launched, then its prefill resolved: A finished, row freed
    assert a.finished and row is not None
    b = Req(rid="fence-b", origin_input_ids=[9, 10, 11], params=one)
    e.submit(b)
    e.step()  # B's prefill scheduled while A's decode is in flight
    assert b.req_pool_idx is not None and b.req_pool_idx != row
    while not b.finished:
        e.step()
    with e.locked():
        pass
    assert_released(e)


def test_a_failed_forward_fails_every_later_step(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's exception reaches the step that resolves it, and every step after (Engine.run
    then exits the process), even when a control call resolved it on another thread."""
    e = make(model_dir, True)
    e.submit(Req(rid="boom", origin_input_ids=[5, 6, 7], params=SamplingParams(temperature=0.0, max_new_tokens=8)))

    def broken(batch: object) -> torch.Tensor:
        raise ValueError("kernel fault")

    monkeypatch.setattr(e.runner, "forward", broken)
    e.step()  # launched; the fault is on the worker
    with pytest.raises(ValueError, match="kernel fault"):
        e.flush_cache()
    with pytest.raises(RuntimeError, match="failed on the worker"):
        e.step()


def test_future_map_resolves_placeholders() -> None:
    fm = FutureMap(2, torch.device("cpu"))
    a = fm.reserve(3)
    assert all(p < 0 for p in a) and len(set(a)) == 3
    fm.store(a, [11, 12, 13])
    ids = torch.tensor([5, a[2], 7, a[0]])
    assert fm.resolve(ids).tolist() == [5, 13, 7, 11]
    assert len(set(fm.reserve(8)) | set(a)) == 8  # the ring wraps after 4 x rows


def test_rows_freed_in_flight_wait_for_their_forward() -> None:
    pool = ReqToTokenPool(4, 8, torch.device("cpu"))
    rows = [pool.alloc() for _ in range(3)]
    pool.fence = 1
    pool.free(rows[0])  # read by forward 1, in flight
    pool.fence = 2
    pool.free(rows[1])  # read by forward 2
    assert pool.available_size() == 1
    pool.passed(1)
    assert pool.available_size() == 2
    pool.passed(2)
    pool.fence = 0
    pool.free(rows[2])  # nothing in flight: at once
    assert pool.available_size() == 4
