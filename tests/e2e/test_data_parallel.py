"""Two real scheduler processes behind one tokenizer: cache_aware keeps a prefix on one scheduler,
round_robin spreads requests over both."""

from __future__ import annotations

import random

import grpc
import pytest

from ringserve.v1 import api_pb2, api_pb2_grpc, common_pb2
from tests.resilience.cluster import cluster

pytestmark = pytest.mark.e2e


def cached_tokens_of(target: str, prefix: list[int], count: int) -> list[int]:
    """Send `count` requests one after another, all starting with `prefix`; their cached_tokens."""
    out = []
    with grpc.insecure_channel(target) as ch:
        stub = api_pb2_grpc.InferenceServiceStub(ch)
        for i in range(count):
            req = api_pb2.GenerateRequest(
                input_ids=api_pb2.TokenIds(ids=prefix + [100 + i, 200 + i]),
                sampling_params=common_pb2.SamplingParams(max_new_tokens=2, temperature=0))
            final = list(stub.Generate(req, timeout=60))[-1]
            out.append(final.meta_info.cached_tokens)
    return out


def test_cache_aware_and_round_robin_over_two_schedulers(model_dir: str) -> None:
    rng = random.Random(7)
    with cluster(model_dir) as c:
        detok = c.detokenizer()
        a, b = c.scheduler(detok), c.scheduler(detok)
        aware = c.tokenizer(a, detok, "--scheduler", b.target, "--routing-policy", "cache_aware",
                            name="tok-aware")
        rr = c.tokenizer(a, detok, "--scheduler", b.target, "--routing-policy", "round_robin", name="tok-rr")

        prefix = [rng.randrange(10, 4000) for _ in range(400)]
        cached = cached_tokens_of(aware.target, prefix, 5)
        # Only the first pays for the prefix: every later one lands where the prefix is cached.
        assert cached[0] < 384 and all(n >= 384 for n in cached[1:]), cached

        other = [rng.randrange(10, 4000) for _ in range(400)]
        cached = cached_tokens_of(rr.target, other, 4)
        # Alternating schedulers: each pays for the prefix once, then hits its own cache.
        assert cached[0] < 384 and cached[1] < 384 and cached[2] >= 384 and cached[3] >= 384, cached

        with grpc.insecure_channel(rr.target) as ch:
            info = api_pb2_grpc.InferenceServiceStub(ch).GetServerInfo(api_pb2.GetServerInfoRequest(), timeout=10)
        assert sorted(s.address for s in info.schedulers if s.connected) == sorted([a.target, b.target])
