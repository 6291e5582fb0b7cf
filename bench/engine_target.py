"""The scheduler's Engine in-process, no RPC: the upper bound for what the services can deliver.

Runs in its own process (torch, threads, memory stay out of the harness):
    python -m bench.engine_target --model DIR --workloads A,B --quick --out results.json
Requests are submitted on the workload's schedule between engine steps; each step's outputs are
timestamped like streamed chunks, so TTFT/ITL/e2e mean what they mean for the other targets.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import uuid
from collections import deque
from dataclasses import replace
from pathlib import Path

from bench import step_profile
from bench.model_info import vocab
from bench.stats import RequestRecord, StreamTimer
from bench.workloads import Workload, arrival_times, make_prompts, select, workloads


def run_one(engine, w: Workload, prompts: list[list[int]]) -> tuple[list[RequestRecord], float]:
    from services.scheduler.core.req import Req
    from services.scheduler.model_executor.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=w.output_len, ignore_eos=True)
    arrivals = deque(enumerate(arrival_times(w)))
    # A shared-prefix workload makes groups x per-group prompts whatever num_prompts says (the warm-up
    # batch asks for fewer): send as many as there are arrivals.
    prompts = prompts[:len(arrivals)]
    timers: dict[str, tuple[int, StreamTimer]] = {}
    records: list[RequestRecord | None] = [None] * len(prompts)
    cap = w.max_concurrency or len(prompts)
    start = time.perf_counter()
    done = 0
    while done < len(prompts):
        now = time.perf_counter()
        while arrivals and len(timers) < cap and start + arrivals[0][1] <= now:
            i, _ = arrivals.popleft()
            rid = f"bench-{w.name}-{i}-{uuid.uuid4().hex[:8]}"
            timers[rid] = (i, StreamTimer(time.perf_counter()))
            engine.submit(Req(rid=rid, origin_input_ids=list(prompts[i]), params=params, stream=True))
        if not timers:  # idle until the next Poisson arrival
            time.sleep(max(0.0, start + arrivals[0][1] - time.perf_counter()))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            entry = timers.get(o.rid)
            if entry is None:
                continue
            i, timer = entry
            timer.chunk(t, len(o.ids))
            if o.finish is not None:
                records[i] = timer.record(len(prompts[i]), t)
                del timers[o.rid]
                done += 1
    return [r for r in records if r is not None], time.perf_counter() - start


def _profile(engine) -> dict[str, float]:
    """The step counters the served targets scrape from /metrics: SchedulerStats under the same names."""
    return {k: getattr(engine.scheduler.stats, k) for k in step_profile.FIELDS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--workloads", default="")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from services.scheduler.config import EngineConfig
    from services.scheduler.core.engine import Engine
    from services.scheduler.memory import configure_malloc

    configure_malloc()  # as the scheduler service does

    engine = Engine(EngineConfig(model=str(args.model), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype))
    engine.warmup()
    size, special = vocab(args.model)
    results = []
    wls = select(workloads(args.quick), [n for n in args.workloads.split(",") if n])
    # The servers have served requests before they are measured; give the bare engine one batch too
    # (first-batch allocations would otherwise land in the first workload).
    if wls:
        first = replace(wls[0], num_prompts=min(8, wls[0].num_prompts), request_rate=math.inf, max_concurrency=None)
        run_one(engine, first, make_prompts(replace(first, seed=first.seed + 1000), size, special))
    for w in wls:
        prompts = make_prompts(w, size, special)
        # One warm-up request first, like the other targets (the prefix cache is never flushed,
        # as in the servers; each workload has its own seed, so only the warm-up prompt repeats).
        run_one(engine, replace(w, num_prompts=1, request_rate=math.inf, max_concurrency=None), prompts[:1])
        before = _profile(engine)
        recs, dur = run_one(engine, w, prompts)
        after = _profile(engine)
        results.append({"workload": w.name, "duration_s": dur, "records": [r.__dict__ for r in recs],
                        "step_profile": {k: after[k] - before[k] for k in after}})
        print(f"[engine] {w.name}: {sum(r.output_len for r in recs) / dur:.0f} output tok/s", flush=True)
    args.out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
