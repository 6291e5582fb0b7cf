"""The ring's own CPU per streamed token: gateway, tokenizer and detokenizer driven at their limit.

    python -m bench.ring_cpu [--model smollm2-135m-instruct] [--replicas 1,2] [--num-prompts 256]
                             [--max-concurrency 64] [--vllm-prompts 64]

The scheduler runs with --synthetic-forward (its scheduling and KV pools are real, the model is
not run), so the services around it carry as many tokens as they can. Each replica count N starts
one scheduler and one detokenizer, N tokenizers and N gateways (gateway i on tokenizer i), and
SGLang's bench_serving streams workload-B-shaped requests (token-id prompts, `--backend sglang`, the
gateway's /generate) into every gateway at once. Per service it reports process CPU time (user +
system, from /proc) over the streamed output tokens, and the tokens per second the ring carried.
It also reports the requests per decode step (the scheduler's counters): each hop of the ring carries
one step's tokens in one message, so this is the batch each message carried in the run.

The floor, in the same run (`bench.hop_floor`): after each ring run, a bare chain of streams at that
run's step rate and requests per step, raw TCP and gRPC, none of the ring's own work in it: what two
services that pass each step's message on and one that reads it pay for the messages alone.

The anchor, in the same run: vLLM's CPU build on the same model (its forward is real), the same
request shape through its OpenAI API; its API-server process's CPU per output token (its engine
core runs in a child process, not counted). Run on a quiet machine: the load generator shares it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from bench import bench_serving, hop_floor, step_profile
from bench.model_info import resolve
from bench.report import commit
from bench.stats import RequestRecord
from bench.venvs import CACHE, log
from bench.workloads import Workload
from ringserve.model_source import DEFAULT_MODEL
from ringserve.process import ServiceProcess, free_port, python_cmd

STARTUP_S = 300.0
FLOOR_MESSAGES = 3000  # per bare-stream chain after a ring run (7-8 s each at the ring's ~400 steps a second)
RING = ("gateway", "tokenizer", "detokenizer")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads, not its children)."""
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


@dataclass
class ServiceCpu:
    service: str      # gateway, tokenizer, detokenizer, scheduler, vllm-api-server
    replicas: int
    cpu_s: float      # summed over the replicas
    tokens: int

    @property
    def us_per_token(self) -> float:
        return self.cpu_s / self.tokens * 1e6 if self.tokens else math.nan


@dataclass
class RunCpu:
    target: str           # "ringserve xN" or "vllm"
    output_tokens: int
    duration_s: float
    failed: int
    services: list[ServiceCpu]
    rows_per_step: float = math.nan  # requests per decode step (the ring's batch per message); nan: vLLM
    floors: list[hop_floor.Floor] = field(default_factory=list)  # the bare streams at this run's rate and rows

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else math.nan

    def ring_us_per_token(self) -> float:
        return sum(s.us_per_token for s in self.services if s.service in RING)

    def floor(self, kind: str) -> float:
        """CPU us per token of the ring's three services at the bare `kind` streams' floor (nan: not run)."""
        return next((f.ring_us_per_token for f in self.floors if f.kind == kind), math.nan)

    def to_dict(self) -> dict:
        return {**asdict(self), "tok_s": self.tok_s, "ring_us_per_token": self.ring_us_per_token(),
                "us_per_token": {s.service: s.us_per_token for s in self.services},
                "floor_us_per_token": {f.kind: f.ring_us_per_token for f in self.floors}}


def measure(pids: dict[str, list[int]], run: Callable[[], tuple[list[RequestRecord], float]], target: str) -> RunCpu:
    """CPU of each named group of processes across `run` (which returns its records and duration)."""
    before = {name: sum(cpu_seconds(p) for p in ps) for name, ps in pids.items()}
    records, duration = run()
    after = {name: sum(cpu_seconds(p) for p in ps) for name, ps in pids.items()}
    tokens = sum(r.output_len for r in records if r.ok)
    return RunCpu(target, tokens, duration, sum(1 for r in records if not r.ok),
                  [ServiceCpu(name, len(pids[name]), after[name] - before[name], tokens) for name in pids])


