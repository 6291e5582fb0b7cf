"""bench.engine_bench, the in-process engine-vs-transformers run behind `make bench`'s
transformers target: every mode produces the whole output, and its table parses."""

from __future__ import annotations

import torch

from bench import engine_bench as bench
from bench.targets import parse_scheduler_bench


def test_generate_batch_gets_a_cache_sized_to_the_workload() -> None:
    kwargs = bench._hf_cb_cache([[1] * 300, [1] * 10], out_len=64)
    if not kwargs:  # a transformers without ContinuousBatchingConfig sizes its own
        return
    cfg = kwargs["continuous_batching_config"]
    # 364 tokens need two pages of 256, 74 one: three blocks, not a share of the machine's RAM
    assert cfg.num_blocks == 3 and cfg.max_batch_tokens == 2048


def test_every_mode_generates_every_token(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = bench.make_prompts(3, 5, 20, hf.config.vocab_size, seed=1)
    for run in (bench.run_hf_seq, bench.run_hf_static, bench.run_hf_cb):
        assert run(hf, prompts, 6) == (len(prompts) if run is not bench.run_hf_seq else
                                       min(len(prompts), bench.HF_SEQ_MAX_REQUESTS)) * 6, run.__name__


def test_the_printed_table_is_what_the_bench_target_reads(capsys) -> None:
    assert bench.main(["--shape", "tiny", "--concurrency", "2", "--output-len", "4", "--skip", "hf-seq,hf-static"]) == 0
    rates = parse_scheduler_bench(capsys.readouterr().out)
    assert set(rates) == {"c=2"} and set(rates["c=2"]) == {"engine", "hf-cb"}
    assert all(r > 0 for r in rates["c=2"].values())


def test_moe_decode_bench_times_both_sides(monkeypatch, capsys) -> None:
    """`engine_bench --moe` on a tiny stand-in for the Qwen3-30B-A3B shape: one row per batch size."""
    monkeypatch.setattr(bench, "MOE_SHAPE", {**bench.MOE_SHAPE, "hidden_size": 64, "num_experts": 8,
                                             "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                             "intermediate_size": 64, "num_attention_heads": 4,
                                             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256})
    assert bench.main(["--moe", "--moe-layers", "2", "--concurrency", "1,4", "--moe-context", "4",
                       "--moe-steps", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "4"] and all(float(x) > 0 for r in rows for x in r[1:])
