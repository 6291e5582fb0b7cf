"""`make bench-table`: the README's Performance table and docs/benchmarks.md's results, from one `make bench` run.

    python -m bench.publish [RESULTS] [--check]

RESULTS is a results.json or the directory holding one; default: the newest under .cache/bench/results/.
Rewrites what lies between the marker comments
- `<!-- bench-table:start -->` / `<!-- bench-table:end -->` in README.md: the default model's table (else,
  saying so, the first model the run measured), with the run's date, commit, CPU and command;
- `<!-- bench-results:start -->` / `<!-- bench-results:end -->` in docs/benchmarks.md: every model's table
  (the default model first), the report's further tables and the run's plots, which are copied into
  docs/bench/ (PNGs of an earlier run there are removed, so the page shows one run).
With --check nothing is written: the exit status is 1 when a file would change.
Every figure comes from the results file: a field the run did not record is printed as "not recorded".
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import report
from bench.targets import RunResult
from bench.venvs import CACHE, ROOT
from ringserve.model_source import SMOLLM2_DIR_NAME

README_MARKERS = ("<!-- bench-table:start -->", "<!-- bench-table:end -->")
DOCS_MARKERS = ("<!-- bench-results:start -->", "<!-- bench-results:end -->")
PLOTS_DIR = "bench"  # under docs/, next to benchmarks.md, which links the plots relatively

# Column order of the tables, and what each target is called there.
COLUMNS = {"vllm": "vLLM CPU", "gateway": "gateway `/v1/completions`", "native": "gateway `/generate`",
           "grpc": "gRPC API", "smg": "smg (SGLang's gateway) `/v1/completions`", "engine": "engine in-process"}
# What a reader needs to know about each model `make bench` builds or fetches (results name it by directory).
MODELS = {SMOLLM2_DIR_NAME: "the default model: 135M parameters, real weights",
          "ringserve-tiny-llama": "the 4.5M-parameter random-weight model the tests use, not the default model",
          "ringserve-100m-llama": "a ~100M-parameter random-weight model of the same family"}


@dataclass(frozen=True)
class Run:
    """One results.json: what the run recorded about itself, and its results."""

    path: Path
    meta: dict
    results: list[RunResult]

    @property
    def models(self) -> list[str]:
        """Every model measured, the default model first, then in the run's order."""
        names = list(dict.fromkeys(r.model for r in self.results))
        return sorted(names, key=lambda m: m != SMOLLM2_DIR_NAME)


def load(path: Path) -> Run:
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise SystemExit(f"error: no results.json at {path}")
    data = json.loads(file.read_text())
    results = [RunResult(**r) for r in data.pop("results", [])]
    if not results:
        raise SystemExit(f"error: {file} holds no results")
    return Run(file, data, results)