class Ring:
    """One scheduler (synthetic forward) and detokenizer, N tokenizers, N gateways, as local processes."""

    def __init__(self, model: Path, replicas: int, log_dir: Path) -> None:
        self.model, self.replicas, self.log_dir = model, replicas, log_dir
        self.procs: dict[str, list[ServiceProcess]] = {}
        self.gateway_urls: list[str] = []
        self.scheduler_metrics = ""  # its /metrics URL

    def _start(self, name: str, module: str, *args: str, http: bool = False) -> str:
        port = free_port()
        sink = (self.log_dir / f"{name}-{len(self.procs.get(name, []))}.log").open("w")
        proc = ServiceProcess(name, python_cmd(module, "--host", "127.0.0.1", "--port", str(port), *args),
                              env={"RINGSERVE_LOG_LEVEL": "WARNING"}, sink=sink).start()
        self.procs.setdefault(name, []).append(proc)
        target = f"127.0.0.1:{port}"
        if http:
            proc.wait_ready_line(STARTUP_S)
        else:
            proc.wait_serving(target, STARTUP_S)
        return target

    def start(self) -> Ring:
        model = ["--model", str(self.model)]
        m = [*model, "--metrics-port", "-1"]
        detok = self._start("detokenizer", "services.detokenizer", *m)
        metrics_port = free_port()  # the scheduler's step counters (rows per decode step)
        sched = self._start("scheduler", "services.scheduler", *model, "--metrics-port", str(metrics_port),
                            "--detokenizer", detok, "--synthetic-forward", "--max-running-requests", "512")
        self.scheduler_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        for _ in range(self.replicas):
            tok = self._start("tokenizer", "services.tokenizer", *m, "--scheduler", sched, "--detokenizer", detok)
            gw = self._start("gateway", "gateway", "--tokenizer", tok, http=True)
            self.gateway_urls.append(f"http://{gw}")
        return self

    def pids(self) -> dict[str, list[int]]:
        return {name: [p.pid for p in ps if p.pid is not None] for name, ps in self.procs.items()}

    def stop(self) -> None:
        for name in ("gateway", "tokenizer", "scheduler", "detokenizer"):
            for p in self.procs.get(name, []):
                p.stop(timeout=20)


