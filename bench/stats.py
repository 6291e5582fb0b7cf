"""Per-request measurements and their summary: throughput and latency percentiles.

Every target (HTTP through bench_serving, gRPC, the in-process engine) reduces to the same
`RequestRecord`s, and `summarize` computes every number in the report from them, so the
percentiles mean the same thing for each target. Definitions follow SGLang's bench_serving:
TTFT = request sent -> first output chunk; ITL = gap between consecutive chunks, split evenly over
the tokens a chunk carried; e2e = request sent -> last output; TPOT = (e2e - TTFT) / (tokens - 1),
which, unlike ITL, does not depend on how a server groups tokens into chunks; throughput = tokens / wall time of
the whole run (first request sent -> last request finished).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds."""

    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # the server's per-boundary seconds, if sent


@dataclass
class Summary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    tpot_ms: dict[str, float] = field(default_factory=dict)  # (e2e - TTFT) / (output tokens - 1)
    first_error: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)  # per-boundary medians, when the server sent them

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _pcts_ms(values: list[float]) -> dict[str, float]:
    out = {f"p{q}": percentile(values, q) * 1000.0 for q in PERCENTILES}
    out["mean"] = (sum(values) / len(values) * 1000.0) if values else float("nan")
    return out


def summarize(records: list[RequestRecord], duration_s: float) -> Summary:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    dur = max(duration_s, 1e-9)
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    return Summary(
        completed=len(ok), failed=len(failed), duration_s=duration_s,
        request_throughput=len(ok) / dur, input_throughput=n_in / dur,
        output_throughput=n_out / dur, total_throughput=(n_in + n_out) / dur,
        ttft_ms=_pcts_ms([r.ttft for r in ok]),
        itl_ms=_pcts_ms([x for r in ok for x in r.itls]),
        e2e_ms=_pcts_ms([r.e2e for r in ok]),
        tpot_ms=_pcts_ms([(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        first_error=failed[0].error[-500:] if failed else "",
        timings_ms={k: percentile([r.timings[k] for r in ok if k in r.timings], 50) * 1000.0
                    for k in sorted({k for r in ok for k in r.timings})},
    )


class StreamTimer:
    """Turns the arrival times of a request's output chunks into TTFT / ITL / e2e.

    `chunk(n_tokens)` is called when a chunk carrying n new tokens arrives; a chunk with several
    tokens contributes n equal ITL entries (bench_serving's adjustment for the sglang backend).
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.last = start
        self.ttft = 0.0
        self.itls: list[float] = []
        self.tokens = 0

    def chunk(self, now: float, n_tokens: int) -> None:
        if n_tokens <= 0:
            return
        if self.tokens == 0:
            self.ttft = now - self.start  # like bench_serving: the first chunk adds no ITL entry
        else:
            gap = (now - self.last) / n_tokens
            self.itls.extend([gap] * n_tokens)
        self.tokens += n_tokens
        self.last = now

    def record(self, prompt_len: int, end: float) -> RequestRecord:
        return RequestRecord(ok=True, prompt_len=prompt_len, output_len=self.tokens, ttft=self.ttft,
                             itls=self.itls, e2e=end - self.start)
