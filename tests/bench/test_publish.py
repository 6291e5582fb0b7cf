"""`make bench-table` (bench.publish): the README's Performance table and docs/benchmarks.md's results,
rewritten from a results.json between their markers, with nothing the run did not record."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench import publish
from bench.report import commit
from bench.stats import RequestRecord, summarize
from bench.targets import RunResult

DEFAULT = "SmolLM2-135M-Instruct"
TINY = "ringserve-tiny-llama"
INF = float("inf")


def _ok(target: str, model: str, workload: str, tok_per_s: float, ttft_s: float, itl_s: float,
        rate: float = INF) -> dict:
    recs = [RequestRecord(ok=True, prompt_len=10, output_len=int(tok_per_s), ttft=ttft_s, itls=[itl_s], e2e=1.0)]
    r = RunResult(target, model, workload, workload[0], rate, "ok", summary=summarize(recs, 1.0).to_dict(),
                  extra={"loadavg_before": 0.25})
    return r.to_dict()


def _results(models: tuple[str, ...] = (TINY, DEFAULT), commit: str | None = "abc1234") -> dict:
    results = []
    for m in models:
        scale = 10 if m == TINY else 1  # the tiny model is ten times faster: the tables must not mix them
        results += [
            _ok("gateway", m, "A", 1500 * scale, 0.2, 0.004),
            _ok("vllm", m, "A", 1000 * scale, 0.25, 0.005),
            RunResult("grpc", m, "A", "A", INF, "failed", note="did not start").to_dict(),
            _ok("gateway", m, "D@4", 256, 0.02, 0.002, rate=4.0),
            _ok("vllm", m, "D@4", 255, 0.015, 0.0015, rate=4.0),
            RunResult("transformers", m, "own", "own", INF, "ok", note="output tok/s: c=32: engine 900").to_dict(),
        ]
    meta = {"started": "2026-12-01 22:12:32", "argv": ["--models", "smollm2-135m-instruct,tiny", "--out", "/x/y"],
            "repeats": 3, "machine": {"cpu": "AMD EPYC 9B14", "cores": 2, "mem_gib": 23.5},
            "dtypes": {DEFAULT: "bfloat16", TINY: "float32"},
            "workloads": [{"name": "A", "title": "32 x 128 in / 64 out, all at once"},
                          {"name": "D@4", "title": "Poisson arrivals at 4 req/s"}]}
    if commit is not None:
        meta["commit"] = commit
    return {**meta, "results": results}


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A results directory with a plot per model, and a README and docs page holding the markers."""
    out = tmp_path / "results" / "20261201-221232"
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps(_results()))
    for m in (DEFAULT, TINY):
        (out / f"throughput-{m}.png").write_bytes(f"png of {m}".encode())
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Performance\n\n<!-- bench-table:start -->\nold table\n<!-- bench-table:end -->\n\n"
                      "More text.\n")
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text("# Benchmarks\n\n## Results\n\n<!-- bench-results:start -->\nold\n<!-- bench-results:end -->\n")
    (docs.parent / "bench").mkdir()
    (docs.parent / "bench" / "throughput-old-model.png").write_bytes(b"stale")
    return out, readme, docs


