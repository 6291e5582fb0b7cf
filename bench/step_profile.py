"""The scheduler's step profile over a run: prefill and decode steps, ms per step, requests per decode step.

The served targets read it from the scheduler's `ringserve:forward_*` counters before and after a
run; the in-process engine from its `SchedulerStats`. Side by side they show what the services cost
the forward itself (on a small machine: the same steps taking longer next to the other processes).
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

FIELDS = ("prefill_steps", "decode_steps", "prefill_s", "decode_s", "decode_rows")


def scrape(url: str) -> dict[str, float]:
    """The counters from a scheduler's /metrics (zeros where absent)."""
    out = dict.fromkeys(FIELDS, 0.0)
    text = httpx.get(url, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            mode = sample.labels.get("mode")
            if sample.name == "ringserve:forward_steps_total" and mode:
                out[f"{mode}_steps"] += sample.value
            elif sample.name == "ringserve:forward_seconds_total" and mode:
                out[f"{mode}_s"] += sample.value
            elif sample.name == "ringserve:decode_rows_total":
                out["decode_rows"] += sample.value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in FIELDS}


def summary(d: dict[str, float]) -> dict[str, float]:
    """Counts -> what the report shows."""
    def per(a: float, b: float, scale: float = 1.0) -> float:
        return a / b * scale if b else float("nan")

    return {"prefill_steps": d["prefill_steps"], "prefill_ms_per_step": per(d["prefill_s"], d["prefill_steps"], 1e3),
            "decode_steps": d["decode_steps"], "decode_ms_per_step": per(d["decode_s"], d["decode_steps"], 1e3),
            "decode_batch": per(d["decode_rows"], d["decode_steps"])}
