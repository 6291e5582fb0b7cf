"""Workload shapes and prompt generation for the gRPC and engine targets."""

from __future__ import annotations

import math

from bench.workloads import Workload, arrival_times, make_prompts, select, workloads


def test_random_ids_prompts_have_exact_lengths_and_are_deterministic() -> None:
    w = Workload("A", "t", num_prompts=5, input_len=17)
    p = make_prompts(w, vocab_size=100, special_ids={0, 1})
    assert len(p) == 5 and all(len(x) == 17 for x in p)
    assert p == make_prompts(w, vocab_size=100, special_ids={0, 1})
    assert all(0 <= t < 100 for x in p for t in x)


def test_shared_prefix_prompts_share_their_group_prefix() -> None:
    w = Workload("C", "t", dataset="generated-shared-prefix", num_prompts=6, gsp_groups=2, gsp_per_group=3,
                 gsp_system_len=8, gsp_question_len=4)
    p = make_prompts(w, vocab_size=50, special_ids={0, 1, 2})
    assert len(p) == 6 and all(len(x) == 12 for x in p)
    assert p[0][:8] == p[1][:8] == p[2][:8] != p[3][:8]
    assert not {0, 1, 2} & {t for x in p for t in x}


def test_arrivals_all_at_once_or_poisson() -> None:
    assert arrival_times(Workload("A", "t", num_prompts=3)) == [0.0, 0.0, 0.0]
    ts = arrival_times(Workload("D", "t", num_prompts=200, request_rate=10.0))
    assert ts == sorted(ts) and ts[0] == 0.0
    assert 10.0 < ts[-1] < 30.0  # about 200 / 10 s


def test_every_workload_is_consistent_and_selectable() -> None:
    for quick in (True, False):
        wls = workloads(quick)
        assert [w.family for w in wls][:3] == ["A", "B", "C"]
        assert len({w.seed for w in wls}) == len(wls)  # no prompt repeats across runs on one server
        for w in wls:
            if w.dataset == "generated-shared-prefix":
                assert w.num_prompts == w.gsp_groups * w.gsp_per_group
            assert "--seed" in w.bench_serving_args()
        assert [w.name for w in select(wls, ["D"])] == [w.name for w in wls if w.family == "D"]
        assert all(not math.isinf(w.request_rate) for w in select(wls, ["D"]))


def test_repeats_and_targets_on_one_server_draw_distinct_prompts() -> None:
    from pathlib import Path

    from bench.stats import RequestRecord
    from bench.targets import RunResult, Runs, _measure

    seeds: list[int] = []
    warmups: list[bool] = []

    def fake_run(w, warm):
        seeds.append(w.seed)
        warmups.append(warm)
        return [RequestRecord(ok=True, prompt_len=1, output_len=1, ttft=0.1, e2e=0.1)], 1.0

    emitted: list[RunResult] = []
    for target in ("gateway", "native"):
        for w in workloads(False):
            _measure(target, Path("m"), w, fake_run, emitted.append, range(3), Runs())
    assert len(seeds) == len(set(seeds))  # no run finds another run's prompts in the prefix cache
    assert all(r.status == "ok" for r in emitted)
    assert warmups[:3] == [True, False, False]  # one warm-up request per server and workload
