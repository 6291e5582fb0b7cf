"""The table: ratios against vLLM on the same model and workload; failures shown with their reason."""

from __future__ import annotations

from bench.report import markdown, overhead
from bench.stats import RequestRecord, summarize
from bench.targets import RunResult


def _ok(target: str, tok_per_s: float, ttft: float, itl: float = 0.01) -> RunResult:
    recs = [RequestRecord(ok=True, prompt_len=10, output_len=int(tok_per_s), ttft=ttft, itls=[itl], e2e=1.0)]
    return RunResult(target, "m", "A", "A", float("inf"), "ok", summary=summarize(recs, 1.0).to_dict())


def test_ratios_against_vllm_and_failed_rows() -> None:
    failed = RunResult("grpc", "m", "A", "A", float("inf"), "failed", note="ringserve did not start: boom")
    table = markdown([_ok("gateway", 500, 0.2), failed, _ok("vllm", 1000, 0.1)])
    lines = table.splitlines()
    assert len(lines) == 5
    gateway = lines[2].split(" | ")
    assert gateway[-2:] == ["0.50x", "2.00x |"]
    assert "ringserve did not start: boom" in lines[3] and "failed" in lines[3]
    assert lines[4].split(" | ")[-2:] == ["1.00x", "1.00x |"]


def test_parse_scheduler_bench_lines() -> None:
    from bench.targets import parse_scheduler_bench

    text = ("model tiny\n  c=1   engine       64 tokens in   0.50s =    128.0 tok/s\n"
            "  c=1   hf-seq failed: RuntimeError: x\n  c=32  hf-cb      2048 tokens in   1.00s =   2048.0 tok/s\n")
    assert parse_scheduler_bench(text) == {"c=1": {"engine": 128.0}, "c=32": {"hf-cb": 2048.0}}


def test_gateway_overhead_is_native_against_grpc() -> None:
    assert overhead([_ok("gateway", 500, 0.2), _ok("vllm", 1000, 0.1)]) == ""
    native = _ok("native", 950, 0.25, itl=0.0105)
    assert overhead([native, _ok("grpc", 1000, 0.2)]) == ""  # text prompts: not the same requests
    native.extra["token_id_prompts"] = True
    table = overhead([native, _ok("grpc", 1000, 0.2, itl=0.01)]).splitlines()
    assert table[2].split(" | ")[2:] == ["0.95x", "+0.50", "+50.0 |"]


def test_step_profile_and_boundary_tables() -> None:
    from bench import step_profile
    from bench.report import boundaries, step_profiles

    served = _ok("grpc", 1000, 0.2)
    served.extra["step_profile"] = step_profile.summary(step_profile.delta(
        dict.fromkeys(step_profile.FIELDS, 0.0),
        {"prefill_steps": 4, "decode_steps": 100, "prefill_s": 0.4, "decode_s": 0.7, "decode_rows": 3200}))
    served.summary["timings_ms"] = {"queue_s": 12.0, "prefill_s": 80.0}
    row = step_profiles([served]).splitlines()[2].split(" | ")
    assert row[3:] == ["4", "100.0", "100", "7.00", "32.0 |"]
    row = boundaries([served]).splitlines()[2].split(" | ")
    assert row[3:6] == ["-", "-", "12.0"] and row[6] == "80.0"
    assert step_profiles([_ok("vllm", 1, 0.1)]) == "" and boundaries([_ok("vllm", 1, 0.1)]) == ""


def test_step_profile_reads_the_scheduler_counters(monkeypatch) -> None:
    from bench import step_profile

    text = ('# TYPE ringserve:forward_steps counter\n'
            'ringserve:forward_steps_total{model_name="m",mode="prefill"} 3.0\n'
            'ringserve:forward_steps_total{model_name="m",mode="decode"} 50.0\n'
            '# TYPE ringserve:forward_seconds counter\n'
            'ringserve:forward_seconds_total{model_name="m",mode="prefill"} 0.3\n'
            'ringserve:forward_seconds_total{model_name="m",mode="decode"} 0.25\n'
            '# TYPE ringserve:decode_rows counter\n'
            'ringserve:decode_rows_total{model_name="m"} 800.0\n')

    class Resp:
        def __init__(self) -> None:
            self.text = text

    monkeypatch.setattr(step_profile.httpx, "get", lambda url, timeout: Resp())
    got = step_profile.scrape("http://x/metrics")
    assert got == {"prefill_steps": 3.0, "decode_steps": 50.0, "prefill_s": 0.3, "decode_s": 0.25,
                   "decode_rows": 800.0}
