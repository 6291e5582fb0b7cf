"""`make bench`: ringserve (gateway, gRPC, in-process engine) side by side with vLLM CPU and transformers.

    python -m bench [--quick] [--targets gateway,native,grpc,engine,vllm,transformers]
                    [--models tiny,100m,smollm2-135m-instruct] [--workloads A,B,C,D]
                    [--repeats N] [--stream-interval N] [--lora N] [--dtype D] [--kv-cache-dtype K] [--out DIR]

Same model, same workloads, one target at a time (2 cores: nothing else should run meanwhile).
Writes DIR/results.json, DIR/results.md (the table) and PNG plots; prints the table at the end.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import time
from pathlib import Path

from bench import plots, report
from bench.model_info import resolve
from bench.targets import DESCRIPTIONS, TARGETS, RunResult, run_model, taking_turns
from bench.venvs import CACHE, log
from bench.workloads import select, workloads

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # names ringserve and vLLM share


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (about 5 minutes)")
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help=f"comma list of {','.join(TARGETS)} (default: all)")
    ap.add_argument("--models", default="tiny",
                    help="comma list of tiny, 100m, smollm2-135m-instruct (the default model) or model "
                         "directories (default: tiny)")
    ap.add_argument("--workloads", default="", help="comma list of A,B,C,D (or D@4); default all")
    ap.add_argument("--out", type=Path, default=None, help="default .cache/bench/results/<time>")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per workload on each server; the table shows the median run (default 3)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="both servers stream every N tokens (their --stream-interval; default 1)")
    ap.add_argument("--lora", type=int, default=0,
                    help="serve N random LoRA adapters, every request on one of them in turn (gateway and "
                         "native targets only; default 0: none)")
    ap.add_argument("--dtype", default="best",
                    help="every server's --dtype: best, float32 or bfloat16, one for all models or a comma "
                         "list, one per --models entry. best: bfloat16 where this CPU has AVX512-BF16 or AMX, "
                         "else float32 (default)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="every server's --kv-cache-dtype (default auto: each server's own choice for its "
                         "--dtype; both take these names)")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    dtypes = [d.strip() for d in args.dtype.split(",")]
    if len(dtypes) == 1:
        dtypes *= len(models)
    if len(dtypes) != len(models) or set(dtypes) - {"best", "float32", "bfloat16"}:
        ap.error("--dtype: best, float32 or bfloat16, once or once per --models entry")
    from services.scheduler.kernels.cpu_linear import native_bf16

    best = "bfloat16" if native_bf16() else "float32"
    args.model_dtypes = [(m, best if d == "best" else d) for m, d in zip(models, dtypes)]
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in args.targets if t not in TARGETS]
    if bad:
        ap.error(f"unknown targets {bad}; choose from {TARGETS}")
    if args.lora < 0:
        ap.error("--lora: must be >= 0")
    if args.lora and set(args.targets) - {"gateway", "native"}:
        ap.error("--lora: only the gateway and native targets send adapters; add --targets gateway,native")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out or CACHE / "results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    wls = select(workloads(args.quick), [n.strip() for n in args.workloads.split(",") if n.strip()])
    if not wls:
        log("no workload selected")
        return 2
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": report.commit(), "argv": sys.argv[1:],
            "quick": args.quick,
            "repeats": args.repeats,
            "taking_turns": taking_turns(args.targets, args.repeats),
            "stream_interval": args.stream_interval,
            "lora_adapters": args.lora,
            "dtypes": {},  # model directory name -> the dtype both servers ran it in
            "kv_cache_dtype": args.kv_cache_dtype,
            "targets": {t: DESCRIPTIONS[t] for t in args.targets},
            "workloads": [w.__dict__ | {"request_rate": str(w.request_rate)} for w in wls]}
    results: list[RunResult] = []
    per_model = sum(1 if t == "transformers" else len(wls) for t in args.targets)
    total = per_model * len(args.model_dtypes)
    t_start = time.monotonic()

    def emit(r: RunResult) -> None:
        # Where the servers take turns (run_model), a target's workload is emitted after each of its runs:
        # the newest replaces the one before.
        key = (r.target, r.model, r.workload, r.request_rate)
        at = next((i for i, x in enumerate(results) if (x.target, x.model, x.workload, x.request_rate) == key), None)
        if at is None:
            results.append(r)
        else:
            results[at] = r
        s = r.summary
        n = len(r.extra.get("output_throughput_runs", []))
        what = (f"{s['output_throughput']:,.0f} out tok/s, TTFT p50 {s['ttft_ms']['p50']:,.0f} ms, "
                f"ITL p50 {s['itl_ms']['p50']:,.1f} ms" + (f" (median of {n} runs)" if n > 1 else "")
                if s else r.note[:200].replace("\n", " "))
        log(f"({len(results)}/{total}) {r.target:<12} {r.model} {r.workload:<6} {r.status}: {what} "
            f"[{time.monotonic() - t_start:,.0f}s]")
        report.write(out, results, meta)  # partial results survive an interrupt

    atexit.register(lambda: log(f"results in {out}"))
    log(f"workloads: {', '.join(w.name for w in wls)}; targets: {', '.join(args.targets)}; "
        f"dtypes: {', '.join(f'{m} {d}' for m, d in args.model_dtypes)}, KV cache {args.kv_cache_dtype}; "
        f"out: {out}")
    load = os.getloadavg()[0]
    if load > 0.5:
        log(f"warning: the machine is busy (1-min load average {load:.1f}); numbers will be noisy "
            "(each run's load average is in results.json)")
    for name, dtype in args.model_dtypes:
        model = resolve(name)
        meta["dtypes"][model.name] = dtype
        run_model(args.targets, model, wls, args.quick, out, emit, args.stream_interval, args.repeats, args.lora,
                  dtype, args.kv_cache_dtype)
    report.write(out, results, meta)
    made = plots.all_plots(results, out)
    print("\n" + report.markdown(results) + "\n", flush=True)
    print(report.sections(results), flush=True)
    for p in made:
        log(f"plot: {p}")
    log(f"done in {time.monotonic() - t_start:,.0f}s")
    return 0 if any(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SIGTERM unwinds like Ctrl-C, so every started server is stopped by its finally block.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
