"""Prometheus metrics of the detokenizer (label model_name)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_STEP_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


class DetokenizerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.step_decode = Histogram("ringserve_detokenizer_step_decode_seconds",
                                     "Decode time of one scheduler step (all its requests)",
                                     ["model_name"], buckets=_STEP_BUCKETS, registry=registry
                                     ).labels(model_name)
        self.requests_tracked = Gauge("ringserve_detokenizer_requests_tracked",
                                      "Requests with decode state", ["model_name"], registry=registry
                                      ).labels(model_name)
        self.tokens = Counter("ringserve_detokenizer_tokens_decoded",
                              "Output tokens decoded", ["model_name"], registry=registry).labels(model_name)
        self.subscribers = Gauge("ringserve_detokenizer_subscribers",
                                 "Connected tokenizer subscribers", ["model_name"], registry=registry
                                 ).labels(model_name)
        self.deltas_dropped = Counter("ringserve_detokenizer_deltas_dropped",
                                      "Token deltas dropped (unknown rid, gap, state cap)",
                                      ["model_name"], registry=registry).labels(model_name)
