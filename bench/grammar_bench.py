"""Grammar mask cost as a share of a real engine decode step:

    python -m bench.grammar_bench [--batch 32] [--steps 64] [--shape tiny|100m]

Runs `batch` requests at once through the in-process Engine twice, all JSON-schema constrained and
then unconstrained (same prompts, seeds, temperature), and times every decode step whose batch is
full (median over --repeats alternating runs). The mask time is the GrammarMasker's own fill +
apply time of that step. The schema asks for
long output so no row finishes early and the batch stays full.
(`python -m bench.grammar_mask_bench` times the mask alone, without a model.)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

from bench.engine_bench import make_prompts, model_dir

SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 20, "maxItems": 40, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "qty": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "qty"]}}}, "required": ["items"]}


def full_decode_steps(engine, prompts: list[list[int]], params: list) -> tuple[list[float], list[float]]:
    """(step seconds, mask seconds) of every decode step that ran the whole batch."""
    from services.scheduler.core.req import Req

    sched, masker = engine.scheduler, engine.grammar.masker
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.submit(Req(rid=f"gb-{time.monotonic_ns()}-{i}", origin_input_ids=p, params=sp))
    steps: list[float] = []
    masks: list[float] = []
    while engine.has_work():
        if not sched.has_work():
            engine.wait_for_work(0.05)  # grammars compiling
        full = len(sched.running) == len(prompts) and not sched.waiting and sched.chunked is None
        decodes = sched.stats.decode_steps
        if masker is not None:
            masker.last_seconds = 0.0
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if full and sched.stats.decode_steps == decodes + 1:
            steps.append(dt)
            masks.append(masker.last_seconds if masker is not None else 0.0)
    return steps, masks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64, help="max_new_tokens of every request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from services.scheduler.config import EngineConfig
    from services.scheduler.core.engine import Engine
    from services.scheduler.model_executor.sampling import SamplingParams

    path = model_dir(args.shape)
    engine = Engine(EngineConfig(model=path, device="cpu", max_running_requests=args.batch,
                                 max_total_tokens=args.batch * (64 + args.steps + 8), num_threads=args.num_threads))
    engine.warmup()
    prompts = make_prompts(args.batch, 32, 64, engine.runner.vocab_size, seed=0)
    base = dict(temperature=1.0, max_new_tokens=args.steps, ignore_eos=True)
    schema = json.dumps(SCHEMA)
    engine.generate(prompts[:2], SamplingParams(**base, json_schema=schema))  # compile + warm the cache
    runs = {"constrained": [SamplingParams(**base, seed=i, json_schema=schema) for i in range(args.batch)],
            "unconstrained": [SamplingParams(**base, seed=i) for i in range(args.batch)]}
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runs}
    for _ in range(args.repeats):  # alternate the two runs so load from other processes hits both alike
        for name, params in runs.items():
            steps, masks = full_decode_steps(engine, prompts, params)
            times[name][0].extend(steps)
            times[name][1].extend(masks)
    ms = lambda xs: 1000 * statistics.median(xs) if xs else float("nan")  # noqa: E731
    for name, (steps, masks) in times.items():
        print(f"{name:<13} batch {args.batch}: {len(steps):4d} full decode steps, median step {ms(steps):.2f} ms, "
              f"mask {ms(masks):.3f} ms", flush=True)
    step_c, mask_c, step_u = ms(times["constrained"][0]), ms(times["constrained"][1]), ms(times["unconstrained"][0])
    print(f"mask share of a constrained decode step: {100 * mask_c / step_c:.2f}%  "
          f"(median step constrained / unconstrained: {step_c / step_u:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
