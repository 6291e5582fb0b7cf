"""bench.ring_cpu's accounting (the run itself needs bench_serving's venv: `make bench-ring`)."""

from __future__ import annotations

import math
import os
import time

from bench.hop_floor import Floor
from bench.ring_cpu import RunCpu, ServiceCpu, cpu_seconds, measure, split, table
from bench.stats import RequestRecord
from bench.workloads import Workload


def test_split_shares_the_load_with_distinct_seeds() -> None:
    parts = split(Workload("B", "t", num_prompts=256, max_concurrency=64, seed=2), 2)
    assert [p.num_prompts for p in parts] == [128, 128]
    assert [p.max_concurrency for p in parts] == [32, 32]
    assert len({p.seed for p in parts}) == 2


def test_measure_charges_the_cpu_a_run_burns() -> None:
    def burn() -> tuple[list[RequestRecord], float]:
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        return [RequestRecord(ok=True, prompt_len=4, output_len=1000),
                RequestRecord(ok=False, prompt_len=4, error="x")], 1.0

    run = measure({"gateway": [os.getpid()]}, burn, "t")
    assert run.output_tokens == 1000 and run.failed == 1
    (gw,) = run.services
    assert 0.25 <= gw.cpu_s < 2.0
    assert 250 <= gw.us_per_token < 2000  # 0.3 s over 1000 tokens
    assert cpu_seconds(os.getpid()) > 0


def test_table_sums_the_ring_and_keeps_the_scheduler_apart() -> None:
    run = RunCpu("ringserve x1", 1000, 2.0, 0, [ServiceCpu("gateway", 1, 0.01, 1000),
                                                ServiceCpu("tokenizer", 1, 0.02, 1000),
                                                ServiceCpu("detokenizer", 1, 0.03, 1000),
                                                ServiceCpu("scheduler", 1, 0.5, 1000)], rows_per_step=21.26,
                  floors=[Floor("tcp", 24.0, 21, 70.0, 140.0), Floor("grpc", 24.0, 21, 170.0, 187.0)])
    vllm = RunCpu("vllm", 100, 1.0, 0, [ServiceCpu("vllm-api-server", 1, 0.02, 100)])
    assert math.isclose(run.ring_us_per_token(), 60.0)
    assert run.tok_s == 500
    assert math.isclose(run.floor("grpc"), (2 * 170 + 187) / 21) and math.isclose(run.floor("tcp"), 280 / 21)
    assert math.isnan(vllm.floor("grpc"))
    text = table([run, vllm])
    assert "| ringserve x1 | 1,000 | 500 | 21.3 | 10.0 | 20.0 | 30.0 | 60.0 | 25.1 | 13.3 | 500.0 |  |" in text
    assert "| vllm | 100 | 100 |  |  |  |  |  |  |  |  | 200.0 |" in text
    assert run.to_dict()["floor_us_per_token"] == {"tcp": 280 / 21, "grpc": 527 / 21}