def _rows(block: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell."""
    return {cells[0]: cells[1:] for line in block.splitlines() if line.startswith("| ") and "---" not in line
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_the_readme_gets_the_default_model_with_its_run_and_ratios(tree) -> None:
    out, readme, docs = tree
    publish.publish(publish.load(out), readme, docs)
    text = readme.read_text()
    assert text.startswith("# x\n\n## Performance\n\n<!-- bench-table:start -->\n") and "old table" not in text
    assert text.endswith("<!-- bench-table:end -->\n\nMore text.\n")
    block = text.split("<!-- bench-table:start -->")[1].split("<!-- bench-table:end -->")[0]
    assert f"**{DEFAULT}** (the default model" in block and "No `make bench` results" not in block
    assert "both servers in bfloat16" in block
    for fact in ("2026-12-01 22:12:32", "commit `abc1234`", "AMD EPYC 9B14, 2 cores",
                 "`make bench ARGS='--models smollm2-135m-instruct,tiny'`"):
        assert fact in block
    assert "/x/y" not in block  # where the results went is not part of the command
    rows = _rows(block)
    assert rows["workload"] == ["vLLM CPU", "gateway `/v1/completions`", "gRPC API", "TTFT p50 gateway / vLLM",
                                "ITL p50 gateway / vLLM"]
    assert rows["A: 32 x 128 in / 64 out, all at once"] == ["1,000", "1,500 (1.50x)", "failed", "200 / 250",
                                                            "4.0 / 5.0"]
    # at a fixed request rate throughput is the offered load: no tok/s, no ratio, only the latencies
    assert rows["D@4: Poisson arrivals at 4 req/s"] == ["-", "-", "-", "20.0 / 15.0", "2.0 / 1.5"]
    assert "15,000" not in block  # the tiny model's figures stay out of the default model's table
    assert f"{TINY} figures" in block and "docs/benchmarks.md" in block


def test_the_docs_get_every_model_default_first_and_the_run_s_plots(tree) -> None:
    out, readme, docs = tree
    publish.publish(publish.load(out), readme, docs)
    text = docs.read_text()
    assert text.index(f"### {DEFAULT}") < text.index(f"### {TINY}")
    tiny = text.split(f"### {TINY}")[1]
    assert _rows(tiny)["A: 32 x 128 in / 64 out, all at once"][:2] == ["10,000", "15,000 (1.50x)"]
    assert "output tok/s: c=32: engine 900" in tiny
    plots = docs.parent / "bench"
    assert sorted(p.name for p in plots.iterdir()) == [f"throughput-{DEFAULT}.png", f"throughput-{TINY}.png"]
    assert (plots / f"throughput-{TINY}.png").read_bytes() == f"png of {TINY}".encode()
    assert f"](bench/throughput-{DEFAULT}.png)" in text.split(f"### {TINY}")[0]
    # published once, the same run changes nothing: --check passes
    assert publish.publish(publish.load(out), readme, docs, check=True) == []
    assert publish.main([str(out / "results.json"), "--readme", str(readme), "--docs", str(docs), "--check"]) == 0


def test_check_writes_nothing_and_reports_every_change(tree) -> None:
    out, readme, docs = tree
    before = readme.read_text(), docs.read_text()
    changed = publish.publish(publish.load(out), readme, docs, check=True)
    assert {p.name for p in changed} == {"README.md", "benchmarks.md", "throughput-old-model.png",
                                         f"throughput-{DEFAULT}.png", f"throughput-{TINY}.png"}
    assert (readme.read_text(), docs.read_text()) == before
    assert (docs.parent / "bench" / "throughput-old-model.png").exists()
    assert publish.main([str(out), "--readme", str(readme), "--docs", str(docs), "--check"]) == 1


def test_a_run_without_the_default_model_or_a_commit_says_so(tree) -> None:
    out, readme, docs = tree
    (out / "results.json").write_text(json.dumps(_results(models=(TINY,), commit=None)))
    publish.publish(publish.load(out), readme, docs)
    block = readme.read_text()
    assert f"No `make bench` results for the default model ({DEFAULT}) yet" in block
    assert f"**{TINY}** (the 4.5M-parameter random-weight model the tests use, not the default model; " \
           "both servers in float32)" in block
    assert "commit `not recorded`" in block


def test_missing_markers_and_missing_results_are_clear_errors(tree, tmp_path: Path) -> None:
    out, readme, docs = tree
    readme.write_text("# no markers here\n")
    with pytest.raises(SystemExit, match="bench-table:start"):
        publish.publish(publish.load(out), readme, docs)
    with pytest.raises(SystemExit, match="no results under"):
        publish.newest(tmp_path / "empty")
    with pytest.raises(SystemExit, match="no results.json"):
        publish.load(tmp_path / "nowhere")


def test_the_newest_run_is_the_last_written(tree) -> None:
    out, _, _ = tree
    older = out.parent / "20991231-000000"  # a later name, written earlier: the write time decides
    older.mkdir()
    (older / "results.json").write_text(json.dumps(_results()))
    os.utime(older / "results.json", (1, 1))
    assert publish.newest(out.parent) == out / "results.json"


def test_the_run_records_its_commit() -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    assert head and commit().removesuffix("-dirty") == head


def test_a_run_with_a_kv_cache_dtype_says_so(tree) -> None:
    out, readme, docs = tree
    data = json.loads((out / "results.json").read_text())
    data["kv_cache_dtype"] = "fp8_e4m3"
    (out / "results.json").write_text(json.dumps(data))
    publish.publish(publish.load(out), readme, docs)
    assert "both servers in bfloat16, KV cache fp8_e4m3)" in readme.read_text()


def test_a_run_where_the_servers_took_turns_says_so(tree) -> None:
    out, readme, docs = tree
    publish.publish(publish.load(out), readme, docs)
    assert "median of 3 repeats and its ratio" in readme.read_text()  # an older run: nothing recorded
    data = json.loads((out / "results.json").read_text())
    data["taking_turns"] = True
    (out / "results.json").write_text(json.dumps(data))
    publish.publish(publish.load(out), readme, docs)
    assert "median of 3 repeats (the two servers taking turns) and its ratio" in readme.read_text()
