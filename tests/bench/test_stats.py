"""The benchmark's own arithmetic: percentiles, summaries, stream timing, bench_serving parsing."""

from __future__ import annotations

import math

import pytest

from bench.bench_serving import parse_details
from bench.stats import RequestRecord, StreamTimer, percentile, summarize


def test_percentile_matches_numpy_linear() -> None:
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def test_summarize_throughput_and_latency() -> None:
    recs = [RequestRecord(ok=True, prompt_len=10, output_len=4, ttft=0.1, itls=[0.01, 0.02, 0.03], e2e=0.16),
            RequestRecord(ok=True, prompt_len=10, output_len=4, ttft=0.3, itls=[0.01, 0.01, 0.01], e2e=0.33),
            RequestRecord(ok=False, prompt_len=10, error="boom")]
    s = summarize(recs, duration_s=2.0)
    assert (s.completed, s.failed, s.first_error) == (2, 1, "boom")
    assert s.output_throughput == pytest.approx(4.0)
    assert s.total_throughput == pytest.approx(14.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.ttft_ms["p50"] == pytest.approx(200.0)
    assert s.itl_ms["mean"] == pytest.approx(15.0)


def test_stream_timer_splits_multi_token_chunks() -> None:
    t = StreamTimer(start=10.0)
    t.chunk(10.5, 2)   # first chunk: TTFT only
    t.chunk(10.7, 0)   # empty chunks are ignored
    t.chunk(10.9, 4)   # 0.4 s over 4 tokens
    rec = t.record(prompt_len=3, end=11.0)
    assert rec.ttft == pytest.approx(0.5)
    assert rec.itls == pytest.approx([0.1] * 4)
    assert (rec.output_len, rec.e2e) == (6, pytest.approx(1.0))


def test_parse_bench_serving_details_aligns_failures() -> None:
    result = {"input_lens": [5, 5, 5], "output_lens": [3, 3], "ttfts": [0.1, 0.0, 0.2],
              "itls": [[0.01, 0.02], [], [0.03, 0.03]], "errors": ["", "Bad Request: x", ""]}
    recs = parse_details(result)
    assert [r.ok for r in recs] == [True, False, True]
    assert recs[0].e2e == pytest.approx(0.13) and recs[2].output_len == 3
    assert recs[1].error == "Bad Request: x"


def test_tpot_ignores_chunking() -> None:
    recs = [RequestRecord(ok=True, prompt_len=1, output_len=5, ttft=0.1, itls=[0.0, 0.4], e2e=0.5)]
    assert summarize(recs, 1.0).tpot_ms["p50"] == pytest.approx(100.0)
