"""The in-process engine target's request loop, against a stand-in engine (the real one runs in make bench)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from bench.engine_target import run_one
from bench.workloads import Workload, make_prompts


class InstantEngine:
    """Finishes every submitted request in the next step with all its tokens."""

    def __init__(self) -> None:
        self.pending: list = []
        self.submitted = 0

    def submit(self, req) -> None:
        self.pending.append(req)
        self.submitted += 1

    def step(self) -> list:
        outs = [SimpleNamespace(rid=r.rid, ids=[7] * r.params.max_new_tokens, finish="length") for r in self.pending]
        self.pending = []
        return outs


def test_a_shared_prefix_warm_up_sends_only_the_requests_it_asks_for() -> None:
    # generated-shared-prefix makes groups x per-group prompts whatever num_prompts says; the warm-up
    # batch asks for fewer, and the loop must end once those are done (it used to wait forever).
    w = Workload("C", "t", dataset="generated-shared-prefix", num_prompts=8, output_len=3, gsp_groups=2,
                 gsp_per_group=4, gsp_system_len=8, gsp_question_len=4)
    prompts = make_prompts(w, vocab_size=50, special_ids={0, 1})
    engine = InstantEngine()
    records, _ = run_one(engine, replace(w, num_prompts=3), prompts)
    assert engine.submitted == 3 and len(records) == 3
    assert all(r.output_len == 3 for r in records)
