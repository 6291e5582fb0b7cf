"""Prometheus metrics of the tokenizer, named as SGLang names them (sglang:*), labelled by model_name.

Metrics are process-global (prometheus_client's default registry), so they are created once and
shared by every TokenizerManager in the process (tests run several in one process).
"""

from __future__ import annotations

from functools import lru_cache

from prometheus_client import Counter, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)


class TokenizerMetrics:
    def __init__(self) -> None:
        label = ["model_name"]
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens processed", label)
        self.generation_tokens = Counter("sglang:generation_tokens", "Output tokens generated", label)
        self.num_requests = Counter("sglang:num_requests", "Requests sent to a scheduler (per sample)", label)
        self.num_aborted = Counter("sglang:num_aborted_requests", "Requests aborted or cancelled", label)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Arrival to first output token",
                              label, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Time between output tokens",
                             label, buckets=_ITL_BUCKETS)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Arrival to finish",
                             label, buckets=_LATENCY_BUCKETS)


@lru_cache(maxsize=1)
def tokenizer_metrics() -> TokenizerMetrics:
    return TokenizerMetrics()


class ModelMetrics:
    """The metrics with the model_name label bound once."""

    def __init__(self, model_name: str) -> None:
        m = tokenizer_metrics()
        self.prompt_tokens = m.prompt_tokens.labels(model_name)
        self.generation_tokens = m.generation_tokens.labels(model_name)
        self.num_requests = m.num_requests.labels(model_name)
        self.num_aborted = m.num_aborted.labels(model_name)
        self.ttft = m.ttft.labels(model_name)
        self.itl = m.itl.labels(model_name)
        self.e2e = m.e2e.labels(model_name)
