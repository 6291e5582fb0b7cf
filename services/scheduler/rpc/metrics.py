"""Prometheus metrics of the scheduler, with SGLang's names (sglang:*) and a model_name label.

The load gauges read the engine's latest step snapshot when scraped, so a scrape right after a
burst sees it (a periodic copy could lag the last steps of a short run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ringserve.message import Load
from services.scheduler import memory
from services.scheduler.core.scheduler import SchedulerStats

_LABELS = ["model_name"]
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SchedulerMetrics:
    """Create once per process (prometheus_client's default registry rejects duplicates)."""

    def __init__(self, model_name: str, page_size: int, num_pages: int, load: Callable[[], Load],
                 stats: Callable[[], SchedulerStats], memory_items: Callable[[], list[memory.MemoryItem]]) -> None:
        def gauge(name: str, doc: str, attr: str, of: Callable[[], object] = load) -> None:
            Gauge(name, doc, _LABELS).labels(model_name).set_function(lambda: getattr(of(), attr))

        gauge("sglang:num_running_reqs", "Requests in the running batch", "num_running_reqs")
        gauge("sglang:num_queue_reqs", "Requests in the waiting queue", "num_queue_reqs")
        gauge("sglang:num_used_tokens", "KV pool tokens in use", "num_used_tokens")
        gauge("sglang:token_usage", "Share of the KV pool in use", "token_usage")
        gauge("sglang:cache_hit_rate", "Share of prompt tokens served from the prefix cache", "cache_hit_rate")
        gauge("sglang:gen_throughput", "Output tokens per second", "gen_throughput")
        gauge("sglang:num_retracted_reqs", "Requests retracted since start", "retractions", stats)
        Gauge("sglang:max_total_num_tokens", "KV pool size in tokens", _LABELS).labels(model_name).set(
            num_pages * page_size)
        self.queue_time = Histogram("sglang:queue_time_seconds", "Time in the waiting queue before prefill",
                                    _LABELS, buckets=QUEUE_TIME_BUCKETS).labels(model_name)
        Info("sglang:cache_config", "KV cache configuration").info(
            {"model_name": model_name, "page_size": str(page_size), "num_pages": str(num_pages)})
        REGISTRY.register(StepProfile(model_name, stats))
        REGISTRY.register(MemoryProfile(model_name, memory_items))


class StepProfile:
    """Counters of the forward steps, read from the engine's stats snapshot at scrape time: how many
    prefill and decode steps ran, the seconds they took (forward, sampling and results) and the
    requests decoded per step. Rates of these give ms per step and batch size."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        ld = self.stats()
        steps = CounterMetricFamily("ringserve:forward_steps", "Forward steps by mode", labels=["model_name", "mode"])
        secs = CounterMetricFamily("ringserve:forward_seconds", "Seconds in forward steps (forward, sampling, "
                                   "results) by mode", labels=["model_name", "mode"])
        for mode, n, t in (("prefill", ld.prefill_steps, ld.prefill_s), ("decode", ld.decode_steps, ld.decode_s)):
            steps.add_metric([self.model_name, mode], n)
            secs.add_metric([self.model_name, mode], t)
        rows = CounterMetricFamily("ringserve:decode_rows", "Requests decoded, summed over decode steps",
                                   labels=["model_name"])
        rows.add_metric([self.model_name], ld.decode_rows)
        yield from (steps, secs, rows)


class MemoryProfile:
    """The scheduler's memory by holder (services/scheduler/memory.py), read at scrape time: bytes held
    and each holder's bound, their sums, and the process's RSS beside them (the difference is the
    runtime: interpreter, torch, libraries, request objects), and glibc's free bytes."""

    def __init__(self, model_name: str, items: Callable[[], list[memory.MemoryItem]]) -> None:
        self.model_name = model_name
        self.items = items

    def collect(self) -> Iterator[GaugeMetricFamily]:
        items = self.items()
        labels = ["model_name", "component"]
        held = GaugeMetricFamily("ringserve:memory_bytes", "Bytes held by each accounted part of the scheduler",
                                 labels=labels)
        bound = GaugeMetricFamily("ringserve:memory_bound_bytes", "The most each accounted part can hold, as "
                                  "configured", labels=labels)
        for i in items:
            held.add_metric([self.model_name, i.name], i.used_bytes)
            bound.add_metric([self.model_name, i.name], i.bound_bytes)
        used, most = memory.total(items)
        yield held
        yield bound
        for name, doc, value in (
                ("ringserve:memory_accounted_bytes", "Sum of ringserve:memory_bytes", used),
                ("ringserve:memory_accounted_bound_bytes", "Sum of ringserve:memory_bound_bytes", most),
                ("ringserve:memory_rss_bytes", "The scheduler process's resident set", memory.rss_bytes()),
                ("ringserve:memory_malloc_free_bytes", "Free bytes in glibc's malloc arenas, not in the sums: "
                 "malloc_trim returns their pages when idle, but glibc counts them until reused",
                 memory.malloc_free_bytes())):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
