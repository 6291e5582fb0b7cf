"""The workloads: request shapes, arrival pattern, and the prompts themselves.

HTTP targets get their prompts from bench_serving (`bench_serving_args`); the gRPC and engine
targets get token ids from `make_prompts`, generated the way bench_serving's datasets are
(random-ids: runs of consecutive ids from a random offset; generated-shared-prefix: per group one
random system prompt followed by a random question), with the same lengths and seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Workload:
    name: str                     # "A", "B", "C", "D@2" ...
    title: str
    dataset: str = "random-ids"   # or "generated-shared-prefix"
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64
    max_concurrency: int | None = None
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf = all at once
    # generated-shared-prefix only
    gsp_groups: int = 0
    gsp_per_group: int = 0
    gsp_system_len: int = 0
    gsp_question_len: int = 0
    seed: int = 1                 # distinct per workload: no prompt repeats across runs on one server

    @property
    def family(self) -> str:
        """Workloads of one family (the rate sweep) are plotted together."""
        return self.name.split("@")[0]

    def bench_serving_args(self) -> list[str]:
        a = ["--dataset-name", self.dataset, "--num-prompts", str(self.num_prompts),
             "--request-rate", "inf" if math.isinf(self.request_rate) else str(self.request_rate),
             "--seed", str(self.seed)]
        if self.max_concurrency:
            a += ["--max-concurrency", str(self.max_concurrency)]
        if self.dataset == "generated-shared-prefix":
            a += ["--gsp-num-groups", str(self.gsp_groups), "--gsp-prompts-per-group", str(self.gsp_per_group),
                  "--gsp-system-prompt-len", str(self.gsp_system_len),
                  "--gsp-question-len", str(self.gsp_question_len), "--gsp-output-len", str(self.output_len)]
        else:
            a += ["--random-input-len", str(self.input_len), "--random-output-len", str(self.output_len),
                  "--random-range-ratio", "1.0"]
        return a


def sweep(base: Workload, rates: list[float]) -> list[Workload]:
    return [replace(base, name=f"{base.name}@{r:g}", title=f"{base.title} at {r:g} req/s", request_rate=r,
                    seed=base.seed + k) for k, r in enumerate(rates)]


def workloads(quick: bool) -> list[Workload]:
    """Full: A, B, C, D (a rate sweep). Quick: smaller A, B, C and a two-point sweep."""
    if quick:
        return [
            Workload("A", "16 x 128 in / 64 out, all at once", num_prompts=16, seed=1),
            Workload("B", "32 x 256 in / 128 out, concurrency 16", num_prompts=32, input_len=256,
                     output_len=128, max_concurrency=16, seed=2),
            Workload("C", "shared prefix: 2 groups x 8, 256 + 32 in / 32 out", dataset="generated-shared-prefix",
                     num_prompts=16, output_len=32, gsp_groups=2, gsp_per_group=8, gsp_system_len=256,
                     gsp_question_len=32, seed=3),
            *sweep(Workload("D", "16 x 128 in / 64 out, Poisson arrivals", num_prompts=16, seed=10), [2.0, 8.0]),
        ]
    return [
        Workload("A", "32 x 128 in / 64 out, all at once", seed=1),
        Workload("B", "128 x 256 in / 128 out, concurrency 64", num_prompts=128, input_len=256,
                 output_len=128, max_concurrency=64, seed=2),
        Workload("C", "shared prefix: 4 groups x 16, 512 + 64 in / 64 out", dataset="generated-shared-prefix",
                 num_prompts=64, output_len=64, gsp_groups=4, gsp_per_group=16, gsp_system_len=512,
                 gsp_question_len=64, seed=3),
        *sweep(Workload("D", "32 x 128 in / 64 out, Poisson arrivals", num_prompts=32, seed=10), [1.0, 4.0, 16.0]),
    ]


def select(all_wl: list[Workload], names: list[str] | None) -> list[Workload]:
    if not names:
        return all_wl
    return [w for w in all_wl if w.family in names or w.name in names]


def make_prompts(w: Workload, vocab_size: int, special_ids: set[int]) -> list[list[int]]:
    """Token-id prompts of the workload's exact lengths (deterministic in w.seed)."""
    rng = random.Random(w.seed)
    if w.dataset == "generated-shared-prefix":
        usable = [i for i in range(vocab_size) if i not in special_ids]
        systems = [rng.choices(usable, k=w.gsp_system_len) for _ in range(w.gsp_groups)]
        return [systems[g] + rng.choices(usable, k=w.gsp_question_len)
                for g in range(w.gsp_groups) for _ in range(w.gsp_per_group)]
    prompts = []
    for i in range(w.num_prompts):
        off = rng.randrange(vocab_size)
        prompts.append([(off + i + j) % vocab_size for j in range(w.input_len)])
    return prompts


def arrival_times(w: Workload) -> list[float]:
    """Seconds after the start at which each request is sent (Poisson process, or all at 0)."""
    if math.isinf(w.request_rate):
        return [0.0] * w.num_prompts
    rng = random.Random(w.seed + 1)
    t, out = 0.0, []
    for _ in range(w.num_prompts):
        out.append(t)
        t += rng.expovariate(w.request_rate)
    return out
