"""Send a workload's requests on its schedule (arrival times, concurrency cap) and time them.

`send(i)` is an async callable that performs request i and returns its RequestRecord; this module
only decides when each one starts, like bench_serving's request loop (one warm-up request first,
unless the caller says the server is warm already).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from bench.stats import RequestRecord
from bench.workloads import Workload, arrival_times


async def drive(w: Workload, send: Callable[[int], Awaitable[RequestRecord]],
                warmup: bool = True) -> tuple[list[RequestRecord], float]:
    """Returns (records in request order, duration from the first send to the last finish)."""
    if warmup:
        warm = await send(0)
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
    sem = asyncio.Semaphore(w.max_concurrency) if w.max_concurrency else None
    start = time.perf_counter()

    async def one(i: int, at: float) -> RequestRecord:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # Poisson arrival schedule, not a readiness wait
        if sem is None:
            return await send(i)
        async with sem:
            return await send(i)

    records = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrival_times(w))))
    return list(records), time.perf_counter() - start
