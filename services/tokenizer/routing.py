"""Choosing a scheduler for each request: round_robin, least_load, cache_aware.

Policies see only plain facts (address, connected, last LoadReport, requests this tokenizer has
in flight there) so they are unit-testable without gRPC. cache_aware follows SGLang's router:
when the load is imbalanced, go to the least loaded scheduler; otherwise go to the scheduler with
the longest remembered prefix if the match ratio is above the threshold, else the least loaded.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from ringserve.errors import Unavailable
from ringserve.message import Load
from ringserve.message.codec import fields_to_pb
from ringserve.v1 import api_pb2

from .prefix_tree import PrefixTree


@dataclass(frozen=True)
class SchedulerView:
    """This tokenizer's view of one scheduler connection; the load is the scheduler's last report."""

    address: str
    connected: bool
    load: Load
    in_flight: int = 0  # this tokenizer's live requests routed there (fresher than the last report)
    attention_backend: str = ""  # from GetSchedulerInfo on connect (server info only)
    cuda_graph: bool = False
    overlap_schedule: bool = False
    dtype: str = ""
    kv_cache_dtype: str = ""

    @property
    def score(self) -> tuple[int, float]:
        """Lower is less loaded: queued work first, KV usage to break ties."""
        return (max(self.load.num_reqs, self.in_flight), self.load.token_usage)

    def to_pb(self) -> api_pb2.SchedulerLoad:
        """The public SchedulerLoad (server info): the connection and every Load field it has."""
        pb: api_pb2.SchedulerLoad = fields_to_pb(self.load, api_pb2.SchedulerLoad)
        pb.address, pb.connected = self.address, self.connected
        pb.attention_backend, pb.cuda_graph = self.attention_backend, self.cuda_graph
        pb.overlap_schedule, pb.dtype, pb.kv_cache_dtype = self.overlap_schedule, self.dtype, self.kv_cache_dtype
        return pb


class Router(Protocol):
    name: str

    def select(self, input_ids: list[int], views: list[SchedulerView]) -> str: ...
    def forget(self, address: str) -> None: ...


def live(views: list[SchedulerView]) -> list[SchedulerView]:
    up = [v for v in views if v.connected]
    if not up:
        if len(views) == 1:
            raise Unavailable(f"scheduler {views[0].address} unavailable")
        raise Unavailable("no scheduler available (" + ", ".join(v.address for v in views) + ")")
    return up


def least_loaded(views: list[SchedulerView]) -> SchedulerView:
    return min(views, key=lambda v: v.score)  # min is stable: first listed wins ties


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, input_ids: list[int], views: list[SchedulerView]) -> str:
        up = live(views)
        return up[next(self._counter) % len(up)].address

    def forget(self, address: str) -> None:
        pass


class LeastLoad:
    name = "least_load"

    def select(self, input_ids: list[int], views: list[SchedulerView]) -> str:
        return least_loaded(live(views)).address

    def forget(self, address: str) -> None:
        pass


class CacheAware:
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, max_tree_tokens: int = 200_000) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_tree_tokens)

    def balanced(self, views: list[SchedulerView]) -> bool:
        loads = [v.score[0] for v in views]
        hi, lo = max(loads), min(loads)
        return not (hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold)

    def select(self, input_ids: list[int], views: list[SchedulerView]) -> str:
        up = live(views)
        if self.balanced(up):
            match = self.tree.match(input_ids, {v.address for v in up})
            ratio = match.length / len(input_ids) if input_ids else 0.0
            chosen = match.tenant if match.tenant and ratio > self.cache_threshold else least_loaded(up).address
        else:
            chosen = least_loaded(up).address
        # Remember the prompt there, so the next request sharing the prefix follows it.
        self.tree.insert(input_ids, chosen)
        return chosen

    def forget(self, address: str) -> None:
        self.tree.remove_tenant(address)


def make_router(policy: str, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                balance_rel_threshold: float = 1.5, max_tree_tokens: int = 200_000) -> Router:
    if policy == "round_robin":
        return RoundRobin()
    if policy == "least_load":
        return LeastLoad()
    if policy == "cache_aware":
        return CacheAware(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_tokens)
    raise ValueError(f"unknown routing policy {policy!r}")