def split(w: Workload, parts: int) -> list[Workload]:
    """The workload shared out over `parts` load generators (distinct seeds: no prefix-cache hits)."""
    return [replace(w, name=f"{w.name}-{i}", num_prompts=max(1, w.num_prompts // parts),
                    max_concurrency=max(1, (w.max_concurrency or w.num_prompts) // parts), seed=w.seed + 7919 * i)
            for i in range(parts)]


def drive(w: Workload, urls: list[str], model: Path, backend: str, out: Path) -> tuple[list[RequestRecord], float]:
    """bench_serving into every URL at once (one client process each); the duration is the longest."""
    results: list[tuple[list[RequestRecord], float]] = []
    errors: list[BaseException] = []

    def one(part: Workload, url: str) -> None:
        try:
            recs, dur, _ = bench_serving.run(part, url, model, model.name, out, backend=backend, warmup=False)
            results.append((recs, dur))
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(part, url)) for part, url in zip(split(w, len(urls)), urls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for recs, _ in results for r in recs], max(d for _, d in results)


def warm(urls: list[str], model: Path, backend: str, out: Path) -> None:
    w = Workload("warm", "warm-up", num_prompts=2, input_len=16, output_len=8, seed=99)
    for url in urls:
        bench_serving.run(w, url, model, model.name, out, backend=backend, warmup=False)


def run_ring(model: Path, replicas: int, w: Workload, out: Path) -> RunCpu:
    log(f"ringserve x{replicas}: starting (scheduler with --synthetic-forward)")
    ring = Ring(model, replicas, out).start()
    try:
        warm(ring.gateway_urls, model, "sglang", out)
        log(f"ringserve x{replicas}: {w.num_prompts} requests, {w.input_len} in / {w.output_len} out, "
            f"concurrency {w.max_concurrency}")
        steps = step_profile.scrape(ring.scheduler_metrics)
        run = measure(ring.pids(), lambda: drive(w, ring.gateway_urls, model, "sglang", out),
                      f"ringserve x{replicas}")
        steps = step_profile.delta(steps, step_profile.scrape(ring.scheduler_metrics))
        rows = step_profile.summary(steps)["decode_batch"]
    finally:
        ring.stop()
    rate = run.tok_s / rows if rows > 0 else math.nan
    floors = []
    if math.isfinite(rate):
        for kind in hop_floor.KINDS:
            log(f"floor: bare {kind} streams at {rate:,.0f} messages/s of {rows:.0f} rows")
            floors.append(hop_floor.measure(kind, rate, max(1, round(rows)), FLOOR_MESSAGES))
    return replace(run, rows_per_step=rows, floors=floors)


def run_vllm(model: Path, w: Workload, out: Path) -> RunCpu:
    from bench.vllm_server import start_vllm

    log("vLLM CPU: starting")
    srv, base = start_vllm(model, model.name)
    try:
        pid = srv.proc.pid
        assert pid is not None  # started
        warm([base], model, "vllm", out)
        log(f"vLLM CPU: {w.num_prompts} requests (its forward is real, so fewer)")
        run = measure({"vllm-api-server": [pid]}, lambda: drive(w, [base], model, "vllm", out), "vllm")
        return run
    finally:
        srv.stop()


def table(runs: list[RunCpu]) -> str:
    lines = ["| target | output tokens | tok/s | requests per decode step | gateway | tokenizer | detokenizer |"
             " ring total | floor: gRPC streams | floor: TCP streams | scheduler | vLLM API server |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        us = {s.service: f"{s.us_per_token:,.1f}" for s in r.services}
        if any(n in us for n in RING):
            us["ring"] = f"{r.ring_us_per_token():,.1f}"
        for kind in hop_floor.KINDS:
            if math.isfinite(r.floor(kind)):
                us[kind] = f"{r.floor(kind):,.1f}"
        cells = " | ".join(us.get(n, "") for n in (*RING, "ring", *hop_floor.KINDS[::-1], "scheduler",
                                                     "vllm-api-server"))
        rows = "" if math.isnan(r.rows_per_step) else f"{r.rows_per_step:.1f}"
        lines.append(f"| {r.target} | {r.output_tokens:,} | {r.tok_s:,.0f} | {rows} | {cells} |")
    return "\n".join(lines) + "\n\nCPU microseconds per streamed output token (process CPU time / tokens); " \
        "replicas of a service summed. Floors: two relays and a sink of bare streams (bench.hop_floor) at the " \
        "run's decode steps a second and requests per step, per token."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ring_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="tiny, 100m, smollm2-135m-instruct or a directory")
    ap.add_argument("--replicas", default="1,2", help="comma list of tokenizer+gateway replica counts")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vllm-prompts", type=int, default=64, help="requests for the vLLM anchor (0: skip it)")
    ap.add_argument("--out", type=Path, default=None, help="default .cache/bench/ring-cpu/<time>")
    args = ap.parse_args(argv)
    out = args.out or CACHE / "ring-cpu" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    model = resolve(args.model)
    w = Workload("B", "ring CPU", num_prompts=args.num_prompts, input_len=args.input_len,
                 output_len=args.output_len, max_concurrency=args.max_concurrency, seed=2)
    runs = [run_ring(model, int(n), w, out) for n in args.replicas.split(",") if n.strip()]
    for r in runs:
        log(f"{r.target}: {r.output_tokens:,} tokens at {r.tok_s:,.0f} tok/s, {r.rows_per_step:.1f} requests per "
            f"decode step, ring {r.ring_us_per_token():,.1f} us/token "
            f"({', '.join(f'{s.service} {s.us_per_token:,.1f}' for s in r.services)}; floor: gRPC streams "
            f"{r.floor('grpc'):,.1f}, TCP {r.floor('tcp'):,.1f})")
    if args.vllm_prompts > 0:
        runs.append(run_vllm(model, replace(w, num_prompts=args.vllm_prompts), out))
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit(), "model": model.name,
            "argv": sys.argv[1:], "runs": [r.to_dict() for r in runs]}
    (out / "ring_cpu.json").write_text(json.dumps(meta, indent=1))
    print(table(runs))
    log(f"results in {out}")
    return 0 if all(r.failed == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
