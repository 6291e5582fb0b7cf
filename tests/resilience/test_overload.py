"""Overload: bounded queues answer the excess at once with 429 + Retry-After (RESOURCE_EXHAUSTED),
never a timeout, a 5xx or a crash, and the server keeps serving afterwards.

Both bounds are exercised: the tokenizer's --max-pending-requests (checked at intake) and the
scheduler's --max-queued-requests (a Rejection on the Connect stream, relayed by the tokenizer).
"""

from __future__ import annotations

import asyncio
import collections
import time

import httpx
import pytest

from tests.resilience.cluster import Svc, cluster, eventually, rid_to_state_size, scheduler_load

pytestmark = pytest.mark.e2e

BURST = 48


async def _one(client: httpx.AsyncClient, i: int, stream: bool) -> tuple[int, str, float]:
    body = {"text": f"burst {i}", "stream": stream,
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    t0 = time.monotonic()
    if stream:
        async with client.stream("POST", "/generate", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
        kind = "ok" if lines and lines[-1] == "data: [DONE]" and r.status_code == 200 else \
            f"{r.status_code} {r.headers.get('retry-after')}"
        if r.status_code == 200 and "rate_limit" in "".join(lines):
            kind = "sse-429"  # rejected after the stream had started (a scheduler Rejection)
        return r.status_code, kind, time.monotonic() - t0
    r = await client.post("/generate", json=body)
    kind = "ok" if r.status_code == 200 else f"{r.status_code} {r.headers.get('retry-after')}"
    return r.status_code, kind, time.monotonic() - t0


async def _burst(gw: Svc) -> tuple[collections.Counter[str], float]:
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
    async with httpx.AsyncClient(base_url=gw.url, timeout=120, limits=limits) as client:
        out = await asyncio.gather(*(_one(client, i, stream=i % 2 == 1) for i in range(BURST)))
    return collections.Counter(kind for _, kind, _ in out), max(t for _, _, t in out)


@pytest.mark.parametrize("bound", ["tokenizer", "scheduler"])
def test_overload_gets_429_with_retry_after(model_dir: str, bound: str) -> None:
    with cluster(model_dir) as c:
        if bound == "tokenizer":
            sched_args: tuple[str, ...] = ()
            tok_args: tuple[str, ...] = ("--max-pending-requests", "4")
        else:
            sched_args = ("--max-queued-requests", "2", "--max-running-requests", "2")
            tok_args = ()
        detok, sched, tok = c.ring(sched_args, tok_args)
        gw = c.gateway(tok)
        counts, slowest = asyncio.run(_burst(gw))
        print(f"overload ({bound} bound): {BURST} concurrent -> {dict(counts)}; slowest {slowest:.1f}s")
        assert set(counts) <= {"ok", "429 1", "sse-429"}, counts
        assert counts["ok"] >= 2
        assert counts["429 1"] + counts["sse-429"] >= BURST // 4
        # Nothing leaked, and it serves normally afterwards.
        eventually(lambda: rid_to_state_size(tok.target) == 0, timeout=30, what="rid_to_state empty")
        eventually(lambda: scheduler_load(sched.target).num_running_reqs == 0, timeout=30, what="idle")
        r = httpx.post(f"{gw.url}/generate", json={"text": "after", "sampling_params": {"max_new_tokens": 4}},
                       timeout=60)
        assert r.status_code == 200
        for svc in (detok, sched, tok, gw):
            assert svc.proc.alive()
            assert not svc.errors(), svc.errors()
