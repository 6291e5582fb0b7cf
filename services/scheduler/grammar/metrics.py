"""Prometheus metrics of constrained decoding; the scheduler's metrics module creates one
GrammarMetrics and hands it to the GrammarQueue and GrammarMasker, which update it themselves."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_COMPILE_BUCKETS = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
_MASK_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)


class GrammarMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.queue_reqs = Gauge("sglang:num_grammar_queue_reqs",
                                "Requests waiting for their grammar to compile", ["model_name"],
                                registry=registry).labels(model_name)
        self.compile_seconds = Histogram("sglang:grammar_compile_seconds",
                                         "Grammar compile time (cache misses), by constraint kind",
                                         ["model_name", "kind"], buckets=_COMPILE_BUCKETS, registry=registry)
        self.mask_seconds = Histogram("sglang:grammar_mask_seconds",
                                      "Fill + apply time of the grammar bitmask for one step's batch",
                                      ["model_name"], buckets=_MASK_BUCKETS, registry=registry
                                      ).labels(model_name)
        self.cache_hits = Counter("sglang:grammar_cache_hits", "Grammar lookups served by the cache",
                                  ["model_name"], registry=registry).labels(model_name)
        self.errors = Counter("sglang:grammar_errors", "Requests aborted by a grammar error or timeout",
                              ["model_name", "reason"], registry=registry)
        self.model_name = model_name

    def observe_compile(self, kind: str, seconds: float) -> None:
        self.compile_seconds.labels(self.model_name, kind).observe(seconds)

    def count_error(self, reason: str) -> None:
        """reason: "invalid", "timeout", "full" or "internal"."""
        self.errors.labels(self.model_name, reason).inc()
