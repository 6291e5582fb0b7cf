"""Soak: many concurrent streaming clients for minutes (`make soak`), and a one-minute one in `make test`.

`make soak` (marker soak): RINGSERVE_SOAK_S (default 180) seconds of RINGSERVE_SOAK_CLIENTS (default
256) clients on RINGSERVE_SOAK_MODEL (`make soak MODEL=...`; default the tiny test model), each a
bounded loop of streaming /generate calls through the gateway with mixed lengths, ~10% of them
cancelled after the first chunks. Before it, RINGSERVE_SOAK_WARMUP_S (default 60) of the same load.
`test_soak_short` runs the same check in `make test`: 128 clients, 30 s of warm-up, 20 s of soak.

Pass: no unexpected error, rid_to_state and the KV pool back to idle afterwards, and each service's
RSS within RINGSERVE_SOAK_RSS_TOLERANCE (default 5%) of its level after the warm-up. Both RSS figures
are taken once the scheduler has gone idle and returned what the load grew (its decode caches and
malloc's free pages: the "idle: released" log line), so they compare the same state; what the 5%
leaves room for is the runtime's bounded caches still filling after the warm-up: oneDNN's primitive
cache (one entry per new batch shape, at most ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024), the radix tree's
nodes (until the KV pool is full of cached prefixes), and malloc fragmentation around them; measured
+0.2 to +3% over 3 minutes after a 60 s warm-up (docs/deployment.md, "Memory"). A leak of one
decode-cache row per request, or the decode caches kept after the load, is tens of percent.
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

from ringserve.model_source import resolve_model
from tests.resilience.cluster import Svc, cluster, eventually, rid_to_state_size, rss_kib, scheduler_load

pytestmark = [pytest.mark.e2e]

SOAK_S = float(os.environ.get("RINGSERVE_SOAK_S", "180"))
WARMUP_S = float(os.environ.get("RINGSERVE_SOAK_WARMUP_S", "60"))
CLIENTS = int(os.environ.get("RINGSERVE_SOAK_CLIENTS", "256"))
SOAK_MODEL = os.environ.get("RINGSERVE_SOAK_MODEL", "")
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


async def _load(gw: Svc, seconds: float, clients: int) -> tuple[Stats, float]:
    stats = Stats()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=gw.url, timeout=httpx.Timeout(300, connect=30), limits=limits) as client:
        await asyncio.gather(*(_client(i, client, t0 + seconds, stats) for i in range(clients)))
    return stats, time.monotonic() - t0


def _report(name: str, stats: Stats, elapsed: float, clients: int) -> str:
    lat = sorted(stats.latencies) or [0.0]
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    return (f"{name}: {elapsed:.0f}s, {clients} clients: {dict(stats.outcomes)}, unexpected {len(stats.unexpected)}; "
            f"{sum(stats.outcomes.values()) / elapsed:.1f} req/s, {stats.tokens / elapsed:.0f} completed tok/s; "
            f"latency p50 {statistics.median(lat):.2f}s p99 {p99:.2f}s")


def _idle_rss(services: dict[str, Svc], sched: Svc, tok: Svc, idle_kv: int, seen: int) -> dict[str, int]:
    """Each service's RSS once the requests are gone and the scheduler has released what the load grew
    (seen: the scheduler's output lines before the load)."""
    eventually(lambda: rid_to_state_size(tok.target) == 0, timeout=60, what="rid_to_state empty")
    eventually(lambda: (ld := scheduler_load(sched.target)).num_running_reqs == 0 and ld.num_queue_reqs == 0
               and ld.num_used_tokens == idle_kv, timeout=60, what="KV pool back to idle")
    sched.proc.wait_output("idle: released", timeout=30, after=seen)
    return {name: rss_kib(s.proc.pid) for name, s in services.items()}  # type: ignore[arg-type]


def _soak(model: str, clients: int, warmup_s: float, soak_s: float) -> None:
    with cluster(model) as c:
        detok, sched, tok = c.ring()
        gw = c.gateway(tok)
        services = {"detokenizer": detok, "scheduler": sched, "tokenizer": tok, "gateway": gw}
        idle_kv = scheduler_load(sched.target).num_used_tokens

        seen = sched.proc.lines_seen
        warm, warm_s = asyncio.run(_load(gw, warmup_s, clients))
        print(_report("warm-up", warm, warm_s, clients))
        assert not warm.unexpected, warm.unexpected[:10]
        rss_warm = _idle_rss(services, sched, tok, idle_kv, seen)
        load_warm = scheduler_load(sched.target)

        seen = sched.proc.lines_seen
        soak, soak_s = asyncio.run(_load(gw, soak_s, clients))
        print(_report("soak", soak, soak_s, clients))
        assert not soak.unexpected, soak.unexpected[:10]
        assert soak.outcomes["completed"] > 0 and soak.outcomes["cancelled"] > 0
        rss_end = _idle_rss(services, sched, tok, idle_kv, seen)  # rid_to_state and KV back to idle, too
        load_end = scheduler_load(sched.target)
        print("idle RSS KiB post-warm-up -> end: " + ", ".join(
            f"{n} {rss_warm[n]} -> {rss_end[n]} ({(rss_end[n] - rss_warm[n]) / rss_warm[n]:+.1%})" for n in services))
        print(f"scheduler accounted memory MiB post-warm-up -> end: {load_warm.memory_accounted_bytes >> 20} -> "
              f"{load_end.memory_accounted_bytes >> 20} (bound {load_end.memory_bound_bytes >> 20})")
        for name, s in services.items():
            assert not s.errors(), (name, s.errors()[:5])
            assert abs(rss_end[name] - rss_warm[name]) <= RSS_TOLERANCE * rss_warm[name], (name, rss_warm, rss_end)


@pytest.mark.soak
def test_soak(model_dir: str) -> None:
    model = str(resolve_model(SOAK_MODEL, prepare=True)) if SOAK_MODEL else model_dir
    _soak(model, CLIENTS, WARMUP_S, SOAK_S)


@pytest.mark.slow
def test_soak_short(model_dir: str) -> None:
    """The soak's checks in `make test` (about 70 s), so a leak fails CI too. The warm-up stays 30 s: after
    20 s the bounded caches were still filling (idle RSS +4.5% over the next 20 s, against the 5%
    tolerance); the soak is 20 s: one decode-cache row leaked per request still shows as about +20%."""
    _soak(model_dir, 128, 30.0, 20.0)
