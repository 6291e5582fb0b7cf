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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench import bench_serving, grpc_client, step_profile
from bench.server_proc import Server
from bench.stats import RequestRecord, Summary, summarize
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


@dataclass
class WorkloadRuns:
    """One (target, workload)'s runs so far; where the servers take turns (run_model), from several calls."""

    summaries: list[Summary] = field(default_factory=list)
    steps: dict[str, float] = field(default_factory=dict)  # step counters summed over the runs after the first
    profiled: int = 0
    warm_steps: dict[str, float] = field(default_factory=dict)  # the first run's, with its warm-up request
    wall_s: float = 0.0
    load_before: float | None = None
    failed: bool = False  # once a run fails, the workload is not run again on that target

    def add_steps(self, d: dict[str, float], warm: bool) -> None:
        """One run's step counters: a run that sent the warm-up request is kept apart (its lone request's
        steps would dilute the batch figures), used only when there is no other."""
        if warm:
            self.warm_steps = d
            return
        self.steps = {k: self.steps.get(k, 0.0) + v for k, v in d.items()}
        self.profiled += 1


class Runs(dict[tuple[str, str, str, float], WorkloadRuns]):
    def of(self, target: str, model: Path, w: Workload) -> WorkloadRuns:
        return self.setdefault((target, model.name, w.name, w.request_rate), WorkloadRuns())


