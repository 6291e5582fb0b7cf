"""A scheduler's load: what the tokenizer routes by and what server info reports."""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.message.codec import fields_from_pb, fields_to_pb
from ringserve.v1 import scheduler_pb2


@dataclass(frozen=True, slots=True)
class Load:
    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_used_tokens: int = 0         # KV pool tokens in use (locked cached prefixes included)
    max_total_num_tokens: int = 0    # KV pool size in tokens
    token_usage: float = 0.0         # num_used_tokens / max_total_num_tokens
    cache_hit_rate: float = 0.0      # share of prompt tokens served from the prefix cache, since start
    gen_throughput: float = 0.0      # output tokens per second over the last interval
    memory_accounted_bytes: int = 0  # the scheduler's accounted buffers now (services/scheduler/memory.py)
    memory_bound_bytes: int = 0      # the most they can hold, as configured
    rss_bytes: int = 0               # the scheduler process's resident set

    @property
    def num_reqs(self) -> int:
        return self.num_running_reqs + self.num_queue_reqs

    @classmethod
    def from_pb(cls, pb: scheduler_pb2.LoadReport) -> Load:
        return fields_from_pb(cls, pb)

    def to_pb(self) -> scheduler_pb2.LoadReport:
        return fields_to_pb(self, scheduler_pb2.LoadReport)
