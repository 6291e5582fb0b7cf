"""The side-by-side table (markdown) with ratios against vLLM CPU, and the results JSON."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from pathlib import Path

from bench.targets import RunResult

COLUMNS = ["model", "workload", "target", "out tok/s", "total tok/s", "req/s", "TTFT p50/p90/p99 ms",
           "ITL p50/p90/p99 ms", "e2e p50/p90/p99 ms", "TPOT p50 ms", "out tok/s vs vLLM", "TTFT p50 vs vLLM"]


def _f(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _trio(p: dict) -> str:
    return "/".join(_f(p[k], 1 if p[k] < 100 else 0) for k in ("p50", "p90", "p99"))


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}x"


def rows(results: list[RunResult]) -> list[list[str]]:
    base = {(r.model, r.workload): r.summary for r in results if r.target == "vllm" and r.summary}
    out = []
    for r in results:
        if r.summary is None:
            note = r.note[:300 if r.status == "ok" else 80].replace("\n", " ")
            out.append([r.model, r.workload, r.target, r.status] + ["-"] * 6 + [note, ""])
            continue
        s, v = r.summary, base.get((r.model, r.workload))
        out.append([
            r.model, r.workload, r.target + ("" if r.status == "ok" else f" ({r.status})"),
            _f(s["output_throughput"]), _f(s["total_throughput"]), _f(s["request_throughput"], 2),
            _trio(s["ttft_ms"]), _trio(s["itl_ms"]), _trio(s["e2e_ms"]),
            _f(s["tpot_ms"].get("p50"), 1) if s.get("tpot_ms") else "-",
            _ratio(s["output_throughput"], v["output_throughput"] if v else None),
            _ratio(s["ttft_ms"]["p50"], v["ttft_ms"]["p50"] if v else None),
        ])
    return out


def markdown(results: list[RunResult]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows(results)]
    return "\n".join(lines)


OVERHEAD_COLUMNS = ["model", "workload", "out tok/s gateway / gRPC", "ITL p50 added ms", "TTFT p50 added ms"]


def overhead(results: list[RunResult]) -> str:
    """The gateway's cost on the same requests: `native` (HTTP /generate, token-id prompts) against
    `grpc` (the tokenizer's Generate, token-id prompts), per model and workload where native sent
    token ids (on text prompts the two do different work). Empty without such pairs. At a sweep
    point throughput is the offered load, not the server's: no ratio there."""
    by = {(r.target, r.model, r.workload): r.summary for r in results
          if r.summary and (r.target != "native" or r.extra.get("token_id_prompts"))}
    lines = []
    for r in results:
        if r.target != "grpc" or not r.summary or ("native", r.model, r.workload) not in by:
            continue
        g, h = r.summary, by[("native", r.model, r.workload)]
        ratio = _ratio(h["output_throughput"], g["output_throughput"]) if math.isinf(r.request_rate) else "-"
        lines.append([r.model, r.workload, ratio,
                      f"{h['itl_ms']['p50'] - g['itl_ms']['p50']:+.2f}",
                      f"{h['ttft_ms']['p50'] - g['ttft_ms']['p50']:+.1f}"])
    return _table(OVERHEAD_COLUMNS, lines)


PROFILE_COLUMNS = ["model", "workload", "target", "prefill steps", "ms / prefill step", "decode steps",
                   "ms / decode step", "requests / decode step"]
TIMING_FIELDS = ["tokenize_s", "to_scheduler_s", "queue_s", "prefill_s", "decode_s", "ring_hops_s",
                 "detokenize_s", "ttft_s", "e2e_s"]


def _table(columns: list[str], rows: list[list[str]]) -> str:
    if not rows:
        return ""
    head = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(head + ["| " + " | ".join(row) + " |" for row in rows])


def step_profiles(results: list[RunResult]) -> str:
    """The scheduler's steps during each run (all repeats): the served targets against the engine
    in-process show what running next to the other processes costs the forward."""
    rows = []
    for r in results:
        p = r.extra.get("step_profile")
        if p:
            rows.append([r.model, r.workload, r.target, _f(p["prefill_steps"]), _f(p["prefill_ms_per_step"], 1),
                         _f(p["decode_steps"]), _f(p["decode_ms_per_step"], 2), _f(p["decode_batch"], 1)])
    return _table(PROFILE_COLUMNS, rows)


def boundaries(results: list[RunResult]) -> str:
    """Where a request's time goes, by the server's own per-request timings (the grpc target asks
    for them): medians in ms."""
    rows = []
    for r in results:
        t = (r.summary or {}).get("timings_ms") or {}
        if t:
            rows.append([r.model, r.workload, r.target] + [_f(t.get(k), 1) for k in TIMING_FIELDS])
    return _table(["model", "workload", "target"] + [k.removesuffix("_s") for k in TIMING_FIELDS], rows)


def sections(results: list[RunResult]) -> str:
    """Everything after the main table, as markdown."""
    parts = [("Gateway overhead, same requests (native /generate vs the tokenizer's gRPC Generate)",
              overhead(results)),
             ("Scheduler step profile (forward, sampling and results per step; all repeats)",
              step_profiles(results)),
             ("Where a request's time goes (per-request medians from the server's timings, ms)",
              boundaries(results))]
    return "".join(f"\n{title}:\n\n{table}\n" for title, table in parts if table)


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_gib, 1), "python": platform.python_version(),
            "platform": platform.platform()}


def commit() -> str:
    """The checked-out commit (`git rev-parse --short HEAD`), `-dirty` when tracked files differ from it, so
    a published table says which code it measured; "" outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("-dirty" if dirty else "")


def write(out: Path, results: list[RunResult], meta: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps({**meta, "machine": machine(), "results": [r.to_dict() for r in results]},
                               indent=1))
    (out / "results.md").write_text(markdown(results) + "\n" + sections(results))
    return path