def _measure(target: str, model: Path, w: Workload,
             fn: Callable[[Workload, bool], tuple[list[RequestRecord], float]],
             emit: Emit, reps: range, runs: Runs, profile: Callable[[], dict[str, float]] | None = None,
             **extra: object) -> None:
    """Run repetitions `reps` (each with fresh prompts: another seed, no prefix-cache hits from the run
    before) and emit the result so far: the run with the median output throughput (all of them in extra),
    replacing what an earlier call emitted. Points of a request-rate sweep run once: they are long, and
    they are read as a curve.

    Only the first run of a (target, workload) sends a warm-up request (`fn(workload, warmup)`); the step
    profile covers the runs after it, so a lone warm-up request's steps do not dilute it (with one run it
    includes them).
    """
    if not math.isinf(w.request_rate):  # a sweep point runs once
        reps = range(1) if 0 in reps else range(0)
    e = runs.of(target, model, w)
    if not reps or e.failed:
        return
    t0 = time.monotonic()
    if e.load_before is None:
        e.load_before = os.getloadavg()[0]
    try:
        for rep in reps:
            warm = not e.summaries  # this server's first run of the workload
            before = profile() if profile else None
            recs, dur = fn(replace(w, seed=w.seed + REPEAT_SEED_STEP * rep + SEED_OFFSETS.get(target, 0)), warm)
            e.summaries.append(summarize(recs, dur))
            if profile and before is not None:
                e.add_steps(step_profile.delta(before, profile()), warm)
    except Exception as exc:  # one run's failure is a result, not the end of the benchmark
        e.failed = True
        emit(_result(target, model, w, "failed", f"{type(exc).__name__}: {exc}"[-1500:],
                     wall_s=e.wall_s + time.monotonic() - t0))
        return
    e.wall_s += time.monotonic() - t0
    s = sorted(e.summaries, key=lambda r: r.output_throughput)[len(e.summaries) // 2]
    failed = next((r for r in e.summaries if r.failed), None)
    status = "ok" if failed is None else "failed"
    note = "" if failed is None else f"{failed.failed} requests failed: {failed.first_error}"
    if e.profiled or e.warm_steps:
        extra["step_profile"] = step_profile.summary(e.steps if e.profiled else e.warm_steps)
        extra["step_profile_runs"] = e.profiled or 1
    # 1-min load average before and after: other work on the machine shows up here
    emit(_result(target, model, w, status, note, summary=s.to_dict(), wall_s=e.wall_s,
                 extra={"loadavg_before": e.load_before, "loadavg_after": os.getloadavg()[0],
                        "output_throughput_runs": [round(r.output_throughput, 1) for r in e.summaries], **extra}))


def _fail_all(targets: list[str], model: Path, wls: list[Workload], status: str, note: str, emit: Emit) -> None:
    for t in targets:
        for w in wls:
            emit(_result(t, model, w, status, note))


Measure = Callable[[Workload, range], None]  # one workload's repetitions on a started server


@contextmanager
def ringserve_session(targets: list[str], model: Path, wls: list[Workload], out: Path, emit: Emit, runs: Runs,
                      stream_interval: int = 1, lora: int = 0, dtype: str = "float32",
                      kv_cache_dtype: str = "auto") -> Iterator[Measure | None]:
    """ringserve started for the selected served targets (smg too, in front of its scheduler): the measure
    function while it runs, or None when it did not start (reported); stopped on exit."""
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
        yield None
        return
    profile = lambda: step_profile.scrape(rs.scheduler_metrics)  # noqa: E731
    smg = _start_smg(targets, model, wls, f"127.0.0.1:{sglang_port}", emit)

    def measure(w: Workload, reps: range) -> None:
        if "gateway" in targets:
            _measure("gateway", model, w, lambda wr, warm: bench_serving.run(
                wr, rs.gateway_url, model, model.name, out / "raw", warmup=warm, lora_names=names)[:2],
                emit, reps, runs, profile, lora_adapters=lora)
        if "native" in targets:
            _measure("native", model, w, lambda wr, warm: bench_serving.run(
                wr, rs.gateway_url, model, model.name, out / "raw", backend="sglang", warmup=warm,
                lora_names=names)[:2],
                emit, reps, runs, profile, token_id_prompts=w.dataset == "random-ids", lora_adapters=lora)
        if "grpc" in targets:
            _measure("grpc", model, w, lambda wr, warm: grpc_client.run(wr, rs.grpc_target, model, warm), emit,
                     reps, runs, profile)
        if smg is not None:
            # bench_serving sends best_of=1, which smg refuses on a stream; null is its default
            _measure("smg", model, w, lambda wr, warm: bench_serving.run(
                wr, smg[1], model, smg[2], out / "raw", warmup=warm, extra_body={"best_of": None})[:2],
                emit, reps, runs, profile)

    try:
        yield measure
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


@contextmanager
def vllm_session(model: Path, wls: list[Workload], out: Path, emit: Emit, runs: Runs, stream_interval: int = 1,
                 dtype: str = "float32", kv_cache_dtype: str = "auto") -> Iterator[Measure | None]:
    """vLLM CPU started: the measure function while it runs, or None when it did not start (reported)."""
    from bench.vllm_server import start_vllm

    try:
        srv, base = start_vllm(model, model.name, dtype=dtype, extra=["--stream-interval", str(stream_interval),
                                                                      "--kv-cache-dtype", kv_cache_dtype])
    except Exception as e:
        _fail_all(["vllm"], model, wls, "failed", f"vLLM did not start: {str(e)[-1200:]}", emit)
        yield None
        return

    def measure(w: Workload, reps: range) -> None:
        _measure("vllm", model, w, lambda wr, warm: bench_serving.run(wr, base, model, model.name, out / "raw",
                                                                warmup=warm)[:2],
                 emit, reps, runs)

    try:
        yield measure
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
    """Every selected target on one model. Both servers stream every `stream_interval` tokens
    (--stream-interval on each); the served targets run each workload `repeats` times and report the
    median run.

    With ringserve and vLLM both selected (and more than one repeat) they take turns: both are started,
    each idle while the other runs (measured: ringserve's processes used 1 CPU-second in 108 s of vLLM's
    runs, vLLM none in ringserve's), and each workload's repetitions alternate between them (ringserve's
    first, then vLLM's, and again). This machine's speed drifts by tens of percent within minutes (other tenants
    of the host), and two medians taken ten minutes apart, one server after the other, carried that drift
    into their ratio. Otherwise one server at a time, each stopped before the next starts. The engine and
    transformers targets run after the servers are stopped: they measure the machine alone."""
    runs = Runs()
    served = [t for t in targets if t in RINGSERVE_TARGETS]
    sessions: list[Callable[[], AbstractContextManager[Measure | None]]] = []
    if served:
        sessions.append(lambda: ringserve_session(served, model, wls, out, emit, runs, stream_interval, lora, dtype,
                                                  kv_cache_dtype))
    if "vllm" in targets:
        sessions.append(lambda: vllm_session(model, wls, out, emit, runs, stream_interval, dtype, kv_cache_dtype))
    if taking_turns(targets, repeats):
        try:
            with ExitStack() as stack:
                started = [m for m in (stack.enter_context(s()) for s in sessions) if m is not None]
                for rep in range(repeats):
                    if len(started) > 1:
                        log(f"{model.name}: repetition {rep + 1} of {repeats}, the servers taking turns")
                    for w in wls:
                        for measure in started:
                            measure(w, range(rep, rep + 1))
        except Exception:
            log(f"served targets on {model.name}: unexpected error\n{traceback.format_exc()}")
    else:
        for session in sessions:
            try:
                with session() as run:
                    if run is not None:
                        for w in wls:
                            run(w, range(repeats))
            except Exception:
                log(f"a served target on {model.name}: unexpected error\n{traceback.format_exc()}")
    for names, fn in ((["engine"], lambda: run_engine(model, wls, quick, out, emit, dtype, kv_cache_dtype)),
                      (["transformers"], lambda: run_transformers(model, wls, out, emit))):
        if any(t in targets for t in names):
            try:
                fn()
            except Exception:
                log(f"{'/'.join(names)} on {model.name}: unexpected error\n{traceback.format_exc()}")


def taking_turns(targets: list[str], repeats: int) -> bool:
    """Whether run_model alternates ringserve's and vLLM's repetitions."""
    return repeats > 1 and "vllm" in targets and any(t in targets for t in RINGSERVE_TARGETS)