def newest(results_dir: Path) -> Path:
    found = sorted(results_dir.glob("*/results.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"error: no results under {results_dir}: run `make bench` first, or name a results.json")
    return found[-1]


def command(meta: dict) -> str:
    """The run's command as `make bench` takes it, less --out (where results went says nothing about
    what was measured)."""
    argv = [str(a) for a in meta.get("argv", [])]
    kept: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            kept.append(a)
    return f"make bench ARGS='{' '.join(kept)}'" if kept else "make bench"


def _f(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _ms(x: float) -> str:
    return _f(x, 1 if x < 100 else 0)


def caption(run: Run, model: str) -> str:
    m = run.meta.get("machine", {})
    cpu = m.get("cpu") or "CPU not recorded"
    where = f"{cpu}, {m.get('cores', '?')} cores, {m.get('mem_gib', '?')} GiB" if m else "machine not recorded"
    commit = run.meta.get("commit") or "not recorded"
    first = next((r for r in run.results if r.model == model), None)
    load = first.extra.get("loadavg_before") if first else None
    busy = f"; 1-minute load average {load:.1f} when it started" if isinstance(load, (int, float)) else ""
    repeats = run.meta.get("repeats", 1)
    # runs from before the servers took turns (bench.targets.run_model) ran each server's repeats in one go
    turns = " (the two servers taking turns)" if run.meta.get("taking_turns") else ""
    started = run.meta.get("started", "date not recorded")
    dtype = run.meta.get("dtypes", {}).get(model, "float32")  # runs before --dtype were float32 throughout
    kv = run.meta.get("kv_cache_dtype", "auto")
    dtype += f", KV cache {kv}" if kv != "auto" else ""
    return (f"**{model}** ({MODELS.get(model, 'a model directory')}; both servers in {dtype}). Run {started}, "
            f"commit `{commit}`, {where}{busy}. Command: `{command(run.meta)}`. Output tokens/s of the median of "
            f"{repeats} repeat{'s' if repeats != 1 else ''}{turns} "
            "and its ratio to vLLM CPU in the same run; "
            "TTFT and ITL are medians in ms; at a fixed request rate (D) throughput is the offered load, so only "
            "latencies are shown.")


def _by(run: Run, model: str) -> dict[tuple[str, str], dict]:
    return {(r.workload, r.target): r.summary for r in run.results
            if r.model == model and r.summary and r.status == "ok"}


def table(run: Run, model: str) -> str:
    """Throughput (with its ratio to vLLM) on the all-at-once workloads; TTFT and ITL through the gateway
    against vLLM's on every workload (at a fixed request rate throughput is the offered load, so only the
    latencies say anything there)."""
    by = _by(run, model)
    ours = [r for r in run.results if r.model == model]
    workloads = list(dict.fromkeys(r.workload for r in ours if r.workload != "own"))
    titles = {w["name"]: w.get("title", "") for w in run.meta.get("workloads", [])}
    rates = {r.workload: r.request_rate for r in ours}
    targets = [t for t in COLUMNS if any(r.target == t for r in ours)]  # a failed target shows as failed
    head = ["workload", *(COLUMNS[t] for t in targets), "TTFT p50 gateway / vLLM", "ITL p50 gateway / vLLM"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads:
        base = by.get((w, "vllm"))
        cells = [f"{w}: {titles.get(w, '')}".rstrip(": ")]
        for t in targets:
            s = by.get((w, t))
            if s is None:
                cells.append("failed" if any(r.workload == w and r.target == t for r in ours) else "-")
            elif not math.isinf(rates.get(w, math.inf)):
                cells.append("-")  # throughput at a fixed request rate is the offered load
            elif t == "vllm" or not base:
                cells.append(_f(s["output_throughput"]))
            else:
                tok_s = s["output_throughput"]
                cells.append(f"{_f(tok_s)} ({tok_s / base['output_throughput']:.2f}x)")
        gw = by.get((w, "gateway"))
        for key in ("ttft_ms", "itl_ms"):
            cells.append(f"{_ms(gw[key]['p50'])} / {_ms(base[key]['p50'])}" if gw and base else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def transformers_note(run: Run, model: str) -> str:
    r = next((r for r in run.results if r.model == model and r.target == "transformers"), None)
    if r is None or r.status != "ok":
        return ""
    return f"transformers on the same weights, in process ({r.note})."


def readme_block(run: Run) -> str:
    model = run.models[0]
    parts = []
    if model != SMOLLM2_DIR_NAME:
        parts.append(f"No `make bench` results for the default model ({SMOLLM2_DIR_NAME}) yet: the newest run "
                     "measured only the models below.")
    parts += [caption(run, model), table(run, model)]
    others = run.models[1:]
    if others:
        parts.append(f"The same run's {', '.join(others)} figures, the plots and the step profiles: "
                     "[docs/benchmarks.md](docs/benchmarks.md#results).")
    return "\n\n".join(parts)


def docs_block(run: Run, plots: list[str]) -> str:
    parts = []
    for model in run.models:
        section = [f"### {model}", caption(run, model), table(run, model)]
        note = transformers_note(run, model)
        if note:
            section.append(note)
        section += [f"![{name}]({PLOTS_DIR}/{name})" for name in plots if name.endswith(f"-{model}.png")]
        extra = report.sections([r for r in run.results if r.model == model]).strip()
        if extra:
            section.append(extra)
        parts.append("\n\n".join(section))
    return "\n\n".join(parts)


def splice(text: str, markers: tuple[str, str], block: str, where: Path) -> str:
    start, end = markers
    i, j = text.find(start), text.find(end)
    if i < 0 or j < 0 or j < i:
        raise SystemExit(f"error: {where} needs the markers {start} and {end}, in that order")
    return text[:i + len(start)] + "\n" + block.strip() + "\n" + text[j:]


def plot_files(run: Run) -> list[Path]:
    return sorted(p for model in run.models for p in run.path.parent.glob(f"*-{model}.png"))


def publish(run: Run, readme: Path, docs: Path, check: bool = False) -> list[Path]:
    """Rewrite both files (and docs/bench/'s plots) from `run`; the paths that changed, or would."""
    plots = plot_files(run)
    plots_dir = docs.parent / PLOTS_DIR
    changed = []
    for path, markers, block in ((readme, README_MARKERS, readme_block(run)),
                                 (docs, DOCS_MARKERS, docs_block(run, [p.name for p in plots]))):
        old = path.read_text()
        new = splice(old, markers, block, path)
        if new != old:
            changed.append(path)
            if not check:
                path.write_text(new)
    wanted = {p.name: p for p in plots}
    stale = [p for p in plots_dir.glob("*.png") if p.name not in wanted] if plots_dir.is_dir() else []
    for p in stale:
        changed.append(p)
        if not check:
            p.unlink()
    for name, src in wanted.items():
        dst = plots_dir / name
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            changed.append(dst)
            if not check:
                plots_dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.publish", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", type=Path, default=None,
                    help="a results.json or its directory (default: the newest under .cache/bench/results/)")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")
    args = ap.parse_args(argv)
    run = load(args.results or newest(CACHE / "results"))
    changed = publish(run, args.readme, args.docs, check=args.check)
    verb = "would change" if args.check else "updated"
    print(f"{run.path}: {verb}: {', '.join(str(p) for p in changed) or 'nothing'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
