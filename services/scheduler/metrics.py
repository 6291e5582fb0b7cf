"""Prometheus metrics of the scheduler, with SGLang's names (sglang:*) and a model_name label."""

from __future__ import annotations

from prometheus_client import Gauge, Histogram, Info

from services.scheduler.engine import Load

_LABELS = ["model_name"]
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SchedulerMetrics:
    """Create once per process (prometheus_client's default registry rejects duplicates)."""

    def __init__(self, model_name: str, page_size: int, num_pages: int) -> None:
        g = lambda name, doc: Gauge(name, doc, _LABELS).labels(model_name)  # noqa: E731
        self.num_running_reqs = g("sglang:num_running_reqs", "Requests in the running batch")
        self.num_queue_reqs = g("sglang:num_queue_reqs", "Requests in the waiting queue")
        self.num_used_tokens = g("sglang:num_used_tokens", "KV pool tokens in use")
        self.token_usage = g("sglang:token_usage", "Share of the KV pool in use")
        self.cache_hit_rate = g("sglang:cache_hit_rate", "Share of prompt tokens served from the prefix cache")
        self.gen_throughput = g("sglang:gen_throughput", "Output tokens per second")
        self.num_retracted_reqs = g("sglang:num_retracted_reqs", "Requests retracted since start")
        self.max_total_num_tokens = g("sglang:max_total_num_tokens", "KV pool size in tokens")
        self.queue_time = Histogram("sglang:queue_time_seconds", "Time in the waiting queue before prefill",
                                    _LABELS, buckets=QUEUE_TIME_BUCKETS).labels(model_name)
        Info("sglang:cache_config", "KV cache configuration").info(
            {"model_name": model_name, "page_size": str(page_size), "num_pages": str(num_pages)})
        self.max_total_num_tokens.set(num_pages * page_size)

    def update(self, load: Load) -> None:
        self.num_running_reqs.set(load.num_running_reqs)
        self.num_queue_reqs.set(load.num_queue_reqs)
        self.num_used_tokens.set(load.num_used_tokens)
        self.token_usage.set(load.token_usage)
        self.cache_hit_rate.set(load.cache_hit_rate)
        self.gen_throughput.set(load.gen_throughput)
        self.num_retracted_reqs.set(load.num_retracted_reqs)
