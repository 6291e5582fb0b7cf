"""SchedulerStats: the scheduler's counters since start (metrics, the benchmark's step profile, tests)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Counters since start (the metrics and tests read them)."""

    prefill_tokens: int = 0       # tokens computed by prefill forwards (cached prefixes excluded)
    prompt_tokens: int = 0        # prompt tokens of requests at their first prefill
    cached_prompt_tokens: int = 0 # of which served from the radix cache
    generated_tokens: int = 0
    retractions: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0          # prefill steps that also decoded the running batch
    finished: int = 0
    # The step profile: seconds in forward + sampling + results, and requests per decode step.
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_rows: int = 0
