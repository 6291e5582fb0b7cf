"""PNG plots: output throughput per target per workload, and latency against offered load."""

from __future__ import annotations

import math
from pathlib import Path

from bench.targets import TARGETS, RunResult

COLORS = dict(zip(TARGETS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:cyan",
                            "tab:brown")))


def _ok(results: list[RunResult]) -> list[RunResult]:
    return [r for r in results if r.summary and r.status == "ok"]


def throughput(results: list[RunResult], model: str, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    rs = [r for r in _ok(results) if r.model == model]
    if not rs:
        return None
    wls = list(dict.fromkeys(r.workload for r in rs))
    targets = list(dict.fromkeys(r.target for r in rs))
    # `if r.summary` holds for every r after _ok; it is there so that mypy sees the dict is not None
    val = {(r.workload, r.target): r.summary["output_throughput"] for r in rs if r.summary}
    width = 0.8 / len(targets)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(wls) + 2), 4))
    for k, t in enumerate(targets):
        xs = [i + (k - (len(targets) - 1) / 2) * width for i in range(len(wls))]
        ax.bar(xs, [val.get((w, t), 0.0) for w in wls], width, label=t, color=COLORS.get(t))
    ax.set_xticks(range(len(wls)), wls)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Output throughput by workload ({model})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_vs_load(results: list[RunResult], model: str, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    rs = [r for r in _ok(results) if r.model == model and r.family == "D" and not math.isinf(r.request_rate)]
    if not rs:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for t in dict.fromkeys(r.target for r in rs):
        pts = sorted((r.request_rate, r.summary) for r in rs if r.target == t and r.summary)  # summary: as above
        rates = [p[0] for p in pts]
        c = COLORS.get(t)
        for ax, key in ((axes[0], "ttft_ms"), (axes[1], "itl_ms")):
            ax.plot(rates, [p[1][key]["p50"] for p in pts], marker="o", color=c, label=f"{t} p50")
            ax.plot(rates, [p[1][key]["p99"] for p in pts], marker="x", color=c, linestyle="--", label=f"{t} p99")
        axes[2].plot(rates, [p[1]["output_throughput"] for p in pts], marker="o", color=c, label=t)
    for ax, title, unit in zip(axes, ("TTFT (p50 solid, p99 dashed)", "ITL (p50 solid, p99 dashed)",
                                      "output throughput"), ("ms", "ms", "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"Latency vs offered load, workload D ({model})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def all_plots(results: list[RunResult], out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        print("[bench] matplotlib is not installed: no plots (pip install matplotlib)", flush=True)
        return []
    matplotlib.use("Agg")
    made = []
    for model in dict.fromkeys(r.model for r in results):
        made += [p for p in (throughput(results, model, out / f"throughput-{model}.png"),
                             latency_vs_load(results, model, out / f"latency-vs-load-{model}.png")) if p]
    return made
