"""Soak (`make soak`; not in the default run): many concurrent streaming clients for minutes.

RINGSERVE_SOAK_S (default 180) seconds of RINGSERVE_SOAK_CLIENTS (default 256) clients, each a
bounded loop of streaming /generate calls through the gateway with mixed lengths, ~10% of them
cancelled after the first chunks. Before it, RINGSERVE_SOAK_WARMUP_S (default 20) of the same load.
Pass: no unexpected error, rid_to_state and the KV pool back to idle afterwards, and each service's
RSS within RINGSERVE_SOAK_RSS_TOLERANCE (default 5%) of its post-warm-up level.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.resilience.cluster import Svc, cluster, eventually, rid_to_state_size, rss_kib, scheduler_load

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

SOAK_S = float(os.environ.get("RINGSERVE_SOAK_S", "180"))
WARMUP_S = float(os.environ.get("RINGSERVE_SOAK_WARMUP_S", "20"))
CLIENTS = int(os.environ.get("RINGSERVE_SOAK_CLIENTS", "256"))
RSS_TOLERANCE = float(os.environ.get("RINGSERVE_SOAK_RSS_TOLERANCE", "0.05"))
LENGTHS = (1, 8, 32, 128, 256)
CANCEL_RATE = 0.1


@dataclass
class Stats:
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    unexpected: list[str] = field(default_factory=list)


async def _client(i: int, client: httpx.AsyncClient, stop_at: float, stats: Stats) -> None:
    rng = random.Random(i)
    while time.monotonic() < stop_at:
        n = rng.choice(LENGTHS)
        cancel = rng.random() < CANCEL_RATE
        body = {"text": f"soak {i} " * rng.randint(1, 40), "stream": True,
                "sampling_params": {"max_new_tokens": n, "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True}}
        t0 = time.monotonic()
        try:
            async with client.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    stats.unexpected.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    continue
                chunks, done = 0, False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    if "error" in json.loads(data):
                        stats.unexpected.append(f"in-stream error: {data[:200]}")
                        break
                    chunks += 1
                    if cancel and chunks >= 2:
                        break  # leaving the block closes the connection: the gateway cancels
        except httpx.HTTPError as e:
            stats.unexpected.append(f"{type(e).__name__}: {e}")
            continue
        if done:
            stats.outcomes["completed"] += 1
            stats.tokens += n
            stats.latencies.append(time.monotonic() - t0)
        elif cancel:
            stats.outcomes["cancelled"] += 1
        else:
            stats.unexpected.append("stream ended without [DONE]")


async def _load(gw: Svc, seconds: float) -> tuple[Stats, float]:
    stats = Stats()
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=gw.url, timeout=httpx.Timeout(300, connect=30), limits=limits) as client:
        await asyncio.gather(*(_client(i, client, t0 + seconds, stats) for i in range(CLIENTS)))
    return stats, time.monotonic() - t0


def _report(name: str, stats: Stats, elapsed: float) -> str:
    lat = sorted(stats.latencies) or [0.0]
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    return (f"{name}: {elapsed:.0f}s, {CLIENTS} clients: {dict(stats.outcomes)}, unexpected {len(stats.unexpected)}; "
            f"{sum(stats.outcomes.values()) / elapsed:.1f} req/s, {stats.tokens / elapsed:.0f} completed tok/s; "
            f"latency p50 {statistics.median(lat):.2f}s p99 {p99:.2f}s")


def test_soak(model_dir: str) -> None:
    with cluster(model_dir) as c:
        detok, sched, tok = c.ring()
        gw = c.gateway(tok)
        services = {"detokenizer": detok, "scheduler": sched, "tokenizer": tok, "gateway": gw}
        idle_kv = scheduler_load(sched.target).num_used_tokens

        warm, warm_s = asyncio.run(_load(gw, WARMUP_S))
        print(_report("warm-up", warm, warm_s))
        assert not warm.unexpected, warm.unexpected[:10]
        rss_warm = {name: rss_kib(s.proc.pid) for name, s in services.items()}  # type: ignore[arg-type]

        soak, soak_s = asyncio.run(_load(gw, SOAK_S))
        rss_end = {name: rss_kib(s.proc.pid) for name, s in services.items()}  # type: ignore[arg-type]
        print(_report("soak", soak, soak_s))
        print("RSS KiB post-warm-up -> end: " + ", ".join(
            f"{n} {rss_warm[n]} -> {rss_end[n]} ({(rss_end[n] - rss_warm[n]) / rss_warm[n]:+.1%})" for n in services))
        assert not soak.unexpected, soak.unexpected[:10]
        assert soak.outcomes["completed"] > 0 and soak.outcomes["cancelled"] > 0

        eventually(lambda: rid_to_state_size(tok.target) == 0, timeout=60, what="rid_to_state empty")
        eventually(lambda: (ld := scheduler_load(sched.target)).num_running_reqs == 0 and ld.num_queue_reqs == 0
                   and ld.num_used_tokens == idle_kv, timeout=60, what="KV pool back to idle")
        for name, s in services.items():
            assert not s.errors(), (name, s.errors()[:5])
            assert abs(rss_end[name] - rss_warm[name]) <= RSS_TOLERANCE * rss_warm[name], (name, rss_warm, rss_end)
