"""The benchmarked targets, grouped by the server they need; each group starts and stops its own.

A target that cannot start or fails a run is reported (status "failed" / "skipped" with the
reason) and the others go on.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench import bench_serving, grpc_client, step_profile
from bench.server_proc import Server
from bench.stats import RequestRecord, summarize
from bench.venvs import ROOT, log
from bench.workloads import Workload
from ringserve.process import free_port

TARGETS = ("gateway", "grpc", "engine", "vllm", "transformers", "native", "smg")
DESCRIPTIONS = {
    "gateway": "ringserve, 4 processes, HTTP /v1/completions through the gateway (bench_serving)",
    "grpc": "ringserve, the tokenizer's gRPC Generate directly (own async client, input_ids)",
    "engine": "the scheduler's Engine in-process, no RPC (submit/step)",
    "vllm": "vLLM CPU, OpenAI /v1/completions (bench_serving)",
    "transformers": "bench/engine_bench.py (the engine in process against transformers generate)",
    "native": "ringserve, SGLang-native /generate through the gateway (bench_serving --backend sglang, "
              "token-id prompts on random-ids workloads: the same requests as grpc)",
    "smg": "SGLang's gateway (smg 1.13) in front of ringserve's scheduler (its --sglang-grpc-port, the same "
           "scheduler process the gateway target uses), OpenAI /v1/completions (bench_serving)",
}
RINGSERVE_TARGETS = ("gateway", "native", "grpc", "smg")
REPEAT_SEED_STEP = 7919  # workload seeds are small and distinct; repeats step far away from them
# gateway and native both draw prompts from bench_serving on one server: with the same seed native
# would find every prompt in the prefix cache the gateway's runs left behind.
SEED_OFFSETS = {"native": 104729, "smg": 130363}  # smg too: it runs on the same scheduler


@dataclass
class RunResult:
    target: str
    model: str
    workload: str
    family: str
    request_rate: float
    status: str                        # ok | failed | skipped
    note: str = ""
    summary: dict | None = None
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


Emit = Callable[[RunResult], None]


def _result(target: str, model: Path, w: Workload, status: str, note: str = "", **kw) -> RunResult:
    return RunResult(target, model.name, w.name, w.family, w.request_rate, status, note, **kw)


def _measure(target: str, model: Path, w: Workload,
             fn: Callable[[Workload, bool], tuple[list[RequestRecord], float]],
             emit: Emit, repeats: int = 1, profile: Callable[[], dict[str, float]] | None = None,
             **extra: object) -> None:
    """Run `repeats` times, each with fresh prompts (another seed: no prefix-cache hits from the run
    before); report the run with the median output throughput (all of them in extra). Points of a
    request-rate sweep run once: they are long, and they are read as a curve.

    Only the first run sends a warm-up request (`fn(workload, warmup)`); the step profile covers the
    runs after it, so a lone warm-up request's steps do not dilute it (with one run it includes them).
    """
    if not math.isinf(w.request_rate):
        repeats = 1
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    runs = []
    try:
        before = profile() if profile else None
        for rep in range(repeats):
            recs, dur = fn(replace(w, seed=w.seed + REPEAT_SEED_STEP * rep + SEED_OFFSETS.get(target, 0)), rep == 0)
            runs.append(summarize(recs, dur))
            if profile and rep == 0 and repeats > 1:
                before = profile()
        if profile and before is not None:
            extra["step_profile"] = step_profile.summary(step_profile.delta(before, profile()))
            extra["step_profile_runs"] = max(1, repeats - 1)
    except Exception as e:  # one run's failure is a result, not the end of the benchmark
        emit(_result(target, model, w, "failed", f"{type(e).__name__}: {e}"[-1500:], wall_s=time.monotonic() - t0))
        return
    s = sorted(runs, key=lambda r: r.output_throughput)[len(runs) // 2]
    failed = next((r for r in runs if r.failed), None)
    status = "ok" if failed is None else "failed"
    note = "" if failed is None else f"{failed.failed} requests failed: {failed.first_error}"
    # 1-min load average before and after: other work on the machine shows up here
    emit(_result(target, model, w, status, note, summary=s.to_dict(), wall_s=time.monotonic() - t0,
                 extra={"loadavg_before": load_before, "loadavg_after": os.getloadavg()[0],
                        "output_throughput_runs": [round(r.output_throughput, 1) for r in runs], **extra}))


def _fail_all(targets: list[str], model: Path, wls: list[Workload], status: str, note: str, emit: Emit) -> None:
    for t in targets:
        for w in wls:
            emit(_result(t, model, w, status, note))


def run_ringserve(targets: list[str], model: Path, wls: list[Workload], out: Path, emit: Emit,
                  stream_interval: int = 1, repeats: int = 1, lora: int = 0, dtype: str = "float32",
                  kv_cache_dtype: str = "auto") -> None:
    from bench.lora import make_adapters
    from bench.ringserve_server import start_ringserve

    adapters = make_adapters(model, lora, out / "lora") if lora else []
    names = [n for n, _ in adapters] or None
    lora_flags = ["--lora-paths", *(f"{n}={p}" for n, p in adapters)] if adapters else []
    sched_args = f"--stream-interval {stream_interval} --dtype {dtype} --kv-cache-dtype {kv_cache_dtype}"
    sglang_port = free_port()
    if "smg" in targets:
        sched_args += f" --sglang-grpc-port {sglang_port}"  # smg's worker: the same scheduler
    try:
        rs = start_ringserve(model, extra=["--scheduler-args", sched_args, *lora_flags])
    except Exception as e:
        _fail_all(targets, model, wls, "failed", f"ringserve did not start: {str(e)[-1200:]}", emit)
        return
    profile = lambda: step_profile.scrape(rs.scheduler_metrics)  # noqa: E731
    smg = _start_smg(targets, model, wls, f"127.0.0.1:{sglang_port}", emit)
    try:
        for w in wls:
            if "gateway" in targets:
                _measure("gateway", model, w, lambda wr, warm: bench_serving.run(
                    wr, rs.gateway_url, model, model.name, out / "raw", warmup=warm, lora_names=names)[:2],
                    emit, repeats, profile, lora_adapters=lora)
            if "native" in targets:
                _measure("native", model, w, lambda wr, warm: bench_serving.run(
                    wr, rs.gateway_url, model, model.name, out / "raw", backend="sglang", warmup=warm,
                    lora_names=names)[:2],
                    emit, repeats, profile, token_id_prompts=w.dataset == "random-ids", lora_adapters=lora)
            if "grpc" in targets:
                _measure("grpc", model, w, lambda wr, warm: grpc_client.run(wr, rs.grpc_target, model, warm), emit,
                         repeats, profile)
            if smg is not None:
                # bench_serving sends best_of=1, which smg refuses on a stream; null is its default
                _measure("smg", model, w, lambda wr, warm: bench_serving.run(
                    wr, smg[1], model, smg[2], out / "raw", warmup=warm, extra_body={"best_of": None})[:2],
                    emit, repeats, profile)
    finally:
        if smg is not None:
            smg[0].stop()
        rs.server.stop()


def _start_smg(targets: list[str], model: Path, wls: list[Workload], worker: str,
               emit: Emit) -> tuple[Server, str, str] | None:
    """smg in front of the scheduler's SGLang-protocol port: (its server, URL, the model name it
    serves), or None (not selected, or reported skipped / failed)."""
    if "smg" not in targets:
        return None
    from bench.smg_server import model_id, smg_binary, smg_cmd, wait_ready

    if smg_binary() is None:
        _fail_all(["smg"], model, wls, "skipped", "smg is not installed (pip install smg==1.13.0)", emit)
        return None
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Readiness is its /readiness (wait_ready), not a line: the marker is unused.
    server = Server("smg", smg_cmd([worker], str(model), port), marker="Router ready", stop_timeout=10)
    try:
        server.proc.start()
        wait_ready(server.proc, url, timeout=120)
        return server, url, model_id(url)
    except Exception as e:
        server.stop()
        _fail_all(["smg"], model, wls, "failed", f"smg did not start: {str(e)[-1200:]}", emit)
        return None


def run_vllm(model: Path, wls: list[Workload], out: Path, emit: Emit, stream_interval: int = 1,
             repeats: int = 1, dtype: str = "float32", kv_cache_dtype: str = "auto") -> None:
    from bench.vllm_server import start_vllm

    try:
        srv, base = start_vllm(model, model.name, dtype=dtype, extra=["--stream-interval", str(stream_interval),
                                                                      "--kv-cache-dtype", kv_cache_dtype])
    except Exception as e:
        _fail_all(["vllm"], model, wls, "failed", f"vLLM did not start: {str(e)[-1200:]}", emit)
        return
    try:
        for w in wls:
            _measure("vllm", model, w, lambda wr, warm: bench_serving.run(wr, base, model, model.name, out / "raw",
                                                                    warmup=warm)[:2],
                     emit, repeats)
    finally:
        srv.stop()


def run_engine(model: Path, wls: list[Workload], quick: bool, out: Path, emit: Emit, dtype: str = "float32",
               kv_cache_dtype: str = "auto") -> None:
    if importlib.util.find_spec("services.scheduler.core.engine") is None:
        _fail_all(["engine"], model, wls, "skipped", "services.scheduler.core.engine is not there yet", emit)
        return
    res_file = out / "raw" / f"engine-{model.name}.json"
    res_file.parent.mkdir(parents=True, exist_ok=True)
    log_file = res_file.with_suffix(".log")
    cmd = [sys.executable, "-m", "bench.engine_target", "--model", str(model), "--out", str(res_file),
           "--workloads", ",".join(w.name for w in wls), "--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype,
           *(["--quick"] if quick else [])]
    log(f"engine in-process for {model.name} (log: {log_file})")
    t0 = time.monotonic()
    with log_file.open("w") as lf:
        code = subprocess.run(cmd, cwd=ROOT, stdout=lf, stderr=subprocess.STDOUT).returncode
    if code != 0 or not res_file.exists():
        tail = log_file.read_text(errors="replace")[-1200:]
        _fail_all(["engine"], model, wls, "failed", f"engine run exited with {code}: {tail}", emit)
        return
    by_name = {r["workload"]: r for r in json.loads(res_file.read_text())}
    for w in wls:
        r = by_name.get(w.name)
        if r is None:
            emit(_result("engine", model, w, "failed", "no result"))
            continue
        s = summarize([RequestRecord(**d) for d in r["records"]], r["duration_s"])
        extra = {"step_profile": step_profile.summary(r["step_profile"])} if "step_profile" in r else {}
        emit(_result("engine", model, w, "ok", summary=s.to_dict(), wall_s=(time.monotonic() - t0) / len(wls),
                     extra=extra))


def run_transformers(model: Path, wls: list[Workload], out: Path, emit: Emit) -> None:
    """Delegates to bench/engine_bench.py (engine vs transformers generate / static batch /
    generate_batch, in-process); its own workload, so one summary row."""
    w = wls[0]
    shape = {"ringserve-tiny-llama": "tiny", "ringserve-100m-llama": "100m"}.get(model.name)
    if shape is None:
        emit(RunResult("transformers", model.name, "own", "own", w.request_rate, "skipped",
                       "bench.engine_bench runs the default models only"))
        return
    cmd = [sys.executable, "-m", "bench.engine_bench", "--shape", shape, "--concurrency", "1,32",
           "--output-len", "64"]
    log(f"transformers baseline: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    (out / "raw" / f"transformers-{model.name}.log").write_text(proc.stdout + proc.stderr)
    rates = parse_scheduler_bench(proc.stdout)
    note = "; ".join(f"{c}: " + ", ".join(f"{n} {r:,.0f}" for n, r in rs.items()) for c, rs in rates.items())
    emit(RunResult("transformers", model.name, "own", "own", w.request_rate,
                   "ok" if proc.returncode == 0 and rates else "failed",
                   note=f"output tok/s, bench.engine_bench: {note}" if rates else (proc.stderr[-800:]),
                   wall_s=time.monotonic() - t0, extra={"rates": rates}))


def parse_scheduler_bench(text: str) -> dict[str, dict[str, float]]:
    """`  c=32  hf-seq    2048 tokens in  1.00s =   2048.0 tok/s` lines -> {"c=32": {"hf-seq": 2048.0}}."""
    rates: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].startswith("c=") and line.rstrip().endswith("tok/s"):
            try:
                rates.setdefault(parts[0], {})[parts[1]] = float(parts[-2])
            except ValueError:
                continue
    return rates


def run_model(targets: list[str], model: Path, wls: list[Workload], quick: bool, out: Path, emit: Emit,
              stream_interval: int = 1, repeats: int = 1, lora: int = 0, dtype: str = "float32",
              kv_cache_dtype: str = "auto") -> None:
    """Every selected target on one model, one server at a time (they would compete for 2 cores).
    Both servers stream every `stream_interval` tokens (--stream-interval on each); the served
    targets run each workload `repeats` times and report the median run."""
    groups: list[tuple[list[str], Callable[[], None]]] = [
        (list(RINGSERVE_TARGETS), lambda: run_ringserve([t for t in targets if t in RINGSERVE_TARGETS],
                                                        model, wls, out, emit, stream_interval, repeats, lora,
                                                        dtype, kv_cache_dtype)),
        (["engine"], lambda: run_engine(model, wls, quick, out, emit, dtype, kv_cache_dtype)),
        (["vllm"], lambda: run_vllm(model, wls, out, emit, stream_interval, repeats, dtype, kv_cache_dtype)),
        (["transformers"], lambda: run_transformers(model, wls, out, emit)),
    ]
    for names, fn in groups:
        if any(t in targets for t in names):
            try:
                fn()
            except Exception:
                log(f"{'/'.join(names)} on {model.name}: unexpected error\n{traceback.format_exc()}")
